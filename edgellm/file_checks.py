"""Model files are checked here before a trusting reader sees them.

`gguf.GGUFReader` believes a file's header: a lying array length makes it loop for ever, a lying
tensor size makes numpy map past the end, an unknown type raises whatever the enum raises. Model
files come from strangers on the hub, so every count, length, type, dimension and offset is checked
first, bounded by the file's size (the way llama.cpp's own gguf.cpp does), and any problem becomes
one ModelFormatError naming the file. Safetensors headers get the same treatment, and a model's
config is checked against the tensors it claims, so nothing downstream (the reader, numpy, the C++
kernels) ever sees a shape it did not expect. Nothing here allocates more than the header it reads.
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

# GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
GGUF_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
MAX_KV = 1 << 16  # metadata entries (real files: ~30-60)
MAX_TENSORS = 1 << 20  # tensor infos (real files: hundreds to a few thousand)
MAX_ARRAY = 1 << 24  # items in one metadata array (vocabularies: up to ~300k)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# value type → (struct format, size); 8 = string and 9 = array are handled apart
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
           7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9
INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
FLOAT_TYPES = {6, 12}
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}

# Limits on a model's shape: far above any real Llama-family model, low enough that nothing built from
# them (the RoPE table, the layer plan) can exhaust memory before the tensors are checked against them.
MAX_CONTEXT = 1 << 24
MAX_WIDTH = 1 << 20  # dim, ffn, vocab, heads × head_dim


@dataclass
class KV:
    """One GGUF metadata entry: its type and, for scalars and strings, its value; for arrays the item
    type and count (the items themselves are left to the reader, after they have been bounded here)."""

    type: int
    value: Any = None
    item_type: int | None = None
    count: int = 0


@dataclass
class TensorInfo:
    shape: tuple[int, ...]  # row-major (PyTorch) order: GGUF stores ne[0] (the fastest dim) first
    dtype: str  # GGML type name or safetensors dtype
    file: Path
    start: int = 0  # byte range in the file
    end: int = 0


@dataclass
class FileLayout:
    """What a model file holds, as checked: its metadata (GGUF) and its tensors."""

    path: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, KV] = field(default_factory=dict)


def _error(path: Path, message: str, cls: type = ModelFormatError) -> Exception:
    """The error for `path`, on one printable line however the file's names and keys are spelled."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    return cls(f"{path}: {text if len(text) <= 300 else text[:300] + '...'}")


# ------------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------------
class _Reader:
    """A cursor over the mapped file that refuses to step past its end."""

    def __init__(self, buf: Any, path: Path, endian: str):
        self.buf, self.path, self.endian, self.pos, self.size = buf, path, endian, 0, len(buf)

    def fail(self, message: str) -> ModelFormatError:
        return _error(self.path, f"{message}")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.fail(f"{what} runs past the end of the file at byte {self.pos} "
                            f"(truncated, or a length that lies)")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = SCALARS[vtype]
        return struct.unpack_from(self.endian + fmt, self.buf, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {start + e.start})") from None

    def skip_strings(self, count: int, what: str) -> None:
        # Vocabularies are arrays of 50k-300k strings: validate without keeping them.
        buf, fmt = self.buf, self.endian + "Q"
        for i in range(count):
            n = struct.unpack_from(fmt, buf, self.take(8, f"the length of {what}[{i}]"))[0]
            start = self.take(n, f"{what}[{i}]")
            try:
                buf[start:start + n].decode("utf-8")
            except UnicodeDecodeError:
                raise self.fail(f"{what}[{i}] is not valid UTF-8") from None


def _open_bytes(path: Path) -> tuple[Any, int]:
    """(a read-only map of the file or b"" when it is empty, size); OS errors become ModelFormatError."""
    try:
        if not path.is_file():
            raise _error(path, f"not a regular file")
        with open(path, "rb") as f:
            size = path.stat().st_size
            if size == 0:
                return b"", 0
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    except OSError as e:
        raise _error(path, f"cannot read ({e.strerror or e})") from e


def check_gguf_file(path: str | Path) -> FileLayout:
    """Walk the whole GGUF header with every length bounded by the file; check tensor types, shapes
    and data ranges. Returns what was read; raises ModelFormatError (UnsupportedModelError for a
    version or tensor type we cannot read) naming the file."""
    path = Path(path)
    buf, size = _open_bytes(path)
    if size == 0:
        raise _error(path, f"empty file")
    try:
        return _parse_gguf(buf, path)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def _parse_gguf(buf: Any, path: Path) -> FileLayout:
    if buf[:4] != b"GGUF":
        raise _error(path, f"not a GGUF file (bad magic)")
    if len(buf) < 24:
        raise _error(path, f"truncated GGUF header ({len(buf)} bytes)")
    version = struct.unpack_from("<I", buf, 4)[0]
    endian = "<"
    if version & 0xFFFF == 0:  # written on a big-endian machine (as gguf.GGUFReader detects it)
        endian, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in GGUF_VERSIONS:
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are)")
    r = _Reader(buf, path, endian)
    r.pos = 8
    n_tensors, n_kv = r.u64("the tensor count"), r.u64("the metadata count")
    # Each entry takes bytes: a count the file cannot hold is a lie, refused before any loop.
    if n_kv > MAX_KV or n_kv * 13 > len(buf):
        raise r.fail(f"metadata count {n_kv} is impossible for a file of {len(buf)} bytes")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > len(buf):
        raise r.fail(f"tensor count {n_tensors} is impossible for a file of {len(buf)} bytes")
    layout = FileLayout(path)
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}")
        if key in layout.metadata:
            raise r.fail(f"duplicate metadata key {key!r}")
        layout.metadata[key] = _read_value(r, key)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in layout.metadata:
        kv = layout.metadata["general.alignment"]
        if kv.type != 4 or not kv.value or kv.value & (kv.value - 1):
            raise r.fail("general.alignment must be a power of two stored as uint32")
        alignment = kv.value
    infos = []
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}")
        n_dims = r.u32(f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [r.u64(f"the dimensions of tensor {name}") for _ in range(n_dims)]
        ggml_type = r.u32(f"the type of tensor {name}")
        offset = r.u64(f"the data offset of tensor {name}")
        infos.append((name, dims, ggml_type, offset))
    data_start = -(-r.pos // alignment) * alignment
    _gguf_tensors(layout, infos, data_start, alignment, len(buf))
    _check_gguf_metadata(layout)
    return layout


def _read_value(r: _Reader, key: str) -> KV:
    vtype = r.u32(f"the type of {key}")
    if vtype in SCALARS:
        return KV(vtype, r.scalar(vtype, key))
    if vtype == STRING:
        return KV(vtype, r.string(key))
    if vtype != ARRAY:
        raise r.fail(f"metadata {key} has unknown value type {vtype}")
    item = r.u32(f"the item type of {key}")
    count = r.u64(f"the length of {key}")
    if count > MAX_ARRAY:
        raise r.fail(f"metadata {key} claims {count} items (more than {MAX_ARRAY})")
    if item in SCALARS:
        r.take(count * SCALARS[item][1], f"array {key} ({count} items)")
    elif item == STRING:
        if count * 8 > r.size - r.pos:
            raise r.fail(f"array {key} ({count} strings) runs past the end of the file")
        r.skip_strings(count, key)
    else:  # llama.cpp refuses nested arrays too
        raise r.fail(f"metadata {key} is an array of {TYPE_NAMES.get(item, f'unknown type {item}')}")
    return KV(vtype, None, item, count)


def _gguf_tensors(layout: FileLayout, infos: list, data_start: int, alignment: int, size: int) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = layout.path
    for name, dims, ggml_type, offset in infos:
        if name in layout.tensors:
            raise _error(path, f"duplicate tensor {name}")
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _error(path, f"tensor {name} has unknown GGML type {ggml_type}", UnsupportedModelError) from None
        if any(d == 0 or d >= 1 << 62 for d in dims):
            raise _error(path, f"tensor {name} has impossible dimensions {dims}")
        if dims[0] % block:
            raise _error(path, f"tensor {name} of type {qtype.name} has a row of {dims[0]} values, "
                                   f"not a multiple of its block of {block}")
        n_bytes = math.prod(dims) // block * type_size
        if offset % alignment:
            raise _error(path, f"tensor {name} data offset {offset} is not aligned to {alignment}")
        start = data_start + offset
        if start + n_bytes > size:
            raise _error(path, f"tensor {name} ({n_bytes} bytes at {start}) ends past the end of the "
                                   f"file ({size} bytes): truncated, or an offset or shape that lies")
        layout.tensors[name] = TensorInfo(tuple(reversed(dims)), qtype.name, path, start, start + n_bytes)
    _no_overlaps(layout)


def _no_overlaps(layout: FileLayout) -> None:
    spans = sorted((t.start, t.end, name) for name, t in layout.tensors.items())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise _error(layout.path, f"tensors {a} and {b} overlap in the file")


# The metadata edgellm reads, with the type it must have: a wrong type is refused here, by name, rather
# than failing later inside int() or the tokenizer. `{arch}.` keys are checked for the file's architecture.
INT, FLOAT, STR, BOOL = "integer", "number", "string", "bool"
ARCH_KEYS = {
    "context_length": INT, "embedding_length": INT, "block_count": INT, "feed_forward_length": INT,
    "attention.head_count": INT, "attention.head_count_kv": INT, "attention.key_length": INT,
    "attention.value_length": INT, "attention.layer_norm_rms_epsilon": FLOAT, "rope.freq_base": FLOAT,
    "rope.dimension_count": INT, "rope.scaling.type": STR, "rope.scaling.factor": FLOAT,
    "rope.scaling.original_context_length": INT, "vocab_size": INT,
}
GENERAL_KEYS = {
    "general.architecture": STR, "general.name": STR,
    "tokenizer.ggml.model": STR, "tokenizer.ggml.pre": STR, "tokenizer.chat_template": STR,
    "tokenizer.ggml.tokens": [STR], "tokenizer.ggml.merges": [STR], "tokenizer.ggml.scores": [FLOAT],
    "tokenizer.ggml.token_type": [INT], "tokenizer.ggml.add_bos_token": BOOL, "tokenizer.ggml.add_space_prefix": BOOL,
    "tokenizer.ggml.bos_token_id": INT, "tokenizer.ggml.eos_token_id": INT, "tokenizer.ggml.eot_token_id": INT,
    "tokenizer.ggml.unknown_token_id": INT, "tokenizer.ggml.padding_token_id": INT,
}
TOKEN_ID_KEYS = ("bos", "eos", "eot", "unknown", "padding")


def _type_ok(vtype: int, want: str) -> bool:
    return {INT: vtype in INT_TYPES, FLOAT: vtype in FLOAT_TYPES | INT_TYPES, STR: vtype == STRING,
            BOOL: vtype == 7}[want]


def _check_gguf_metadata(layout: FileLayout) -> None:
    meta, path = layout.metadata, layout.path
    arch = meta.get("general.architecture")
    schema = dict(GENERAL_KEYS)
    if arch is not None and arch.type == STRING:
        schema.update({f"{arch.value}.{k}": t for k, t in ARCH_KEYS.items()})
    for key, want in schema.items():
        kv = meta.get(key)
        if kv is None:
            continue
        if isinstance(want, list):
            ok = kv.type == ARRAY and _type_ok(kv.item_type, want[0])
            want_text = f"an array of {want[0]}s"
        else:
            ok = _type_ok(kv.type, want)
            want_text = f"{'an' if want[0] in 'aeiou' else 'a'} {want}"
        if not ok:
            found = TYPE_NAMES[kv.type] + (f" of {TYPE_NAMES[kv.item_type]}" if kv.type == ARRAY else "")
            raise _error(path, f"metadata {key} should be {want_text}, found {found}")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if tokens else 0
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in meta and meta[key].count != n_tokens:
            raise _error(path, f"{key} has {meta[key].count} entries for {n_tokens} tokens")
    for name in TOKEN_ID_KEYS:
        kv = meta.get(f"tokenizer.ggml.{name}_token_id")
        if kv is not None and not 0 <= kv.value < n_tokens:
            raise _error(path, f"tokenizer.ggml.{name}_token_id {kv.value} is not one of the "
                                   f"{n_tokens} tokens")


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
    buf, size = _open_bytes(path)
    try:
        if size < 8:
            raise _error(path, f"not a safetensors file ({size} bytes, the header length alone is 8)")
        n = struct.unpack_from("<Q", buf, 0)[0]
        if n > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise _error(path, f"safetensors header claims {n} bytes in a file of {size}: truncated "
                                   f"or not a safetensors file")
        try:
            header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _error(path, f"safetensors header is not valid JSON ({str(e)[:120]})") from None
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    if not isinstance(header, dict):
        raise _error(path, f"safetensors header is not a JSON object")
    data_size = size - 8 - n
    layout = FileLayout(path)
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _error(path, f"safetensors __metadata__ must map strings to strings")
            continue
        layout.tensors[name] = _safetensors_entry(path, name, entry, data_size, 8 + n)
    _no_overlaps(layout)
    return layout


def _safetensors_entry(path: Path, name: str, entry: Any, data_size: int, data_start: int) -> TensorInfo:
    def bad(what: str) -> ModelFormatError:
        return _error(path, f"tensor {name}: {what}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if dtype not in SAFETENSORS_SIZES:
        raise _error(path, f"tensor {name} has dtype {dtype}, which edgellm does not read", UnsupportedModelError)
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
        raise _error(path, f"not a JSON object")
    for key in HF_REQUIRED:
        if key not in raw:
            raise _error(path, f"lacks {key}")
    for key, types in HF_TYPES.items():
        if key in raw and (not isinstance(raw[key], types) or (bool not in types and isinstance(raw[key], bool))):
            raise _error(path, f"{key} should be {' or '.join(_type_word(t) for t in types)}, "
                                   f"found {_type_word(type(raw[key]))} {str(raw[key])[:40]}")
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(raw.get(key), list) and not all(_is_int(i) for i in raw[key]):
            raise _error(path, f"{key} should be an integer or a list of integers")
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
        raise _error(path, f"cannot read the model's configuration ({type(e).__name__}: "
                               f"{str(e)[:120]})") from e
    check_config(cfg, path)
    return cfg


def check_config(cfg: Any, path: Path) -> None:
    """Sizes positive and bounded, numbers finite, RoPE settings that define a rotation."""
    def bad(what: str) -> ModelFormatError:
        return _error(path, f"{what}")

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
    _check_rope_scaling(cfg.rope_scaling, bad)
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
        raise _error(layout.path, f"the config says {cfg.n_layers} layers; the file has "
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
            raise _error(t.file, f"tensor {name} has shape {list(t.shape)}; the model's config "
                                   f"implies {list(shape)}")


def check_tokenizer(tok: Any, cfg: Any, path: Path) -> None:
    """Every id the tokenizer can produce indexes the model's embedding: a vocabulary larger than the
    embedding would send an out-of-range id into the lookup (in the C++ kernels, a read past the table)."""
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)
    if top >= cfg.vocab_size:
        token = next(t for t, i in vocab.items() if i == top)
        raise _error(path, f"the tokenizer has token {token!r} with id {top}, past the model's {cfg.vocab_size} "
                           f"embeddings")
    if tok.bos_id is not None and not (_is_int(tok.bos_id) and 0 <= tok.bos_id < cfg.vocab_size):
        raise _error(path, f"BOS token id {tok.bos_id!r} is not one of the model's {cfg.vocab_size} tokens")
