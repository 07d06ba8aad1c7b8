"""What every model file gets checked for before a trusting reader sees it, and the model it describes.

Model files come from strangers on the hub, so every length, type and byte range in a header is checked
first, bounded by the file's size, and any problem becomes one ModelFormatError naming the file. GGUF
headers are checked by the one GGUF reader as it reads them (edgellm/gguf_file.py, which uses the shared
pieces here: FileLayout, the byte-range overlap check, file_error); safetensors headers are checked here,
before `safetensors.safe_open` trusts them. A model's config is then checked against the tensors it
claims, so nothing downstream (numpy, the C++ kernels) ever sees a shape it did not expect. Nothing here
allocates more than the header it reads.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelFormatError, UnsupportedModelError

# Limits on a model's shape: far above any real Llama-family model, low enough that nothing built from
# them (the RoPE table, the layer plan) can exhaust memory before the tensors are checked against them.
MAX_CONTEXT = 1 << 24
MAX_WIDTH = 1 << 20  # dim, ffn, vocab, heads × head_dim


@dataclass
class TensorInfo:
    shape: tuple[int, ...]  # row-major (PyTorch) order: GGUF stores ne[0] (the fastest dim) first
    dtype: str  # GGML type name or safetensors dtype
    file: Path
    start: int = 0  # byte range in the file
    end: int = 0


@dataclass
class FileLayout:
    """What a model file holds, as checked: its tensors and their byte ranges."""

    path: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def file_error(path: Path, message: str, cls: type = ModelFormatError) -> Exception:
    """The error for `path`, on one printable line however the file's names and keys are spelled."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    return cls(f"{path}: {text if len(text) <= 300 else text[:300] + '...'}")


def open_bytes(path: Path) -> tuple[Any, int]:
    """(a read-only map of the file or b"" when it is empty, size); OS errors become ModelFormatError."""
    try:
        if not path.is_file():
            raise file_error(path, f"not a regular file")
        with open(path, "rb") as f:
            size = path.stat().st_size
            if size == 0:
                return b"", 0
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    except OSError as e:
        raise file_error(path, f"cannot read ({e.strerror or e})") from e


def no_overlaps(layout: FileLayout) -> None:
    """No two tensors share a byte (a file whose tensors alias could pass every other check)."""
    spans = sorted((t.start, t.end, name) for name, t in layout.tensors.items())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise file_error(layout.path, f"tensors {a} and {b} overlap in the file")


# ------------------------------------------------------------------------------------------------
# Safetensors
# ------------------------------------------------------------------------------------------------
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors crate's own limit
SAFETENSORS_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                     "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_safetensors_file(path: str | Path) -> FileLayout:
    """The 8-byte header length against the file size, the JSON header's types, and every tensor's
    byte range: inside the file, the size its shape and dtype need, no overlaps."""
    path = Path(path)
    buf, size = open_bytes(path)
    try:
        if size < 8:
            raise file_error(path, f"not a safetensors file ({size} bytes, the header length alone is 8)")
        n = struct.unpack_from("<Q", buf, 0)[0]
        if n > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise file_error(path, f"safetensors header claims {n} bytes in a file of {size}: truncated "
                                   f"or not a safetensors file")
        try:
            header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise file_error(path, f"safetensors header is not valid JSON ({str(e)[:120]})") from None
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    if not isinstance(header, dict):
        raise file_error(path, f"safetensors header is not a JSON object")
    data_size = size - 8 - n
    layout = FileLayout(path)
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise file_error(path, f"safetensors __metadata__ must map strings to strings")
            continue
        layout.tensors[name] = _safetensors_entry(path, name, entry, data_size, 8 + n)
    no_overlaps(layout)
    return layout


def _safetensors_entry(path: Path, name: str, entry: Any, data_size: int, data_start: int) -> TensorInfo:
    def bad(what: str) -> ModelFormatError:
        return file_error(path, f"tensor {name}: {what}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if dtype not in SAFETENSORS_SIZES:
        raise file_error(path, f"tensor {name} has dtype {dtype}, which edgellm does not read", UnsupportedModelError)
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {str(shape)[:80]} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise bad(f"data_offsets {str(offsets)[:80]} do not lie inside the file's {data_size} data bytes")
    need = math.prod(shape) * SAFETENSORS_SIZES[dtype]
    if offsets[1] - offsets[0] != need:
        raise bad(f"data_offsets span {offsets[1] - offsets[0]} bytes; shape {shape} of {dtype} needs {need}")
    return TensorInfo(tuple(shape), dtype, path, data_start + offsets[0], data_start + offsets[1])


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------------
# The model a file describes: config values in range, tensors of the shapes the config implies
# ------------------------------------------------------------------------------------------------
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
HF_TYPES: dict[str, tuple[type, ...]] = {
    "vocab_size": (int,), "hidden_size": (int,), "num_hidden_layers": (int,), "num_attention_heads": (int,),
    "intermediate_size": (int,), "num_key_value_heads": (int, type(None)), "head_dim": (int, type(None)),
    "max_position_embeddings": (int,), "sliding_window": (int, type(None)), "rms_norm_eps": (int, float),
    "partial_rotary_factor": (int, float, type(None)), "query_pre_attn_scalar": (int, float, type(None)),
    "rope_theta": (int, float, type(None)), "rope_scaling": (dict, type(None)), "rope_parameters": (dict, type(None)),
    "tie_word_embeddings": (bool, type(None)), "attention_bias": (bool, type(None)),
    "use_sliding_window": (bool, type(None)),
    "architectures": (list, type(None)), "model_type": (str, type(None)),
    "bos_token_id": (int, list, type(None)), "eos_token_id": (int, list, type(None)),
}


def hf_config(raw: Any, path: Path):
    """A HF config.json's dict → a checked ModelConfig: required keys present, values of the right
    type (a string where a number belongs is named, not left to fail inside arithmetic)."""
    from .config import ModelConfig

    if not isinstance(raw, dict):
        raise file_error(path, f"not a JSON object")
    for key in HF_REQUIRED:
        if key not in raw:
            raise file_error(path, f"lacks {key}")
    for key, types in HF_TYPES.items():
        if key in raw and (not isinstance(raw[key], types) or (bool not in types and isinstance(raw[key], bool))):
            raise file_error(path, f"{key} should be {' or '.join(_type_word(t) for t in types)}, "
                                   f"found {_type_word(type(raw[key]))} {str(raw[key])[:40]}")
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(raw.get(key), list) and not all(_is_int(i) for i in raw[key]):
            raise file_error(path, f"{key} should be an integer or a list of integers")
    return checked_config(lambda: ModelConfig.from_hf(raw, source=str(path)), path)


def _type_word(t: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list",
            dict: "an object", type(None): "null"}.get(t, t.__name__)


def checked_config(build, path: Path):
    """Run a config builder over untrusted metadata, name the file in whatever it refuses, and check
    the values it produced (check_config)."""
    from .errors import EdgeLLMError

    try:
        cfg = build()
    except EdgeLLMError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, OverflowError) as e:
        raise file_error(path, f"cannot read the model's configuration ({type(e).__name__}: "
                               f"{str(e)[:120]})") from e
    check_config(cfg, path)
    return cfg


def check_config(cfg: Any, path: Path) -> None:
    """Sizes positive and bounded, numbers finite, RoPE settings that define a rotation."""
    def bad(what: str) -> ModelFormatError:
        return file_error(path, f"{what}")

    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim"):
        value = getattr(cfg, name)
        if not _is_int(value) or not 1 <= value <= MAX_WIDTH:
            raise bad(f"model {name} = {value!r} is out of range (1 to {MAX_WIDTH})")
    if cfg.n_heads * cfg.head_dim > MAX_WIDTH:
        raise bad(f"{cfg.n_heads} heads of {cfg.head_dim} are out of range")
    if cfg.head_dim % 2:
        raise bad(f"head size {cfg.head_dim} is odd: rotary embeddings need pairs")
    if cfg.n_heads % cfg.n_kv_heads:
        raise bad(f"{cfg.n_heads} attention heads are not a multiple of {cfg.n_kv_heads} KV heads")
    ctx = cfg.max_position_embeddings
    if not _is_int(ctx) or not 1 <= ctx <= MAX_CONTEXT:
        raise bad(f"context length {ctx!r} is out of range (1 to {MAX_CONTEXT})")
    if cfg.sliding_window is not None and (not _is_int(cfg.sliding_window) or cfg.sliding_window < 1):
        raise bad(f"sliding window {cfg.sliding_window!r} is not a positive integer")
    if not _finite(cfg.norm_eps) or cfg.norm_eps < 0:
        raise bad(f"norm epsilon {cfg.norm_eps!r} is not a non-negative number")
    if not _finite(cfg.rope_theta) or cfg.rope_theta <= 1:
        raise bad(f"rope theta {cfg.rope_theta!r} is not a number above 1")
    if not _is_int(cfg.rotary_dim) or not 2 <= cfg.rotary_dim <= cfg.head_dim or cfg.rotary_dim % 2:
        raise bad(f"rotary dims {cfg.rotary_dim!r} are not an even number from 2 to the head size {cfg.head_dim}")
    if not all(_is_int(w) and 0 <= w <= MAX_CONTEXT for w in cfg.layer_windows):
        raise bad(f"a layer's sliding window is out of range (0 to {MAX_CONTEXT})")
    if not _finite(cfg.query_scale) or cfg.query_scale < 0:
        raise bad(f"query scale {cfg.query_scale!r} is not a non-negative number")
    _check_rope_scaling(cfg.rope_scaling, bad)
    sc = cfg.rope_scaling or {}
    if sc.get("rope_type") == "longrope":  # one factor per rotary frequency, each a positive number
        for key in ("short_factor", "long_factor"):
            factors = sc.get(key)
            if not isinstance(factors, list) or len(factors) != cfg.rotary_dim // 2 or \
                    not all(_finite(f) and f > 0 for f in factors):
                raise bad(f"LongRoPE {key} needs {cfg.rotary_dim // 2} positive numbers (one per rotary frequency)")
    freqs = (cfg.extra or {}).get("rope_freqs")
    if freqs is not None and (len(freqs) != cfg.head_dim // 2 or not all(_finite(f) and f > 0 for f in freqs)):
        raise bad(f"rope_freqs needs {cfg.head_dim // 2} positive factors")


def _check_rope_scaling(sc: Any, bad) -> None:
    if sc is None:
        return
    if not isinstance(sc, dict):
        raise bad("rope scaling is not an object")

    def positive(key: str, default: Any = 1.0) -> float:
        value = sc.get(key, default)
        if value is None:
            value = default
        if not _finite(value) or value <= 0:
            raise bad(f"rope scaling {key} = {value!r} is not a positive number")
        return float(value)

    positive("factor")
    kind = sc.get("rope_type")
    if kind == "llama3":
        if positive("low_freq_factor") >= positive("high_freq_factor", 4.0):
            raise bad("rope scaling low_freq_factor must be below high_freq_factor")
        positive("original_max_position_embeddings", 8192)
    elif kind == "yarn":
        positive("beta_fast", 32.0), positive("beta_slow", 1.0), positive("original_max_position_embeddings", 1)
        if sc.get("attention_factor") is not None:
            positive("attention_factor")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_tensor_shapes(layout: FileLayout, cfg: Any, names: dict[str, str]) -> None:
    """Every tensor the config names has the shape the config implies (so a lying header cannot send a
    mis-sized tensor into a reshape or a kernel), and the layer count is one the file can hold."""
    tensors = layout.tensors
    if cfg.n_layers > len(tensors):
        raise file_error(layout.path, f"the config says {cfg.n_layers} layers; the file has "
                               f"{len(tensors)} tensors")
    expect = {names["embed"]: (cfg.vocab_size, cfg.dim), names["output"]: (cfg.vocab_size, cfg.dim),
              names["norm"]: (cfg.dim,), "rope_freqs.weight": (cfg.head_dim // 2,)}
    q, kv, ffn, dim = cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.dim
    per_layer = {"q": q, "k": kv, "v": kv}
    for i in range(cfg.n_layers):
        for x, rows in per_layer.items():
            stem = names[x].format(i=i)
            expect[stem + ".weight"], expect[stem + ".bias"] = (rows, dim), (rows,)
        expect[names["o"].format(i=i)] = (dim, q)
        gate, up = names["gate"].format(i=i), names["up"].format(i=i)
        expect[gate] = (ffn, dim)
        expect[up] = (ffn, dim) if gate in tensors else (2 * ffn, dim)  # Phi-3's GGUF: gate and up fused in ffn_up
        expect[names["down"].format(i=i)] = (dim, ffn)
        expect[names["attn_norm"].format(i=i)] = expect[names["ffn_norm"].format(i=i)] = (dim,)
    for name, shape in expect.items():
        t = tensors.get(name)
        if t is not None and tuple(t.shape) != shape:
            raise file_error(t.file, f"tensor {name} has shape {list(t.shape)}; the model's config "
                                   f"implies {list(shape)}")


def check_tokenizer(tok: Any, cfg: Any, path: Path) -> None:
    """Every id the tokenizer can produce indexes the model's embedding: a vocabulary larger than the
    embedding would send an out-of-range id into the lookup (in the C++ kernels, a read past the table)."""
    if tok.id_count is not None:  # the top id without the whole vocabulary as a dict (0.1 s for Llama 3's)
        top = tok.id_count - 1
        token = tok.id_to_token(top)
    else:
        vocab = tok.backend.get_vocab(with_added_tokens=True)
        top = max(vocab.values(), default=-1)
        token = next((t for t, i in vocab.items() if i == top), None)
    if top >= cfg.vocab_size:
        raise file_error(path, f"the tokenizer has token {token!r} with id {top}, past the model's {cfg.vocab_size} "
                           f"embeddings")
    if tok.bos_id is not None and not (_is_int(tok.bos_id) and 0 <= tok.bos_id < cfg.vocab_size):
        raise file_error(path, f"BOS token id {tok.bos_id!r} is not one of the model's {cfg.vocab_size} tokens")
