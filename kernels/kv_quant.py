"""KV quantize-on-write math: int8 (symmetric) and int4 (asymmetric) groups along the head dim.

Shapes follow the cache: x [Hkv, T, D]; one scale (and, for int4, one min) per token, per head, per
`group` consecutive elements of the head dim, so scales are [Hkv, T, D // group].

int8, symmetric:   x ≈ code * scale,        code ∈ [-127, 127] (int8), scale = amax(|x|) / 127
int4, asymmetric:  x ≈ code * scale + min,  code ∈ [0, 15],          scale = (max - min) / 15

int4 nibble layout ("split halves", kernels/int4_layout.py): byte j of a row [D // 2] holds element j in its
low nibble and element j + D/2 in its high nibble. Unpacking is then two whole-half operations (`b & 15` is the first
half of the row, `b >> 4` the second) with no interleave, and a kernel can dot the low and high halves
of q against them separately (what the Triton kernel does).

Codes are computed against the scale/min *as stored* (after rounding to the storage dtype), so the
dequantized value is exactly what every reader (torch path, Triton kernel, reference) reconstructs.
The dequantize functions compute in fp32 and can write into a caller's buffer (`out=`), which is how
attention dequantizes one tile at a time into a small reusable buffer.
"""
from __future__ import annotations

import torch

from .int4_layout import pack_halves

INT8_MAX = 127
INT4_MAX = 15


def _check_group(d: int, group: int) -> None:
    if group <= 0 or d % group:
        raise ValueError(f"group size {group} does not divide the head dim {d}")


def quantize_int8(x: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (codes int8 [..., D], scales [..., D // group] in scale_dtype)."""
    d = x.shape[-1]
    _check_group(d, group)
    xg = x.float().unflatten(-1, (d // group, group))
    amax = xg.abs().amax(-1)
    # An all-zero group gets scale 1 (codes 0) rather than a division by zero.
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(scale_dtype)
    s = scale.float()
    codes = torch.round(xg / s.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.flatten(-2), scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, group: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """codes int8 [..., D], scales [..., D // group] → fp32 [..., D] (written into `out` if given)."""
    d = codes.shape[-1]
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    out.copy_(codes)  # int8 → fp32 conversion in one vectorised pass
    if group == d:
        out.mul_(scales)  # scales [..., 1] broadcast along the row
    else:
        out.unflatten(-1, (d // group, group)).mul_(scales.unsqueeze(-1))
    return out


def quantize_int4(x: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] → (packed uint8 [..., D // 2], scales [..., D // group], mins [..., D // group])."""
    d = x.shape[-1]
    _check_group(d, group)
    if d % 2:
        raise ValueError(f"int4 packing needs an even head dim, got {d}")
    xg = x.float().unflatten(-1, (d // group, group))
    lo = xg.amin(-1).to(scale_dtype)
    m = lo.float()
    span = xg.amax(-1) - m
    scale = torch.where(span > 0, span / INT4_MAX, torch.ones_like(span)).to(scale_dtype)
    s = scale.float()
    codes = torch.round((xg - m.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, INT4_MAX).to(torch.uint8)
    return pack_halves(codes.flatten(-2)), scale, lo


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """packed uint8 [..., D // 2], scales/mins [..., D // group] → fp32 [..., D] (into `out` if given)."""
    half = packed.shape[-1]
    d = 2 * half
    if out is None:
        out = torch.empty((*packed.shape[:-1], d), dtype=torch.float32, device=packed.device)
    # Each nibble plane converts straight into its half of the fp32 row: no uint8 row is built.
    out[..., :half].copy_(packed & 0xF)
    out[..., half:].copy_(packed >> 4)
    if group == d:
        out.mul_(scales).add_(mins)
    else:
        og = out.unflatten(-1, (d // group, group))
        og.mul_(scales.unsqueeze(-1)).add_(mins.unsqueeze(-1))
    return out
