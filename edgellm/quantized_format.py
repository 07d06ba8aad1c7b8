"""The edgellm folder format: a quantized model saved as stored, loaded back without requantizing.

The folder holds `model.safetensors` (codes, scales, mins, float tensors), `tokenizer.json`, and `edgellm.json`
(format version, config, per-tensor quantization, tokenizer metadata, chat template). Written to a temp folder
and renamed, so an interrupt leaves nothing; read with every failure naming the folder's files.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .atomic import AtomicFolder
from .config import ModelConfig
from .errors import EdgeLLMError, ModelFormatError
from .file_checks import check_safetensors_file, checked_config
from .model import Transformer
from .quant.convert import QuantSettings, install_quantized, quantized_tensors
from .quant.groups import QuantizedTensor
from .tokenizer import Tokenizer

FORMAT_VERSION = 1


def save_edgellm(loaded, out: Path, settings: QuantSettings) -> Path:
    """Write `loaded` (a loading.LoadedModel whose weights were quantized with `settings`) as an edgellm folder."""
    from safetensors.torch import save_file

    model = loaded.model
    tensors: dict[str, torch.Tensor] = {}
    quant_meta: dict[str, Any] = {}
    for name, qt in quantized_tensors(model).items():
        if name == "output" and model.config.tie_embeddings:
            continue  # shares the embedding's codes
        quant_meta[name + ".weight"] = {"bits": qt.bits, "group_size": qt.group_size, "symmetric": qt.symmetric,
                                        "shape": list(qt.shape)}
        tensors[name + ".codes"] = qt.codes.contiguous().cpu()
        tensors[name + ".scales"] = qt.scales.contiguous().cpu()
        if qt.mins is not None:
            tensors[name + ".mins"] = qt.mins.contiguous().cpu()
    for name, p in model.state_dict().items():  # floats: norms, biases, unquantized matrices
        if name.endswith((".codes", ".scales", ".mins")) or name.startswith("rope_"):
            continue
        if name == "output.weight" and model.config.tie_embeddings:
            continue
        tensors[name] = p.contiguous().cpu()
    tok = loaded.tokenizer
    meta = {
        "format": "edgellm", "version": FORMAT_VERSION, "config": model.config.to_dict(),
        "quantization": asdict(settings), "tensors": quant_meta,
        "tokenizer": {"bos_id": tok.bos_id, "eos_ids": sorted(tok.eos_ids), "add_bos": tok.add_bos,
                      "bos_token": tok.bos_token, "eos_token": tok.eos_token, **getattr(tok, "meta", {})},
        "chat_template": tok.chat_template,
        "source": str(loaded.path),
    }
    with AtomicFolder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
        (tmp / "edgellm.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return out


def load_edgellm(folder: Path, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer, config, file_bytes, tensor_types) from an edgellm folder; no requantization."""
    meta_path = folder / "edgellm.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{meta_path}: not valid JSON ({e})") from e
    if (not isinstance(meta, dict) or meta.get("format") != "edgellm" or not isinstance(meta.get("version", 0), int)
            or meta.get("version", 0) > FORMAT_VERSION):
        raise ModelFormatError(f"{meta_path}: not an edgellm folder of a version this edgellm reads")
    try:  # an edgellm folder can come from anyone too: every failure below names the folder's files
        return _build_edgellm(folder, meta, dtype, device)
    except EdgeLLMError as e:
        if str(folder) in str(e):
            raise
        raise type(e)(f"{meta_path}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as e:
        raise ModelFormatError(f"{meta_path}: not a valid edgellm folder ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160] if str(e) else ''})") from e


def _build_edgellm(folder: Path, meta: dict, dtype: torch.dtype, device: torch.device):
    from safetensors import safe_open

    cfg = checked_config(lambda: ModelConfig.from_dict(meta["config"]), folder / "edgellm.json")
    weights = folder / "model.safetensors"
    check_safetensors_file(weights)
    try:
        handle = safe_open(str(weights), framework="pt")
        raw = {k: handle.get_tensor(k) for k in handle.keys()}
    except Exception as e:
        raise ModelFormatError(f"{weights}: cannot read ({str(e).splitlines()[0]}); the file may be truncated") from e
    qtensors = {}
    for name, q in meta["tensors"].items():
        module = name.rsplit(".", 1)[0]
        qtensors[name] = QuantizedTensor(q["bits"], q["group_size"], q["symmetric"], tuple(q["shape"]),
                                         raw.pop(module + ".codes"), raw.pop(module + ".scales"),
                                         raw.pop(module + ".mins", None))
    state = {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in raw.items()}
    with torch.device("meta"):
        model = Transformer(cfg)
    params = dict(model.named_parameters())
    for name, qt in qtensors.items():  # the kernels trust these shapes: they must be the model's
        if name not in params or tuple(params[name].shape) != tuple(qt.shape):
            want = list(params[name].shape) if name in params else "no such tensor"
            raise ModelFormatError(f"{weights}: tensor {name} has shape {list(qt.shape)}; the config implies {want}")
    install_quantized(model, qtensors, state, dtype, device)
    model.eval().requires_grad_(False)
    from tokenizers import Tokenizer as Backend

    t = meta["tokenizer"]
    tok = Tokenizer(Backend.from_file(str(folder / "tokenizer.json")), t["bos_id"], set(t["eos_ids"]), t["add_bos"],
                    meta.get("chat_template"), t.get("bos_token") or "", t.get("eos_token") or "")
    tok.meta = {k: t[k] for k in ("model", "pre") if k in t}
    types: dict[str, int] = {}
    for q in meta["tensors"].values():
        key = f"int{q['bits']}-g{q['group_size']}-{'sym' if q['symmetric'] else 'asym'}"
        types[key] = types.get(key, 0) + 1
    types["float"] = len(state)
    return model, tok, cfg, weights.stat().st_size, types
