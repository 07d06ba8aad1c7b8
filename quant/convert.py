"""Quantization settings per parameter, tensors quantized one at a time, and the modules swapped into a model.

- `QuantSettings.format_for(name)` decides per parameter: the layer linears get the requested int8/int4
  format; the embedding / LM head (a fifth of SmolLM2) gets `embeddings` (int8 default); norms and biases
  stay float.
- GGUF Q8_0 / Q4_0 / Q4_1 tensors become our codes by a byte reshuffle (`groups.gguf_into`), never a
  dequantize/requantize round trip, when the requested bit width matches (`try_exact_gguf`); other types
  are dequantized by `gguf.quants` and requantized (`quantize_tensor`).
- `install_quantized` swaps QuantLinear / QuantEmbedding modules into a model built on the meta device.

The whole-model formats built on these live above quant/: edgellm/quantized_format.py (the edgellm folder)
and edgellm/gguf_export.py (GGUF export); loading.py reads models through them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .. import early_repack
from ..errors import ModelFormatError, QuantizationError
from ..gguf_file import GGML_BLOCKS
from ..kernels import matmul as K
from ..kernels.cpu_ext import build_id
from .groups import GGUF_EXACT, QuantizedTensor, empty_gguf_exact, gguf_into, quantize
from .linear import QuantEmbedding, QuantLinear

LINEAR_SUFFIXES = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w13.weight", "feed_forward.w2.weight")


@dataclass
class QuantSettings:
    weights: str = "int4"  # int8 | int4
    group_size: int = 32  # int8 also accepts 0 = per output channel
    symmetric: bool = True  # int4 only; int8 is always symmetric
    embeddings: str = "int8"  # int8 | int4 | fp — the embedding table / LM head
    search: bool = True  # search scales (and mins) instead of round-to-nearest
    calibration: str | None = None  # "builtin" or a text file: activation-weighted search (weight_calibration.py)

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
    `importance` [in_features]: per-channel weights of the search's error (edgellm/weight_calibration.py)."""
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
    names = {GGML_BLOCKS.get(int(p[1]), ("?",))[0] for p in parts}
    if len(names) != 1 or next(iter(names)) not in GGUF_EXACT:
        return None
    bits, sym = GGUF_EXACT[next(iter(names))]
    if bits > fmt[0]:
        return None  # asked for fewer bits than stored: requantize
    # stored with fewer (or as many) bits as asked: requantizing could only add error, so keep them, each part
    # copied once, straight into its rows of the fused tensor (by the `edgellm` command's head start, if it did)
    early = _made_early(parts, permute, bits, sym)
    if early is not None:
        return early
    out = empty_gguf_exact(parts[0][1], sum(int(p[2][0]) for p in parts), int(parts[0][2][1]))
    row0 = 0
    for (raw, ggml_type, shape), heads in zip(parts, permute):
        gguf_into(raw, ggml_type, shape, out, row0, heads)
        row0 += int(shape[0])
    return out


def _made_early(parts: list[tuple[Any, Any, tuple[int, int]]], permute: list[int | None], bits: int,
                sym: bool) -> QuantizedTensor | None:
    """try_exact_gguf's tensor as edgellm/early_repack.py made it while torch was imported (the same bytes:
    kernels/early_repack.cpp splits the blocks as gguf_into does), or None."""
    ext = K.cpu_extension() if early_repack.started() else None  # (no extension build for a load without it)
    if ext is None:
        return None
    key = tuple((np.asarray(raw).ctypes.data, int(t), int(shape[0]), int(shape[1]), int(heads or 0))
                for (raw, t, shape), heads in zip(parts, permute))
    made = early_repack.take_exact(build_id(ext), key)
    if made is None:
        return None
    rows, k = sum(int(p[2][0]) for p in parts), int(parts[0][2][1])
    codes = torch.frombuffer(made[0], dtype=torch.int8 if bits == 8 else torch.uint8).view(rows, -1)
    scales = torch.frombuffer(made[1], dtype=torch.float16).view(rows, k // 32)
    mins = None if made[2] is None else torch.frombuffer(made[2], dtype=torch.float16).view(rows, k // 32)
    return QuantizedTensor(bits, 32, sym, (rows, k), codes, scales, mins)


def row_op(qt: QuantizedTensor, fn: Callable[[torch.Tensor], torch.Tensor], rows: int) -> QuantizedTensor:
    """`fn` applied to the codes, scales and mins alike (each row of them is one row of the weight)."""
    return QuantizedTensor(qt.bits, qt.group_size, qt.symmetric, (rows, qt.shape[1]), fn(qt.codes),
                           fn(qt.scales), None if qt.mins is None else fn(qt.mins))


def split_rows(qt: QuantizedTensor, sizes: list[int]) -> list[QuantizedTensor]:
    out, start = [], 0
    for n in sizes:
        out.append(row_op(qt, lambda t, s=start, n=n: t[s:s + n].contiguous(), n))
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
