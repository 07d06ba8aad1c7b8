"""A GGUF rewritten from another, for test files: random_blocks_gguf.py, real_vocab_gguf.py and
tokenizer_vs_llamacpp.py copy one through here (metadata values and tensors replaced where they say)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np

SCALE_OFFSET = {"Q6_K": 208, "Q3_K": 108, "Q2_K": 80, "TQ1_0": 52, "TQ2_0": 64}  # byte offset of a block's fp16 d
# where it is not 0
MIN_OFFSET = {"Q4_1": 2, "Q5_1": 2, "Q4_K": 2, "Q5_K": 2, "Q2_K": 82}  # and of its fp16 min (scale), if it has one
FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)

# a tensor of the source → (data, raw_dtype) to write instead, or None to copy it as stored
Replace = Callable[[Any], "tuple[np.ndarray, gguf.GGMLQuantizationType | None] | None"]


def random_blocks(tensor_type: gguf.GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator,
                  d: float = 0.002) -> np.ndarray:
    """rows x k values of random blocks of `tensor_type`, every block's fp16 d (and min scale) set to `d` (finite
    weights); TQ2_0's 2-bit codes 0..2 only, as its quantizer writes them (code 3, digit 2, would give the weights a
    mean of d / 4 that random models amplify layer by layer)."""
    qv, qb = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = rng.integers(0, 256, size=(rows, k // qv * qb), dtype=np.uint8)
    if tensor_type == gguf.GGMLQuantizationType.TQ2_0:
        codes = raw.reshape(rows, -1, qb)[:, :, :64]
        for shift in (0, 2, 4, 6):
            three = ((codes >> shift) & 3) == 3
            codes[three] &= np.uint8(~(2 << shift) & 255)  # 3 -> 1 (digit 0)
    if tensor_type == gguf.GGMLQuantizationType.IQ1_M:  # its fp16 d: the top nibbles of its four u16 scales
        scales, bits = raw.reshape(rows, -1, qb)[:, :, 48:56].view(np.uint16), int(np.float16(d).view(np.uint16))
        for i in range(4):
            scales[..., i] = (scales[..., i] & 0x0FFF) | (((bits >> 4 * i) & 0xF) << 12)
        return raw
    for at in (SCALE_OFFSET.get(tensor_type.name, 0), MIN_OFFSET.get(tensor_type.name)):
        if at is not None:
            raw.reshape(rows, -1, qb)[:, :, at:at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return raw


def write_copy(reader: gguf.GGUFReader, out: str | Path, values: dict[str, Any] | None = None,
               replace: Replace | None = None) -> None:
    """`reader`'s file written to `out`: its metadata with `values` in place of theirs, its tensors as `replace`
    gives them."""
    writer = metadata_writer(reader, out, values)
    for t in reader.tensors:
        new = replace(t) if replace is not None else None
        if new is None:
            new = np.asarray(t.data), None if t.tensor_type in FLOAT_TYPES else t.tensor_type
        writer.add_tensor(t.name, new[0], raw_dtype=new[1])
    finish(writer)


def metadata_writer(reader: gguf.GGUFReader, out: str | Path, values: dict[str, Any] | None = None,
                    skip: tuple[str, ...] = ()) -> gguf.GGUFWriter:
    """A writer to `out` holding `reader`'s metadata (`values` in place of theirs, the keys in `skip` left out)."""
    values = values or {}
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in skip:
            writer.add_key_value(key, values.get(key, f.contents()), f.types[0],
                                 f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors added, and close."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
