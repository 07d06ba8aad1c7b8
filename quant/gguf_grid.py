"""The grid-codebook and ternary GGUF types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0)
through the C++ converter (kernels/cpu_gguf_grid.cpp): their blocks as fp32 (`--weights fp`) or as Q8_0 blocks (the
types without a product kernel), with the codebooks taken from gguf.quants (the grids it decodes from llama.cpp's
tables, the 128 sign bytes).

`convert` returns None where the extension is not built (no compiler, disabled): the caller then uses gguf.quants'
numpy, which gives the same values ~20x slower.

`ternary_as_q2_k` rewrites the ternary types' blocks as Q2_K blocks of the same values, which every device's kernels
multiply: their d (q - 1) is Q2_K's d 1 q - dmin 1 with dmin = d, bit for bit (3 d is exact in float32 for an fp16 d).
`iq1_as_q6_k` does the same for IQ1_S / IQ1_M as Q6_K blocks: their d (2 s + 1) (g +- 1/8) is Q6_K's (d / 8) sc (q - 32)
with sc = 2 s + 1 and q - 32 = 8 (g +- 1/8), wherever d / 8 is an fp16.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
import torch

from ..gguf_file import grid_codebook

__all__ = ["GRID_TYPES", "TERNARY_TYPES", "IQ1_TYPES", "convert", "grid_of", "l4_tables", "ternary_as_q2_k",
           "iq1_as_q6_k"]

# GGML type id -> gguf.quants class name
GRID_TYPES = {16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S", 29: "IQ1_M",
              34: "TQ1_0", 35: "TQ2_0"}
IQ1_S = 19
TERNARY_TYPES = {34: "TQ1_0", 35: "TQ2_0"}
Q2_K = 10  # (GGML type id; its block: 16 bytes of 4-bit scale | 4-bit min, 64 of 2-bit codes, fp16 d, fp16 dmin)
IQ1_TYPES = {19: "IQ1_S", 29: "IQ1_M"}
Q6_K = 14  # (its block: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, fp16 d)
_EMPTY = torch.empty(0, dtype=torch.uint8)


@lru_cache(maxsize=None)
def _tables(type_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid int8 [entries, width] or empty, ksigns uint8 [128] or empty) of a type, from gguf.quants (the arrays
    edgellm/early_repack.py gives its recoding: gguf_file.grid_codebook)."""
    name = GRID_TYPES[type_id]
    if name.startswith("TQ"):  # the ternary types: no codebook
        return _EMPTY, _EMPTY
    grid, ksigns = grid_codebook(name)
    return torch.from_numpy(grid), torch.from_numpy(ksigns)


def grid_of(type_id: int) -> torch.Tensor:
    """A grid type's codebook as the extension takes it: int8 [entries, 8 or 4] (gguf.quants')."""
    return _tables(type_id)[0]


# The L4 bases whose tables the caller gives ext.gguf_to_l4 (the build has IQ2_XXS' / IQ3_XXS' / IQ3_S' codebooks)
_L4_TABLES_GIVEN = (19, 17, 22, 29)  # IQ1_S, IQ2_XS, IQ2_S, IQ1_M


def l4_tables(type_id: int) -> dict[str, torch.Tensor]:
    """The keyword arguments ext.gguf_to_l4 needs for a type: its grid (and IQ2_XS's sign bytes), or none."""
    if type_id not in _L4_TABLES_GIVEN:
        return {}
    grid, ksigns = _tables(type_id)
    return {"grid": grid, "ksigns": ksigns}


def _converter(name: str, raw: np.ndarray | torch.Tensor, rows: int):
    """(the extension's function `name`, the blocks as a uint8 tensor [rows, row bytes]), or (None, None) where the
    extension is not built or has no such function."""
    from ..kernels import matmul as K

    fn = getattr(K.cpu_extension(), name, None)
    if fn is None:
        return None, None
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only view of the mapped file; the converter only reads it
            blocks = torch.from_numpy(np.ascontiguousarray(raw))
    else:
        blocks = raw.contiguous()
    return fn, blocks.reshape(rows, -1)


def convert(raw: np.ndarray | torch.Tensor, type_id: int, rows: int, k: int, q8_0: bool) -> torch.Tensor | None:
    """`rows` rows of `k` values of a grid / ternary type -> fp32 [rows, k] (gguf.quants.dequantize's values, bit
    for bit) or, with q8_0, Q8_0 blocks uint8 [rows, k / 32 * 34] (gguf.quants.quantize's rounding of them); None
    where the C++ converter is not there for this type and shape."""
    if type_id not in GRID_TYPES or k % 256:
        return None
    fn, blocks = _converter("gguf_grid_convert", raw, rows)
    if fn is None:
        return None
    grid, ksigns = _tables(type_id)
    return fn(blocks, type_id, rows, k, grid, ksigns, q8_0)


def iq1_as_q6_k(raw: np.ndarray, type_id: int, rows: int, k: int) -> np.ndarray | None:
    """`rows` rows of `k` values of IQ1_S / IQ1_M blocks -> Q6_K blocks of the same values bit for bit, uint8
    [rows, k / 256 * 210] (6.56 bits a weight; the C++ converter), or None: no extension, or a block whose d / 8 is
    not an fp16 (d below ~2^-11: the caller then takes the Q8_0 route)."""
    fn, blocks = _converter("gguf_iq1_to_q6_k", raw, rows) if k % 256 == 0 else (None, None)
    if fn is None:
        return None
    out = fn(blocks, type_id, rows, k, grid_of(type_id))
    return None if out is None else out.numpy()


def _tq1_0_codes(blocks: np.ndarray) -> np.ndarray:
    """TQ1_0 blocks [n, 54] -> each value's digit (0..2) in value order, uint8 [n, 256]: 5 base-3 digits a byte,
    digit p of x being (x 3^p mod 256) 3 >> 8 (gguf.quants' and llama.cpp's decoding)."""
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)

    def digits(b: np.ndarray, p: np.ndarray) -> np.ndarray:  # [n, m] bytes -> [n, len(p) * m], digit-major
        x = (b[:, None, :] * p[:, None]).astype(np.uint16)  # (uint8 products wrap mod 256)
        return ((x * 3) >> 8).astype(np.uint8).reshape(len(b), -1)

    return np.concatenate([digits(blocks[:, :32], pow3), digits(blocks[:, 32:48], pow3),
                           digits(blocks[:, 48:52], pow3[:4])], axis=1)


def ternary_as_q2_k(raw: np.ndarray, type_id: int, rows: int, k: int) -> np.ndarray:
    """`rows` rows of `k` values of TQ1_0 / TQ2_0 blocks -> Q2_K blocks of the same values bit for bit, uint8
    [rows, k / 256 * 84]: each 16 values' scale and min 1, d and dmin the block's d, the codes q = digit + 1 in Q2_K's
    order (value 128 n + 32 j + l: bits 2 j of byte 32 n + l), which is TQ2_0's own. Through the C++ converter where
    it is built (~20x numpy's speed on TQ1_0), else numpy, the same bytes."""
    fn, blocks = _converter("gguf_ternary_to_q2_k", raw, rows)
    if fn is None:
        return _ternary_as_q2_k_numpy(raw, type_id, rows, k)
    return fn(blocks, type_id, rows, k).numpy()


def _ternary_as_q2_k_numpy(raw: np.ndarray, type_id: int, rows: int, k: int) -> np.ndarray:
    name = TERNARY_TYPES[type_id]
    blocks = np.ascontiguousarray(raw).reshape(-1, 54 if name == "TQ1_0" else 66)
    out = np.empty((len(blocks), 84), dtype=np.uint8)
    out[:, :16] = 0x11
    if name == "TQ2_0":
        out[:, 16:80], d = blocks[:, :64], blocks[:, 64:66]
    else:
        q = _tq1_0_codes(blocks).reshape(-1, 2, 4, 32)  # [block, n, j, l]
        out[:, 16:80] = (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)
        d = blocks[:, 52:54]
    out[:, 80:82] = d
    out[:, 82:84] = d
    return out.reshape(rows, k // 256 * 84)
