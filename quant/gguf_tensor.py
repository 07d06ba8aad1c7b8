"""GGUF weight blocks as stored: dequantization in torch on any device (the type table: edgellm/gguf_file.py).

A GGUF tensor of shape (N, K) is N rows of K / block_values blocks, each `block_bytes` long. The C++
kernels (kernels/cpu_gguf.cpp) multiply the blocks in place on the CPU; this module is what every other
device (CUDA, MPS) and the no-extension CPU path run: a layer's blocks → float rows, with the same float32
operations in the same order as `gguf.quants.dequantize`, so the result is bit for bit that reference's.

Only torch here (no numpy), so it runs on the device that holds the blocks.
"""
from __future__ import annotations

import torch

from ..gguf_file import GGUF_TYPES, grid_codebook, gguf_type
from ..kernels.gguf_ops import GGUF_NATIVE_TYPES, iq4_levels
from ..kernels.int4_layout import unpack_halves

__all__ = ["NATIVE_TYPES", "STORED_TYPES", "dequantize_blocks"]


# the quantized types the C++ kernels multiply as stored (their list)
NATIVE_TYPES = frozenset(GGUF_NATIVE_TYPES)
# the quantized types edgellm keeps as stored blocks on every device: this module dequantizes each of them (CUDA /
# MPS, the CPU without the extension, embedding rows); IQ2_XS / IQ2_S, which no product kernel takes as stored, the
# CPU recodes at load (quant/gguf_linear.repack_for_cpu). The others (IQ1_*, TQ*) are rewritten at load
# (loading.gguf_as_stored).
STORED_TYPES = frozenset(t.name for t in GGUF_TYPES.values())
assert NATIVE_TYPES <= STORED_TYPES


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves → float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[n, g, count / 8] bytes → [n, g, count] bits, little-endian bit order."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], count)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins → two [n, 8] uint8 tensors."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


# The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): each grid entry's 8 / 4 values, and the 128 sign
# bytes, from gguf.quants, put on a device once (the first dequantization there, an eager pass before any CUDA graph).
_GRIDS: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def grid_tables(name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (name, str(device))
    if key not in _GRIDS:
        grid, signs = grid_codebook(name)  # (int8: the grids' values are small integers, exact as float32)
        _GRIDS[key] = torch.from_numpy(grid).to(device, torch.float32), torch.from_numpy(signs).to(device)
    return _GRIDS[key]


def _sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] → bool [..., n, 8]: bit j of each byte (value j of its 8)."""
    return ((signs.unsqueeze(-1) >> torch.arange(8, device=signs.device, dtype=torch.uint8)) & 1).bool()


def _u32(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 n] little-endian → int64 [..., n] (the unsigned values)."""
    q = b.reshape(*b.shape[:-1], -1, 4).to(torch.int64)  # (from the bytes: a view needs a 4-aligned offset)
    return q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)


def _ksign_bits(aux: torch.Tensor, ksigns: torch.Tensor) -> torch.Tensor:
    """int64 [nb, 8] words of 4 x 7 sign bits → bool [nb, 8, 4, 8] (eighth bits from the parity table)."""
    idx = (aux.unsqueeze(-1) >> torch.arange(0, 28, 7, device=aux.device)) & 127
    return _sign_bits(ksigns[idx])


def _grid_iquant(name: str, blk: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS / IQ3_XXS / IQ3_S super-blocks uint8 [nb, bytes] → float32 [nb, 8, 32] as gguf.quants: db * grid
    value, negated where its sign bit is set."""
    nb = blk.shape[0]
    grid, ksigns = grid_tables(name, blk.device)
    d = _f16(blk[:, 0:2].unsqueeze(1)).reshape(nb, 1)
    if name == "IQ2_XXS":
        words = _u32(blk[:, 2:66]).reshape(nb, 8, 2)
        db = d * (0.5 + (words[..., 1] >> 28).float()) * 0.25
        g = grid[blk[:, 2:66].reshape(nb, 8, 2, 4)[:, :, 0].long()]  # [nb, 8, 4, 8]: the bytes of each a0
        neg = _ksign_bits(words[..., 1], ksigns)
    elif name == "IQ3_XXS":
        aux = _u32(blk[:, 66:98])
        db = d * (0.5 + (aux >> 28).float()) * 0.5
        g = grid[blk[:, 2:66].long()].reshape(nb, 8, 4, 8)
        neg = _ksign_bits(aux, ksigns)
    else:  # IQ3_S
        high = (blk[:, 66:74].unsqueeze(-1) >> torch.arange(8, device=blk.device, dtype=torch.uint8)) & 1
        g = grid[blk[:, 2:66].long() | (high.reshape(nb, 64).long() << 8)].reshape(nb, 8, 4, 8)
        scales = torch.stack((blk[:, 106:110] & 0x0F, blk[:, 106:110] >> 4), dim=-1).reshape(nb, 8)
        db = d * (1 + 2 * scales.to(torch.int32)).float()
        neg = _sign_bits(blk[:, 74:106]).reshape(nb, 8, 4, 8)
    w = db.reshape(nb, 8, 1, 1) * g
    return torch.where(neg, -w, w).reshape(nb, 8, 32)


def _iq2_per16(name: str, blk: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S super-blocks uint8 [nb, bytes] → float32 [nb, 16, 16] as gguf.quants: per 16 values db = d
    (0.5 + s) / 4 (s: the scales' nibbles, low first), times the grid value of each 8, negated where its sign bit is
    set. IQ2_XS: u16 entries, grid index the low 9 bits, the sign byte ksigns[the top 7]; IQ2_S: grid index qs[i] with
    2 more bits from qh, the sign bytes as stored."""
    nb = blk.shape[0]
    grid, ksigns = grid_tables(name, blk.device)
    d = _f16(blk[:, 0:2].unsqueeze(1)).reshape(nb, 1)
    at = 66 if name == "IQ2_XS" else 74
    scales = torch.stack((blk[:, at:at + 8] & 0x0F, blk[:, at:at + 8] >> 4), dim=-1).reshape(nb, 16)
    db = d * (0.5 + scales.float()) * 0.25
    if name == "IQ2_XS":
        q = blk[:, 2:66].reshape(nb, 32, 2).to(torch.int64)
        q = q[..., 0] | (q[..., 1] << 8)
        g, signs = grid[q & 511], ksigns[q >> 9]
    else:  # IQ2_S
        high = (blk[:, 66:74].reshape(nb, 8, 1) >> torch.arange(0, 8, 2, device=blk.device, dtype=torch.uint8)) & 3
        g = grid[blk[:, 2:34].long() | (high.reshape(nb, 32).long() << 8)]
        signs = blk[:, 34:66]
    w = db.reshape(nb, 16, 1, 1) * g.reshape(nb, 16, 2, 8)
    return torch.where(_sign_bits(signs).reshape(nb, 16, 2, 8), -w, w).reshape(nb, 16, 16)


def dequantize_blocks(raw: torch.Tensor, type_id: int, shape: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 blocks of a tensor of `shape` (N, K) → float [N, K] (computed in float32, then cast)."""
    t = gguf_type(type_id)
    n, k = int(shape[0]), int(shape[1])
    b = raw.reshape(-1, t.block_bytes)
    if b.shape[0] * t.block_values != n * k:
        raise ValueError(f"{t.name} blocks of {raw.numel()} bytes do not hold a ({n}, {k}) tensor")
    b = b.reshape(b.shape[0], 1, t.block_bytes)  # [blocks, 1, bytes]: the "g" axis the helpers share
    if t.name == "Q8_0":
        d = _f16(b[..., 0:2])
        w = b[..., 2:].contiguous().view(torch.int8).float() * d.unsqueeze(-1)
    elif t.name in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2]).unsqueeze(-1)
        if t.name == "Q4_0":
            w = d * (unpack_halves(b[..., 2:]).to(torch.int8) - 8).float()
        else:
            w = d * unpack_halves(b[..., 4:]).float() + _f16(b[..., 2:4]).unsqueeze(-1)
    elif t.name in ("Q5_0", "Q5_1"):
        asym = t.name == "Q5_1"
        off = 4 if asym else 2
        d = _f16(b[..., 0:2]).unsqueeze(-1)
        q = unpack_halves(b[..., off + 4:]) | (_bits(b[..., off:off + 4], 32) << 4)
        w = d * q.float() + _f16(b[..., 2:4]).unsqueeze(-1) if asym else d * (q.to(torch.int8) - 16).float()
    elif t.name in ("Q4_K", "Q5_K"):
        nb = b.shape[0]
        d = _f16(b[..., 0:2]).reshape(nb, 1, 1)
        dmin = _f16(b[..., 2:4]).reshape(nb, 1, 1)
        sc, mn = _k_scale_min(b[:, 0, 4:16])
        dl = d * sc.float().reshape(nb, 8, 1)
        ml = dmin * mn.float().reshape(nb, 8, 1)
        if t.name == "Q4_K":
            q = unpack_halves(b[:, 0, 16:].reshape(nb, 4, 32)).reshape(nb, 8, 32)
        else:
            ql = unpack_halves(b[:, 0, 48:].reshape(nb, 4, 32)).reshape(nb, 8, 32)
            qh = (b[:, 0, 16:48].reshape(nb, 1, 32) >> torch.arange(8, device=b.device, dtype=torch.uint8)
                  .reshape(1, 8, 1)) & 1
            q = ql | (qh << 4)
        w = dl * q.float() - ml
    elif t.name == "Q6_K":
        nb = b.shape[0]
        ql, qh = b[:, 0, 0:128], b[:, 0, 128:192]
        scales = b[:, 0, 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[:, 0, 208:210].unsqueeze(1)).reshape(nb, 1)
        dl = (d * scales).reshape(nb, 16, 1)
        # per 128-value half: low nibbles of its 64 ql bytes, then their high nibbles; 2 more bits each from
        # its 32 qh bytes, shifted by 0/2/4/6 for the half's four runs of 32
        low = unpack_halves(ql.reshape(nb, 2, 64)).reshape(nb, 2, 4, 32)
        # shifts made on the device (no host copy: a CUDA graph can capture this)
        high = (qh.reshape(nb, 2, 1, 32) >> torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8)
                .reshape(1, 1, 4, 1)) & 3
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(nb, 16, 16).float()
        w = dl * q
    elif t.name == "Q3_K":
        nb = b.shape[0]
        hmask, qs, packed = b[:, 0, 0:32], b[:, 0, 32:96], b[:, 0, 96:108]
        # 16 6-bit scales: low nibbles of bytes 0..7 then their high nibbles, 2 more bits from bytes 8..11
        # (shifted by 0/2/4/6 for scales 0-3, 4-7, 8-11, 12-15), minus 32
        low = unpack_halves(packed[:, 0:8].reshape(nb, 1, 8)).reshape(nb, 16)
        high = (packed[:, 8:12].reshape(nb, 1, 4) >> torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8)
                .reshape(1, 4, 1)).reshape(nb, 16) & 3
        scales = ((low | (high << 4)).to(torch.int8) - 32).float()
        d = _f16(b[:, 0, 108:110].unsqueeze(1)).reshape(nb, 1)
        dl = (d * scales).reshape(nb, 16, 1)
        # sub-block j = 4n + i (32 values): bits 2i of its half's 32 qs bytes, bit j of the 32 hmask bytes as bit 2
        shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
        ql = (qs.reshape(nb, 2, 1, 32) >> shifts) & 3
        qh = (hmask.reshape(nb, 1, 32) >> torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 8, 1)) & 1
        q = ((ql.reshape(nb, 8, 32) | (qh << 2)).to(torch.int8) - 4).reshape(nb, 16, 16).float()
        w = dl * q
    elif t.name == "Q2_K":
        nb = b.shape[0]
        sc, qs = b[:, 0, 0:16], b[:, 0, 16:80]
        d = _f16(b[:, 0, 80:82].unsqueeze(1)).reshape(nb, 1)
        dmin = _f16(b[:, 0, 82:84].unsqueeze(1)).reshape(nb, 1)
        dl = (d * (sc & 0x0F).float()).reshape(nb, 16, 1)
        ml = (dmin * (sc >> 4).float()).reshape(nb, 16, 1)
        # sub-block j = 4n + i (32 values): bits 2i of its half's 32 qs bytes
        q = (qs.reshape(nb, 2, 1, 32) >> torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8)
             .reshape(1, 1, 4, 1)) & 3
        w = dl * q.reshape(nb, 16, 16).float() - ml
    elif t.name == "IQ4_NL":
        d = _f16(b[..., 0:2]).unsqueeze(-1)
        w = d * iq4_levels(b.device)[unpack_halves(b[..., 2:]).long()]
    elif t.name == "IQ4_XS":
        nb = b.shape[0]
        d = _f16(b[:, 0, 0:2].unsqueeze(1)).reshape(nb, 1)
        # 6-bit scales: low nibbles of bytes 4..7 (sub-blocks 0, 2, 4, 6 low, 1, 3, 5, 7 high), 2 more bits each
        # from the uint16 at bytes 2..3 (shifted by 2j), minus 32
        low = torch.stack((b[:, 0, 4:8] & 0x0F, b[:, 0, 4:8] >> 4), dim=-1).reshape(nb, 8)
        sh = b[:, 0, 2:4].contiguous().view(torch.int16).to(torch.int32).reshape(nb, 1) & 0xFFFF
        high = (sh >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32).reshape(1, 8)) & 3
        scales = ((low.to(torch.int32) | (high << 4)) - 32).float()
        dl = (d * scales).reshape(nb, 8, 1)
        q = unpack_halves(b[:, 0, 8:].reshape(nb, 8, 16))
        w = dl * iq4_levels(b.device)[q.long()]
    elif t.name in ("IQ2_XXS", "IQ3_XXS", "IQ3_S"):
        w = _grid_iquant(t.name, b[:, 0, :])
    elif t.name in ("IQ2_XS", "IQ2_S"):
        w = _iq2_per16(t.name, b[:, 0, :])
    else:  # pragma: no cover - GGUF_TYPES lists exactly the branches above
        raise ValueError(f"no dequantizer for {t.name}")
    return w.reshape(n, k).to(dtype)
