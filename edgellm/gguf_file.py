"""Read a GGUF file: metadata and tensor views over one read-only memory map, every length checked.

Why not `gguf.GGUFReader`: it builds a numpy array per metadata item (a 49k-token vocabulary is ~250k of
them), which took ~3 s and ~350 MB for the bundled 94 MB file, and it trusts the header's counts and lengths.
Here metadata is decoded straight into Python values, numeric arrays are views, and every count, length,
dimension, type and offset is checked against the file before it is used, so a truncated or hostile header
ends in one ModelFormatError naming the file instead of a huge allocation or an odd exception.
Tensor data is never read here: `data(name)` is a zero-copy view of the mapped file.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFormatError

__all__ = ["GGUFFile", "GGUFTensorInfo"]

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: real files use none
# value type id → (struct code, size); 8 = string, 9 = array
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
           10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


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


class _Cursor:
    """Little-endian reads from the mapped header with bounds checks (a read past the end is a truncation)."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: corrupt GGUF header ({what} at byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ModelFormatError(f"{self.path}: truncated or corrupt GGUF ({what} at byte {self.pos} runs past "
                                   f"the end of the {self.size}-byte file)")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, code: str, size: int, what: str):
        return struct.unpack_from("<" + code, self.buf, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", 8, what)

    def string(self, what: str, errors: str = "replace") -> str:
        n = self.u64(f"length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8", errors)
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count that must fit in what is left of the file at `min_item_bytes` per item."""
        n = self.u64(what)
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(f"{what} of {n} does not fit in the file")
        return n

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in SCALARS:
            return self.scalar(*SCALARS[vtype], what)
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {MAX_NESTING} deep")
        etype = self.u32(f"element type of {what}")
        if etype in SCALARS:
            size = SCALARS[etype][1]
            n = self.count(f"length of {what}", size)
            start = self.take(n * size, what)
            return np.frombuffer(self.buf, dtype=NUMPY[etype], count=n, offset=start).tolist()
        if etype not in (STRING, ARRAY):
            raise self.fail(f"{what} has unknown element type {etype}")
        n = self.count(f"length of {what}", 8 if etype == STRING else 12)
        if etype == STRING:
            return [self.string(what) for _ in range(n)]
        return [self.value(ARRAY, what, depth + 1) for _ in range(n)]


class GGUFFile:
    """`fields` {key: Python value}, `tensors` {name: GGUFTensorInfo}; `data(name)` a zero-copy numpy view."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ModelFormatError(f"{self.path}: empty file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(self._map, self.path)
        if bytes(self._map[:4]) != MAGIC:
            raise ModelFormatError(f"{self.path}: not a GGUF file (bad magic)")
        c.take(4, "magic")
        self.version = c.u32("version")
        if self.version not in (2, 3):
            raise ModelFormatError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # every metadata item takes at least 8 (key length) + 4 (type) + 1 bytes; every tensor info 8 + 4 + 4 + 8
        if n_kv * 13 > size or n_tensors * 24 > size:
            raise c.fail(f"{n_kv} metadata items / {n_tensors} tensors do not fit in a {size}-byte file")
        self.fields: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key {i}", errors="strict")
            if key in self.fields:
                raise c.fail(f"metadata key {key!r} appears twice")
            self.fields[key] = c.value(c.u32(f"type of {key}"), key)
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise c.fail(f"general.alignment {alignment!r} is not a power of two")
        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = c.string(f"tensor name {i}", errors="strict")
            if name in names:
                raise c.fail(f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = c.u32(f"dimension count of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"tensor {name} has {n_dims} dimensions")
            dims = tuple(c.u64(f"dimension of {name}") for _ in range(n_dims))
            type_id = c.u32(f"type of {name}")
            offset = c.u64(f"offset of {name}")
            infos.append((name, dims, type_id, offset))
        data_start = -(-c.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ModelFormatError(f"{self.path}: tensor {name} has unknown type {type_id}") from None
            if any(d == 0 for d in dims) or dims[0] % block:
                raise ModelFormatError(f"{self.path}: tensor {name} has dimensions {list(dims)}, which "
                                       f"{qtype.name} blocks of {block} cannot hold")
            n_elements = 1
            for d in dims:
                n_elements *= d
            n_bytes = n_elements // block * block_bytes
            start = data_start + offset
            if offset % alignment or start + n_bytes > size:
                raise ModelFormatError(f"{self.path}: truncated or corrupt GGUF (tensor {name}: {n_bytes} bytes at "
                                       f"offset {offset} do not lie in the {size}-byte file)")
            self.tensors[name] = GGUFTensorInfo(name, type_id, qtype.name, dims, start, n_bytes)

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
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.tensors[name]
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.n_bytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
