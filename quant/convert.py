"""Whole-model quantization, the edgellm folder format, and GGUF import/export.

- `quantize_weights(name, tensor)` decides per parameter: the layer linears get the requested
  int8/int4 format; the embedding / LM head (a fifth of SmolLM2) gets `embeddings` (int8 default);
  norms and biases stay float.
- GGUF Q8_0 / Q4_0 / Q4_1 tensors become our codes by a byte reshuffle (`groups.from_gguf`), never a
  dequantize/requantize round trip, when the requested bit width matches; other types are dequantized
  by `gguf.quants` and requantized.
- The edgellm format is a folder: `model.safetensors` (codes, scales, mins, float tensors),
  `tokenizer.json`, and `edgellm.json` (format version, config, per-tensor quantization, tokenizer
  metadata, chat template). Written to a temp folder and renamed, so an interrupt leaves nothing.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..atomic import AtomicFile, AtomicFolder
from ..errors import EdgeLLMError, ModelFormatError, QuantizationError
from .groups import QuantizedTensor, dequantize, from_gguf, quantize, to_gguf
from .linear import QuantEmbedding, QuantLinear

FORMAT_VERSION = 1
LINEAR_SUFFIXES = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w13.weight", "feed_forward.w2.weight")
GGUF_EXACT = {"Q8_0": (8, True), "Q4_0": (4, True), "Q4_1": (4, False)}


@dataclass
class QuantSettings:
    weights: str = "int4"  # int8 | int4
    group_size: int = 32  # int8 also accepts 0 = per output channel
    symmetric: bool = True  # int4 only; int8 is always symmetric
    embeddings: str = "int8"  # int8 | int4 | fp — the embedding table / LM head
    search: bool = True  # search scales (and mins) instead of round-to-nearest
    calibration: str | None = None  # "builtin" or a text file: activation-weighted search (calibrate.py)

    def __post_init__(self) -> None:
        if self.weights not in ("int8", "int4"):
            raise QuantizationError(f"weights must be int8 or int4, not {self.weights!r}")
        if self.embeddings not in ("int8", "int4", "fp"):
            raise QuantizationError(f"embeddings must be int8, int4 or fp, not {self.embeddings!r}")
        allowed = (0, 32, 64, 128) if self.weights == "int8" else (32, 64, 128)
        if self.group_size not in allowed:
            raise QuantizationError(f"group size {self.group_size} is not supported for {self.weights} "
                                    f"(choose from {', '.join(map(str, allowed))})")

    def format_for(self, name: str) -> tuple[int, int, bool] | None:
        """(bits, group, symmetric) for parameter `name`, or None to keep it float."""
        if name.endswith(LINEAR_SUFFIXES):
            fmt = self.weights
        elif name in ("tok_embeddings.weight", "output.weight"):
            fmt = self.embeddings
        else:
            return None
        if fmt == "fp":
            return None
        bits = 8 if fmt == "int8" else 4
        group = self.group_size or 0
        if bits == 4 and group == 0:
            group = 32
        return bits, group, bits == 8 or self.symmetric


def quantize_tensor(w: torch.Tensor, fmt: tuple[int, int, bool], search: bool,
                    importance: torch.Tensor | None = None) -> QuantizedTensor | None:
    """Quantize one weight; a tensor whose input dim is no multiple of the group falls back to a
    smaller group (as llama.cpp falls back to another type), or stays float (None) if none fits.
    `importance` [in_features]: per-channel weights of the search's error (quant/calibrate.py)."""
    bits, group, sym = fmt
    k = w.shape[1]
    group = group or k
    while k % group and group > 32:
        group //= 2
    if k % group:
        return None
    return quantize(w.float(), bits, group, symmetric=sym, search=search or importance is not None,
                    importance=importance)


def try_exact_gguf(parts: list[tuple[Any, Any, tuple[int, int]]], fmt: tuple[int, int, bool],
                   permute: list[int | None]) -> QuantizedTensor | None:
    """Map raw GGUF blocks onto our format when every part has one exactly-mappable type of at most
    the bit width asked for (the group of GGUF blocks is 32 whatever was asked)."""
    names = {p[1].name for p in parts}
    if len(names) != 1 or next(iter(names)) not in GGUF_EXACT:
        return None
    bits, sym = GGUF_EXACT[next(iter(names))]
    if bits > fmt[0]:
        return None  # asked for fewer bits than stored: requantize
    # stored with fewer (or as many) bits as asked: requantizing could only add error, so keep them
    pieces = []
    for (raw, ggml_type, shape), heads in zip(parts, permute):
        qt = from_gguf(raw, ggml_type, shape)
        if heads:
            qt = permute_rows(qt, heads)
        pieces.append(qt)
    return concat_rows(pieces)


def _row_op(qt: QuantizedTensor, fn: Callable[[torch.Tensor], torch.Tensor], rows: int) -> QuantizedTensor:
    return QuantizedTensor(qt.bits, qt.group_size, qt.symmetric, (rows, qt.shape[1]), fn(qt.codes),
                           fn(qt.scales), None if qt.mins is None else fn(qt.mins))


def permute_rows(qt: QuantizedTensor, n_heads: int) -> QuantizedTensor:
    """Undo llama.cpp's Q/K row permutation on packed rows (rows are independent)."""
    from ..loading import unpermute_rope_rows

    return _row_op(qt, lambda t: unpermute_rope_rows(t, n_heads).contiguous(), qt.shape[0])


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any((p.bits, p.group_size, p.symmetric) != (first.bits, first.group_size, first.symmetric) for p in parts):
        raise QuantizationError("cannot fuse tensors quantized differently")
    rows = sum(p.shape[0] for p in parts)
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return QuantizedTensor(first.bits, first.group_size, first.symmetric, (rows, first.shape[1]),
                           torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


def split_rows(qt: QuantizedTensor, sizes: list[int]) -> list[QuantizedTensor]:
    out, start = [], 0
    for n in sizes:
        out.append(_row_op(qt, lambda t, s=start, n=n: t[s:s + n].contiguous(), n))
        start += n
    return out


# ------------------------------------------------------------------------------------------------
# Building a quantized model on the meta device
# ------------------------------------------------------------------------------------------------
def install_quantized(model: nn.Module, qtensors: dict[str, QuantizedTensor], state: dict[str, torch.Tensor],
                      dtype: torch.dtype, device: torch.device) -> None:
    """Swap QuantLinear / QuantEmbedding modules in for the quantized parameters, then assign the
    float ones. A tied embedding/LM head is stored once and shared by both modules."""
    for name, qt in qtensors.items():
        qt = qt.to(device) if hasattr(qt, "to") else qt
        module_name = name.rsplit(".", 1)[0]
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            new = QuantEmbedding.from_quantized(qt, dtype=dtype)
        else:
            bias = state.pop(module_name + ".bias", None)
            new = QuantLinear.from_quantized(qt, bias=bias)
        setattr(parent, attr, new)
    if model.config.tie_embeddings and "tok_embeddings.weight" in qtensors:
        model.output = QuantLinear.from_quantized(model.tok_embeddings.qtensor())
        state.pop("output.weight", None)
    missing = set(n for n, _ in model.named_parameters()) - set(state)
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_embeddings and isinstance(model.tok_embeddings, nn.Embedding):
        model.output.weight = model.tok_embeddings.weight
        missing.discard("output.weight")
    missing -= set(state)
    if missing - {"output.weight"}:
        raise ModelFormatError(f"missing tensors: {sorted(missing)[:3]}")


def quantized_tensors(model: nn.Module) -> dict[str, QuantizedTensor]:
    return {name: m.qtensor() for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


# ------------------------------------------------------------------------------------------------
# The edgellm folder format
# ------------------------------------------------------------------------------------------------
def save_edgellm(loaded, out: Path, settings: QuantSettings) -> Path:
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

    from ..config import ModelConfig
    from ..file_checks import check_safetensors_file, checked_config
    from ..model import Transformer
    from ..tokenizer import Tokenizer

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


# ------------------------------------------------------------------------------------------------
# GGUF export (llama.cpp / Ollama can run the result)
# ------------------------------------------------------------------------------------------------
def export_gguf(loaded, out: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Write the quantized model as GGUF: group-32 int8 → Q8_0, int4 sym → Q4_0, int4 asym → Q4_1,
    floats → F32; fused Q/K/V and gate/up split back; Q/K rows permuted back to llama.cpp's layout."""
    import gguf
    import numpy as np

    from ..loading import permute_rope_rows

    model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
    qts = quantized_tensors(model)
    for name, qt in qts.items():
        if qt.group_size != 32 and not (qt.bits == 8 and qt.group_size == 32):
            raise QuantizationError(f"GGUF export needs group size 32 ({name} uses {qt.group_size}); "
                                    f"quantize with --group-size 32")
    if tok.meta.get("model") not in ("gpt2", "llama"):
        raise QuantizationError("GGUF export: this tokenizer cannot be described in GGUF metadata")
    if cfg.arch not in ("llama", "mistral", "qwen2"):
        raise QuantizationError(f"GGUF export writes the llama and qwen2 architectures; this model is {cfg.arch}: "
                                f"use --format edgellm")
    arch = "qwen2" if cfg.arch == "qwen2" else "llama"
    permute = arch == "llama"

    def add(writer, name: str, value) -> None:
        if isinstance(value, QuantizedTensor):
            raw, ggml_type = to_gguf(value)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=ggml_type)
        else:
            writer.add_tensor(name, value.detach().float().cpu().numpy())
        if progress:
            progress(name)

    def weight(module_name: str):
        if module_name in qts:
            return qts[module_name]
        return model.get_submodule(module_name).weight

    def rows(value, sizes: list[int]):
        if isinstance(value, QuantizedTensor):
            return split_rows(value, sizes)
        return list(value.split(sizes, dim=0))

    def perm(value, heads: int):
        if not permute:
            return value
        if isinstance(value, QuantizedTensor):
            return _row_op(value, lambda t: permute_rope_rows(t, heads).contiguous(), value.shape[0])
        return permute_rope_rows(value, heads)

    with AtomicFile(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(Path(str(loaded.path)).stem)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.dim)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_vocab_size(cfg.vocab_size)
        if cfg.rope_scaling and cfg.rope_scaling["rope_type"] in ("linear", "yarn"):
            w.add_rope_scaling_type(gguf.RopeScalingType(cfg.rope_scaling["rope_type"]))
            w.add_rope_scaling_factor(float(cfg.rope_scaling.get("factor", 1.0)))
        _add_tokenizer(w, tok)
        if cfg.extra.get("rope_freqs"):
            w.add_tensor("rope_freqs.weight", np.asarray(cfg.extra["rope_freqs"], dtype=np.float32))
        elif cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3":
            from ..config import rope_inv_freq, ModelConfig

            plain = ModelConfig(**{**cfg.to_dict(), "rope_scaling": None})
            ratio = rope_inv_freq(plain)[0] / rope_inv_freq(cfg)[0]
            w.add_tensor("rope_freqs.weight", ratio.float().numpy())
        add(w, "token_embd.weight", weight("tok_embeddings"))
        for i in range(cfg.n_layers):
            pre = f"layers.{i}."
            q, k, v = rows(weight(pre + "attention.wqkv"), [cfg.q_size, cfg.kv_size, cfg.kv_size])
            add(w, f"blk.{i}.attn_q.weight", perm(q, cfg.n_heads))
            add(w, f"blk.{i}.attn_k.weight", perm(k, cfg.n_kv_heads))
            add(w, f"blk.{i}.attn_v.weight", v)
            bias = model.get_submodule(pre + "attention.wqkv").bias
            if bias is not None:
                bq, bk, bv = bias.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
                add(w, f"blk.{i}.attn_q.bias", perm(bq, cfg.n_heads))
                add(w, f"blk.{i}.attn_k.bias", perm(bk, cfg.n_kv_heads))
                add(w, f"blk.{i}.attn_v.bias", bv)
            add(w, f"blk.{i}.attn_output.weight", weight(pre + "attention.wo"))
            gate, up = rows(weight(pre + "feed_forward.w13"), [cfg.intermediate_size] * 2)
            add(w, f"blk.{i}.ffn_gate.weight", gate)
            add(w, f"blk.{i}.ffn_up.weight", up)
            add(w, f"blk.{i}.ffn_down.weight", weight(pre + "feed_forward.w2"))
            add(w, f"blk.{i}.attn_norm.weight", model.get_submodule(pre + "attention_norm").weight)
            add(w, f"blk.{i}.ffn_norm.weight", model.get_submodule(pre + "ffn_norm").weight)
        add(w, "output_norm.weight", model.norm.weight)
        if not cfg.tie_embeddings:
            add(w, "output.weight", weight("output"))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def _add_tokenizer(w, tok) -> None:
    spec = json.loads(tok.backend.to_str())
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    w.add_tokenizer_model(tok.meta["model"])
    w.add_tokenizer_pre(tok.meta.get("pre", "default"))
    w.add_token_list(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    if tok.meta["model"] == "llama":
        # sentencepiece merges the pair whose result scores highest: score = -merge rank keeps our order
        rank = {m.replace(" ", ""): -float(r) for r, m in reversed(list(enumerate(merges)))}
        w.add_token_scores([rank.get(t, -1e6) for t in tokens])
        types = [3 if i in specials else 6 if t.startswith("<0x") and len(t) == 6 else 1 for i, t in enumerate(tokens)]
    else:
        types = [3 if i in specials else 1 for i in range(size)]
    w.add_token_types(types)
    if merges and tok.meta["model"] == "gpt2":
        w.add_token_merges(merges)
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    eos = tok.backend.token_to_id(tok.eos_token) if tok.eos_token else None
    if eos is None and tok.eos_ids:
        eos = min(tok.eos_ids)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(bool(tok.add_bos))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
