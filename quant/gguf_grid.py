"""The grid-codebook and ternary GGUF types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0)
through the C++ converter (kernels/cpu_gguf_grid.cpp): their blocks as fp32 (`--weights fp`) or as Q8_0 blocks (the
types without a product kernel), with the codebooks taken from gguf.quants (the grids it decodes from llama.cpp's
tables, the 128 sign bytes).

`convert` returns None where the extension is not built (no compiler, disabled): the caller then uses gguf.quants'
numpy, which gives the same values ~20x slower.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
import torch

from .gguf_tensor import grid_tables

__all__ = ["GRID_TYPES", "convert", "grid_of"]

# GGML type id -> gguf.quants class name
GRID_TYPES = {16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S", 29: "IQ1_M",
              34: "TQ1_0", 35: "TQ2_0"}
IQ1_S = 19
_EMPTY = torch.empty(0, dtype=torch.uint8)


@lru_cache(maxsize=None)
def _tables(type_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid int8 [entries, width] or empty, ksigns uint8 [128] or empty) of a type, from gguf.quants (the torch
    dequantizer's tables, quant/gguf_tensor.grid_tables)."""
    name = GRID_TYPES[type_id]
    if name.startswith("TQ"):  # the ternary types: no codebook
        return _EMPTY, _EMPTY
    grid, ksigns = grid_tables(name, torch.device("cpu"))
    return grid.to(torch.int8).contiguous(), ksigns


def grid_of(type_id: int) -> torch.Tensor:
    """A grid type's codebook as the extension takes it: int8 [entries, 8 or 4] (gguf.quants')."""
    return _tables(type_id)[0]


def convert(raw: np.ndarray | torch.Tensor, type_id: int, rows: int, k: int, q8_0: bool) -> torch.Tensor | None:
    """`rows` rows of `k` values of a grid / ternary type -> fp32 [rows, k] (gguf.quants.dequantize's values, bit
    for bit) or, with q8_0, Q8_0 blocks uint8 [rows, k / 32 * 34] (gguf.quants.quantize's rounding of them); None
    where the C++ converter is not there for this type and shape."""
    from ..kernels import matmul as K

    ext = K.cpu_extension()
    if ext is None or not hasattr(ext, "gguf_grid_convert") or type_id not in GRID_TYPES or k % 256:
        return None
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only view of the mapped file; the converter only reads it
            blocks = torch.from_numpy(np.ascontiguousarray(raw))
    else:
        blocks = raw.contiguous()
    grid, ksigns = _tables(type_id)
    return ext.gguf_grid_convert(blocks.reshape(rows, -1), type_id, rows, k, grid, ksigns, q8_0)
