"""The GGUF file: one reader that checks every byte of the header once, GGUF's type tables, its Q/K row layout.

Model files come from strangers on the hub. `gguf.GGUFReader` believes a file's header (a lying array length
makes it loop for ever, a lying tensor size makes numpy map past the end, an unknown type raises whatever the
enum raises) and builds a numpy array per metadata item (~3 s and ~350 MB for the bundled 94 MB file's 49k-token
vocabulary). So `GGUFFile` walks the header itself, once, the way llama.cpp's gguf.cpp does: every count,
length, type, dimension and offset is bounded by the file's size before it is used; metadata is decoded
straight into Python values; the metadata edgellm reads is checked for its type; every tensor's byte range
must lie in the file, aligned, without overlapping another. Any problem is one ModelFormatError naming the
file (UnsupportedModelError for a version or tensor type edgellm cannot read), and nothing is allocated
beyond what the header itself holds. Tensor data is never read here: `data(name)` is a zero-copy view of
the read-only map. The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UnsupportedModelError
from .file_checks import FileLayout, TensorInfo, file_error, no_overlaps, open_bytes

__all__ = ["GGUFFile", "GGUFTensorInfo", "check_gguf_file", "GGUFType", "GGUF_TYPES", "GGUF_FLOAT_TYPES",
           "FLOAT_VIEWS", "gguf_type", "row_bytes", "permute_rope_rows", "unpermute_rope_rows"]

# ------------------------------------------------------------------------------------------------
# Tensor types
# ------------------------------------------------------------------------------------------------
# GGUF tensor types that are plain floats (everything else is quantized blocks, or integers)
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# types whose data is a typed array (BF16 has no numpy type: a uint16 view of it is made where it is read)
FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFType:
    """One block type: `block_values` weights in `block_bytes` bytes (gguf.GGML_QUANT_SIZES, tested equal)."""

    id: int  # gguf.GGMLQuantizationType value
    name: str
    block_values: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_values


# The block types edgellm keeps as stored (kernels/gguf_ops.py GGUF_NATIVE_TYPES names those the C++ kernels
# multiply, all but IQ2_XS / IQ2_S, which the CPU recodes at load; quant/gguf_tensor.py dequantizes each of them in
# torch). Written out rather than built from gguf.constants, which imports the whole gguf package (~0.25 s) into
# every process that reads a weight.
GGUF_TYPES = {t.id: t for t in (
    GGUFType(2, "Q4_0", 32, 18), GGUFType(3, "Q4_1", 32, 20), GGUFType(6, "Q5_0", 32, 22),
    GGUFType(7, "Q5_1", 32, 24), GGUFType(8, "Q8_0", 32, 34), GGUFType(10, "Q2_K", 256, 84),
    GGUFType(11, "Q3_K", 256, 110), GGUFType(12, "Q4_K", 256, 144), GGUFType(13, "Q5_K", 256, 176),
    GGUFType(14, "Q6_K", 256, 210), GGUFType(16, "IQ2_XXS", 256, 66), GGUFType(18, "IQ3_XXS", 256, 98),
    GGUFType(20, "IQ4_NL", 32, 18), GGUFType(21, "IQ3_S", 256, 110), GGUFType(23, "IQ4_XS", 256, 136),
    GGUFType(17, "IQ2_XS", 256, 74), GGUFType(22, "IQ2_S", 256, 82),
)}


# Every GGML type a file may hold: (name, values per block, bytes per block), as gguf.constants' GGML_QUANT_SIZES
# (tests/test_fuzz_files.py checks the two equal), so reading a header needs no gguf-py import (~0.17 s).
GGML_BLOCKS = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


def gguf_type(type_id: int) -> GGUFType:
    return GGUF_TYPES[int(type_id)]


def row_bytes(type_id: int, k: int) -> int:
    """Bytes of one row of `k` weights of a block type (any a file may hold)."""
    _, values, nbytes = GGML_BLOCKS[int(type_id)]
    return k // values * nbytes


# ------------------------------------------------------------------------------------------------
# The header
# ------------------------------------------------------------------------------------------------
GGUF_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
MAX_KV = 1 << 16  # metadata entries (real files: ~30-60)
MAX_TENSORS = 1 << 20  # tensor infos (real files: hundreds to a few thousand)
MAX_ARRAY = 1 << 24  # items in one metadata array (vocabularies: up to ~300k)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# value type → (struct format, size); 8 = string and 9 = array are handled apart
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
           7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
FLOAT_TYPES = {6, 12}
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_id: int
    type_name: str
    dims: tuple[int, ...]  # GGUF order: the fastest-moving dimension first
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order: rows first."""
        return tuple(reversed(self.dims))


MAX_STEPS = 4096  # runs of short strings plus other strings one vectorized array read takes (Llama 3's: ~90)
MAX_SPAN = 32 << 20  # bytes one vectorized array read looks at (Gemma's 515k merges: ~10 MB); larger: the loops


class _Reader:
    """A little-endian cursor over the mapped file that refuses to step past its end."""

    def __init__(self, buf: Any, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, message: str) -> Exception:
        return file_error(self.path, message)

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.fail(f"{what} runs past the end of the file at byte {self.pos} "
                            f"(truncated, or a length that lies)")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = SCALARS[vtype]
        return struct.unpack_from("<" + fmt, self.buf, self.take(size, what))[0]

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

    def strings(self, count: int, what: str) -> list[str]:
        # Vocabularies are arrays of 50k-300k strings (Llama 3: 128k tokens and 280k merges): read with numpy
        # where the array has the usual shape, else a loop with no check per item (a length past the end shows
        # as the position past it, or as unpack_from's error one item later); any doubt, and the checked loop
        # reads it again to say which item is bad.
        out = self._strings_vectorized(count)
        if out is not None:
            return out
        buf, pos, out = self.buf, self.pos, []
        unpack, append = struct.Struct("<Q").unpack_from, out.append
        try:
            for _ in range(count):
                end = pos + 8 + unpack(buf, pos)[0]
                append(str(buf[pos + 8:end], "utf-8"))
                pos = end
        except (struct.error, OverflowError, UnicodeDecodeError):
            pos = self.size + 1
        if pos > self.size:
            return self._strings_checked(count, what)
        self.pos = pos
        return out

    def _strings_vectorized(self, count: int) -> list[str] | None:
        """The array read without a Python step per item, or None where it has a shape this does not take (an
        item of 64 KiB or more, a NUL inside an item, bad UTF-8, a length past the end): the loops read those."""
        if count == 0:
            return []
        left = min(self.size - self.pos, MAX_SPAN)  # a lying count never makes numpy arrays past this
        span = min(left, count * 40)
        while (found := self._item_starts(count, span, left)) == "more" and span < left:
            span = min(left, span * 2)
        if not isinstance(found, tuple):
            return None
        starts, lengths = found
        end = int(starts[-1] + 8 + lengths[-1])
        joined = np.frombuffer(self.buf, dtype=np.uint8, count=end, offset=self.pos).copy()
        joined[starts] = joined[starts + 1] = 0  # each length now 8 zero bytes: the separator before its item
        if np.count_nonzero(joined == 0) != 8 * count:
            return None  # a NUL inside an item
        try:
            items = joined.tobytes().decode("utf-8").split("\0" * 8)
        except UnicodeDecodeError:
            return None
        if len(items) != count + 1:
            return None
        self.pos += end
        return items[1:]

    def _item_starts(self, count: int, span: int, left: int) -> tuple[np.ndarray, np.ndarray] | str | None:
        """(starts, lengths) of the array's items, relative to self.pos; "more" where the first `span` bytes do not
        hold them all; None for a length of 64 KiB or more, or one past the first `left` bytes.

        An item is its length as 8 little-endian bytes, then its bytes. With a length of 1-255 those 8 bytes read
        as a number from 1 to 255: such offsets are found at once, and runs of them that chain exactly (each the
        previous one + 8 + its length) are items; no run of zeros inside an item survives that, since a run is
        only entered at the end of the item before. The rare other items (empty, or 256+ bytes: Llama 3's longest
        token and 43 of its merges) are read one by one between the runs; past MAX_STEPS runs and such items (an
        array built to be slow here) the loops take the array, at their usual pace."""
        is_short = np.zeros(span, dtype=bool)
        for a in range(8):  # the 8 bytes at every offset, one alignment at a time
            k = (span - a) // 8
            u64 = np.frombuffer(self.buf, dtype="<u8", count=k, offset=self.pos + a)
            is_short[a:a + 8 * k:8] = u64 - 1 < 255  # 1..255 (0 wraps around)
        cand = np.flatnonzero(is_short)
        length = np.frombuffer(self.buf, dtype=np.uint8, count=span, offset=self.pos)[cand].astype(np.int64)
        after = cand + 8 + length
        run_ends = np.flatnonzero(after[:-1] != cand[1:])  # a run of candidates ends where the next is not its item
        starts, lengths, got, pos = [], [], 0, 0
        for _ in range(MAX_STEPS):
            if got == count:
                return np.concatenate(starts), np.concatenate(lengths)
            j = int(np.searchsorted(cand, pos))
            if j < len(cand) and cand[j] == pos:
                e = run_ends[np.searchsorted(run_ends, j)] if len(run_ends) and run_ends[-1] >= j else len(cand) - 1
                take = min(int(e) - j + 1, count - got)
                starts.append(cand[j:j + take])
                lengths.append(length[j:j + take])
                pos = int(after[j + take - 1])
                got += take
            elif pos + 8 > span - 7:
                return "more" if span < left else None
            else:
                n = int(np.frombuffer(self.buf, dtype="<u8", count=1, offset=self.pos + pos)[0])
                if n >= 1 << 16 or n > left - pos - 8:
                    return None
                starts.append(np.array([pos]))
                lengths.append(np.array([n]))
                pos += 8 + n
                got += 1
            if pos > left:
                return None
        return None

    def _strings_checked(self, count: int, what: str) -> list[str]:
        # each length bounded before it is read; the messages built only on the way out
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack, append = struct.Struct("<Q").unpack_from, out.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"the length of {what}[{i}]")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.take(n, f"{what}[{i}]")
            try:
                append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos
                raise self.fail(f"{what}[{i}] is not valid UTF-8") from None
            pos += n
        self.pos = pos
        return out

    def value(self, key: str) -> tuple[Any, int, int | None]:
        """One metadata value → (Python value, value type, item type of an array)."""
        vtype = self.u32(f"the type of {key}")
        if vtype in SCALARS:
            return self.scalar(vtype, key), vtype, None
        if vtype == STRING:
            return self.string(key), vtype, None
        if vtype != ARRAY:
            raise self.fail(f"metadata {key} has unknown value type {vtype}")
        item = self.u32(f"the item type of {key}")
        count = self.u64(f"the length of {key}")
        if count > MAX_ARRAY:
            raise self.fail(f"metadata {key} claims {count} items (more than {MAX_ARRAY})")
        if item in SCALARS:
            start = self.take(count * SCALARS[item][1], f"array {key} ({count} items)")
            items = np.frombuffer(self.buf, dtype=NUMPY[item], count=count, offset=start).tolist() if count else []
            return items, vtype, item
        if item == STRING:
            if count * 8 > self.size - self.pos:
                raise self.fail(f"array {key} ({count} strings) runs past the end of the file")
            return self.strings(count, key), vtype, item
        # llama.cpp refuses nested arrays too
        raise self.fail(f"metadata {key} is an array of {TYPE_NAMES.get(item, f'unknown type {item}')}")


class GGUFFile:
    """`fields` {key: Python value}, `tensors` {name: GGUFTensorInfo}, all checked; `data(name)` a zero-copy
    numpy view; `layout` the tensors as file_checks.check_tensor_shapes takes them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        buf, self.size = open_bytes(self.path)
        if self.size == 0:
            raise file_error(self.path, "empty file")
        self._map = buf
        try:
            self._read_header()
        except BaseException:
            buf.close()
            raise

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _read_header(self) -> None:
        buf, path = self._map, self.path
        if buf[:4] != b"GGUF":
            raise file_error(path, "not a GGUF file (bad magic)")
        if len(buf) < 24:
            raise file_error(path, f"truncated GGUF header ({len(buf)} bytes)")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version & 0xFFFF == 0:  # written on a big-endian machine (as gguf.GGUFReader detects it)
            raise UnsupportedModelError(f"{path}: a big-endian GGUF file (edgellm reads little-endian GGUF)")
        if version not in GGUF_VERSIONS:
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are)")
        self.version = version
        r = _Reader(buf, path)
        r.pos = 8
        n_tensors, n_kv = r.u64("the tensor count"), r.u64("the metadata count")
        # Each entry takes bytes: a count the file cannot hold is a lie, refused before any loop.
        if n_kv > MAX_KV or n_kv * 13 > len(buf):
            raise r.fail(f"metadata count {n_kv} is impossible for a file of {len(buf)} bytes")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > len(buf):
            raise r.fail(f"tensor count {n_tensors} is impossible for a file of {len(buf)} bytes")
        self.fields: dict[str, Any] = {}
        self.field_types: dict[str, tuple[int, int | None]] = {}  # key → (value type, array item type)
        for i in range(n_kv):
            key = r.string(f"metadata key #{i}")
            if key in self.fields:
                raise r.fail(f"duplicate metadata key {key!r}")
            self.fields[key], *types = r.value(key)
            self.field_types[key] = tuple(types)
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            value = self.fields["general.alignment"]
            if self.field_types["general.alignment"][0] != 4 or not value or value & (value - 1):
                raise r.fail("general.alignment must be a power of two stored as uint32")
            alignment = value
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
        self.tensors = self._tensors(infos, data_start, alignment)
        _check_metadata(path, self.fields, self.field_types)

    def _tensors(self, infos: list, data_start: int, alignment: int) -> dict[str, GGUFTensorInfo]:
        path, size = self.path, self.size
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if name in tensors:
                raise file_error(path, f"duplicate tensor {name}")
            if ggml_type not in GGML_BLOCKS:
                raise file_error(path, f"tensor {name} has unknown GGML type {ggml_type}", UnsupportedModelError)
            type_name, block, type_size = GGML_BLOCKS[ggml_type]
            if any(d == 0 or d >= 1 << 62 for d in dims):
                raise file_error(path, f"tensor {name} has impossible dimensions {dims}")
            if dims[0] % block:
                raise file_error(path, f"tensor {name} of type {type_name} has a row of {dims[0]} values, "
                                       f"not a multiple of its block of {block}")
            n_bytes = math.prod(dims) // block * type_size
            if offset % alignment:
                raise file_error(path, f"tensor {name} data offset {offset} is not aligned to {alignment}")
            start = data_start + offset
            if start + n_bytes > size:
                raise file_error(path, f"tensor {name} ({n_bytes} bytes at {start}) ends past the end of the "
                                       f"file ({size} bytes): truncated, or an offset or shape that lies")
            tensors[name] = GGUFTensorInfo(name, ggml_type, type_name, tuple(dims), start, n_bytes)
        self.layout = FileLayout(path, {t.name: TensorInfo(t.shape, t.type_name, path, t.offset, t.offset + t.n_bytes)
                                        for t in tensors.values()})
        no_overlaps(self.layout)
        return tensors

    def data(self, name: str) -> np.ndarray:
        """A read-only view of the tensor: typed [rows, cols] for float/int types, else uint8 [rows, row bytes]
        (a 1-D tensor: its single row)."""
        t = self.tensors[name]
        if t.type_name in FLOAT_VIEWS:
            dtype = np.dtype(FLOAT_VIEWS[t.type_name]).newbyteorder("<")
            return np.frombuffer(self._map, dtype=dtype, count=t.n_bytes // dtype.itemsize,
                                 offset=t.offset).reshape(t.shape)
        flat = np.frombuffer(self._map, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        return flat.reshape(*t.shape[:-1], -1) if len(t.shape) > 1 else flat

    def release(self, name: str) -> None:
        """Drop this tensor's pages from the process (they stay in the page cache and fault back in if read
        again): for tensors copied into another layout at load, so the copy and the mapped original are not
        both resident."""
        t = self.tensors[name]
        self._release(t.offset, t.n_bytes)

    def release_view(self, view) -> None:
        """`release` for any view of the mapped file (a numpy array or a CPU tensor from `data`); others are left."""
        address = view.data_ptr() if hasattr(view, "data_ptr") else view.ctypes.data
        nbytes = view.numel() * view.element_size() if hasattr(view, "numel") else view.nbytes
        offset = address - np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        if 0 <= offset and offset + nbytes <= len(self._map):
            self._release(offset, nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        """madvise(DONTNEED) on the whole pages inside [offset, offset + nbytes) of the map."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start, end = -(-offset // page) * page, (offset + nbytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Unmap the file (no view from data() may be alive)."""
        self._map.close()


def check_gguf_file(path: str | Path) -> FileLayout:
    """Read and check the whole GGUF header (GGUFFile), keeping nothing mapped: what the file holds, or one
    ModelFormatError (UnsupportedModelError for a version or tensor type edgellm cannot read) naming it."""
    f = GGUFFile(path)
    try:
        return f.layout
    finally:
        f.close()


# ------------------------------------------------------------------------------------------------
# The metadata edgellm reads
# ------------------------------------------------------------------------------------------------
# Each with the type it must have: a wrong type is refused here, by name, rather
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


def _type_ok(vtype: int | None, want: str) -> bool:
    return {INT: vtype in INT_TYPES, FLOAT: vtype in FLOAT_TYPES | INT_TYPES, STR: vtype == STRING,
            BOOL: vtype == 7}[want]


def _check_metadata(path: Path, fields: dict[str, Any], types: dict[str, tuple[int, int | None]]) -> None:
    schema = dict(GENERAL_KEYS)
    if types.get("general.architecture", (None,))[0] == STRING:
        schema.update({f"{fields['general.architecture']}.{k}": t for k, t in ARCH_KEYS.items()})
    for key, want in schema.items():
        if key not in types:
            continue
        vtype, item = types[key]
        if isinstance(want, list):
            ok = vtype == ARRAY and _type_ok(item, want[0])
            want_text = f"an array of {want[0]}s"
        else:
            ok = _type_ok(vtype, want)
            want_text = f"{'an' if want[0] in 'aeiou' else 'a'} {want}"
        if not ok:
            found = TYPE_NAMES[vtype] + (f" of {TYPE_NAMES[item]}" if vtype == ARRAY else "")
            raise file_error(path, f"metadata {key} should be {want_text}, found {found}")
    n_tokens = len(fields.get("tokenizer.ggml.tokens", ()))
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in fields and len(fields[key]) != n_tokens:
            raise file_error(path, f"{key} has {len(fields[key])} entries for {n_tokens} tokens")
    for name in TOKEN_ID_KEYS:
        value = fields.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and not 0 <= value < n_tokens:
            raise file_error(path, f"tokenizer.ggml.{name}_token_id {value} is not one of the {n_tokens} tokens")


def grid_codebook(name: str) -> tuple[np.ndarray, np.ndarray]:
    """A grid i-quant's codebook as the C++ converters take it: (its grid as gguf.quants decodes llama.cpp's tables,
    int8 [entries, 8 or 4], the 128 sign bytes, uint8). Without torch (edgellm/early_repack.py recodes before torch is
    imported; quant/gguf_grid.py takes the same arrays)."""
    import gguf.quants

    cls = getattr(gguf.quants, name)
    cls.init_grid()
    grid = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.int8))
    return grid, np.frombuffer(bytes(gguf.quants.IQ2_XXS.ksigns), dtype=np.uint8).copy()


# ------------------------------------------------------------------------------------------------
# The row layout of Q/K in llama-architecture GGUFs (any array with reshape/swapaxes: torch or numpy)
# ------------------------------------------------------------------------------------------------
def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved → rotate-half pairs)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w, n_heads: int):
    """llama.cpp's permutation (rotate-half → interleaved), for GGUF export."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
