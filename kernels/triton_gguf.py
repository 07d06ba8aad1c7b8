"""GGUF blocks multiplied as stored on CUDA, in Triton: the decode / verification product (a few rows of x against
the blocks, dequantized in registers) and a layer's dequantization for longer prompts.

Every type here is read 256 values of a row at a time, as a [S, V] tile of its blocks: eight 32-value blocks
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), one Q4_K / Q5_K / IQ4_XS super-block as its 8 sub-blocks of 32, or one
Q2_K / Q3_K / Q6_K super-block as its 16 sub-blocks of 16, so a sub-block's scale is a [BLOCK_N, S, 1] broadcast
(IQ4_NL / IQ4_XS codes index 16 levels, loaded from a 64-byte table). Measured on an H200: the first eight; Q2_K,
Q3_K, IQ4_NL and IQ4_XS are checked under the interpreter only (tests/test_triton_gguf.py), and a kernel that fails
to build at its first launch drops its type to the caller's torch ops (`KernelFailed`). Each value is computed with the
float32 operations of `gguf.quants.dequantize` in its order (the dequantization kernel is compiled without fused
multiply-adds, so its output is bit for bit gguf.quants', then rounded to nearest in the output dtype); the product
multiplies the float32 weights by x in float32 (finer than the float model, whose weights are in the compute dtype:
rounding them here cost the decode kernel a sixth more instructions for nothing gained).

`gguf_rows` takes up to MAX_ROWS rows of x: each weight tile is read once and dotted with every row (a static loop
over the rows, so a row's sums are the same whatever the others: one token or a verification of several gives the
same logits for it). Runs under TRITON_INTERPRET=1 on CPU tensors (tests); quant/gguf_linear.py calls it on CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gguf_ops import iq4_levels

# GGUF type id → (bytes per block, values per block); the types this module multiplies
TYPES = {2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32), 10: (84, 256), 11: (110, 256),
         12: (144, 256), 13: (176, 256), 14: (210, 256), 20: (18, 32), 23: (136, 256)}
MAX_ROWS = 16  # rows of x gguf_rows takes (a decode step, a speculative verification); more: dequantize + GEMM
# (S, V) of the 256-value tile: Q2_K / Q3_K / Q6_K's 16 sub-blocks of 16, every other type 8 x 32
_TILE = {10: (16, 16), 11: (16, 16), 14: (16, 16)}


@triton.jit
def _half(ptr, mask):
    """The little-endian fp16 at byte pointer(s) `ptr`, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(scales, s, mask):
    """Q4_K / Q5_K sub-block s's 6-bit scale and min from the 12 scale bytes at `scales` (gguf.quants'
    Q4_K.get_scale_min), as float32."""
    s4 = s % 4
    b0 = tl.load(scales + s4, mask=mask, other=0)
    b1 = tl.load(scales + 4 + s4, mask=mask, other=0)
    b2 = tl.load(scales + 8 + s4, mask=mask, other=0)
    sc = tl.where(s < 4, b0 & 63, (b2 & 0xF) | ((b0 >> 2) & 0x30))
    mn = tl.where(s < 4, b1 & 63, (b2 >> 4) | ((b1 >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _tile(raw, levels, rows, row_ok, row_bytes, it, K, TYPE: tl.constexpr, BYTES: tl.constexpr, S: tl.constexpr,
          V: tl.constexpr, U: tl.constexpr):
    """Values it*U*256 .. +U*256 of `rows` (a [BLOCK_N] vector), dequantized: float32 [BLOCK_N, U*S, V], U units of
    256 values side by side (more bytes in flight per iteration). Values past K come out 0. BYTES: the type's block
    size; `levels`: IQ4_NL / IQ4_XS's 16 levels (float32), for those types."""
    su = tl.arange(0, U * S)[None, :, None]
    unit = it * U + su // S  # the unit (256 values) of each (sub-)block row of the tile
    s = su % S  # block (or sub-block) within the unit
    v = tl.arange(0, V)[None, None, :]  # value within it
    row = raw + rows[:, None, None].to(tl.int64) * row_bytes
    if TYPE == 10 or TYPE == 11 or TYPE == 12 or TYPE == 13 or TYPE == 14 or TYPE == 23:  # a super-block a unit
        sok = row_ok[:, None, None] & (unit * 256 < K)  # [BLOCK_N, U*S, 1]
        ok = sok & (v >= 0)
        blk = row + unit * BYTES
        if TYPE == 10 or TYPE == 11 or TYPE == 14:  # 16 sub-blocks of 16: value 128 n + 32 i + l, l = 16 (s%2) + v
            n, i, l = s // 8, (s % 8) // 2, 16 * (s % 2) + v
            if TYPE == 14:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
                lo = tl.load(blk + 64 * n + 32 * (i % 2) + l, mask=ok, other=0)
                hi = tl.load(blk + 128 + 32 * n + l, mask=ok, other=0)
                code = ((lo >> (4 * (i // 2))) & 0xF) | (((hi >> (2 * i)) & 3) << 4)
                scale = tl.load(blk + 192 + s, mask=sok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                w = (_half(blk + 208, sok) * scale) * (code.to(tl.int8) - 32).to(tl.float32)
            elif TYPE == 10:  # Q2_K: scales[16] (scale | min << 4), qs[64], d, dmin
                sc = tl.load(blk + s, mask=sok, other=0)
                code = (tl.load(blk + 16 + 32 * n + l, mask=ok, other=0) >> (2 * i)) & 3
                w = ((_half(blk + 80, sok) * (sc & 0xF).to(tl.float32)) * code.to(tl.float32)
                     - _half(blk + 82, sok) * (sc >> 4).to(tl.float32))
            else:  # Q3_K: hmask[32], qs[64], scales[12] (6-bit, minus 32), d; a set hmask bit means no -4
                lo6 = (tl.load(blk + 96 + s % 8, mask=sok, other=0) >> (4 * (s // 8))) & 0xF
                hi6 = (tl.load(blk + 104 + s % 4, mask=sok, other=0) >> (2 * (s // 4))) & 3
                scale = ((lo6 | (hi6 << 4)).to(tl.int8) - 32).to(tl.float32)
                ql = (tl.load(blk + 32 + 32 * n + l, mask=ok, other=0) >> (2 * i)) & 3
                qh = ((tl.load(blk + l, mask=ok, other=0) >> (4 * n + i)) & 1) ^ 1
                w = (_half(blk + 108, sok) * scale) * (ql.to(tl.int8) - (qh << 2).to(tl.int8)).to(tl.float32)
        elif TYPE == 23:  # IQ4_XS: d, scales_h u16, scales_l[4], qs[128]; sub-block s of 32, levels[code]
            lo6 = (tl.load(blk + 4 + s // 2, mask=sok, other=0) >> (4 * (s % 2))) & 0xF
            hbits = tl.load(blk + 2, mask=sok, other=0).to(tl.uint16) | (tl.load(blk + 3, mask=sok, other=0)
                                                                          .to(tl.uint16) << 8)
            hi6 = ((hbits >> (2 * s).to(tl.uint16)) & 3).to(tl.uint8)
            scale = ((lo6 | (hi6 << 4)).to(tl.int8) - 32).to(tl.float32)
            code = (tl.load(blk + 8 + 16 * s + v % 16, mask=ok, other=0) >> (4 * (v // 16))) & 0xF
            w = (_half(blk, sok) * scale) * tl.load(levels + code, mask=ok, other=0.0)
        else:  # Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same, qh[32] before qs
            d = _half(blk, sok)
            dmin = _half(blk + 2, sok)
            sc, mn = _k_scale_min(blk + 4, s, sok)
            qs = blk + (16 if TYPE == 12 else 48)
            code = (tl.load(qs + 32 * (s // 2) + v, mask=ok, other=0) >> (4 * (s % 2))) & 0xF
            if TYPE == 13:
                code = code | (((tl.load(blk + 16 + v, mask=ok, other=0) >> s) & 1) << 4)
            w = (d * sc) * code.to(tl.float32) - dmin * mn
    else:  # 32-value blocks, 8 a unit; value v of a block: byte v % 16 of its 16, nibble v // 16 (Q8_0: byte v)
        bi = it * U * 8 + su
        ok = row_ok[:, None, None] & (bi * 32 < K)
        vok = ok & (v >= 0)
        blk = row + bi * BYTES
        d = _half(blk, ok)
        if TYPE == 8:  # Q8_0: d, qs[32] (int8)
            w = d * tl.load(blk + 2 + v, mask=vok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            qs = blk + (2 if TYPE == 2 or TYPE == 20 else (4 if TYPE == 3 else (6 if TYPE == 6 else 8)))
            code = (tl.load(qs + v % 16, mask=vok, other=0) >> (4 * (v // 16))) & 0xF
            if TYPE == 6 or TYPE == 7:  # the fifth bits: a little-endian u32 before qs, bit v for value v
                qh = tl.load(qs - 4 + v // 8, mask=vok, other=0)
                code = code | (((qh >> (v % 8)) & 1) << 4)
            if TYPE == 2:  # Q4_0: d (q - 8)
                w = d * (code.to(tl.int8) - 8).to(tl.float32)
            elif TYPE == 6:  # Q5_0: d (q - 16)
                w = d * (code.to(tl.int8) - 16).to(tl.float32)
            elif TYPE == 20:  # IQ4_NL: d levels[q]
                w = d * tl.load(levels + code, mask=vok, other=0.0)
            else:  # Q4_1 / Q5_1: d q + m
                w = d * code.to(tl.float32) + _half(blk + 2, ok)
    return w


@triton.jit
def _round(w, ROUND: tl.constexpr):
    """float32 w rounded to ROUND's precision (0: none, 1: bfloat16, 2: float16), still float32. bfloat16 by its bits,
    to nearest even (Triton's interpreter truncates a bfloat16 cast; weights are finite)."""
    if ROUND == 1:
        b = w.to(tl.uint32, bitcast=True)
        w = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif ROUND == 2:
        w = w.to(tl.float16).to(tl.float32)
    return w


@triton.jit
def _rows_kernel(x, raw, levels, out, index, M, N, K, stride_xm, row_bytes, stride_om, col0,
                 TYPE: tl.constexpr, BYTES: tl.constexpr, S: tl.constexpr, V: tl.constexpr, U: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INDEX: tl.constexpr):
    """out[m, col(r)] = sum_k x[m, k] w[r, k] for this program's BLOCK_N rows r of the blocks, every m < M."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    k_in_tile = (tl.arange(0, U * S)[:, None] * V + tl.arange(0, V)[None, :])  # [U*S, V]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(0, tl.cdiv(K, 256 * U)):
        w = _tile(raw, levels, rows, row_ok, row_bytes, it, K, TYPE, BYTES, S, V, U)
        k = it * U * 256 + k_in_tile
        for m in tl.static_range(BLOCK_M):
            xm = tl.load(x + m * stride_xm + k, mask=(k < K) & (k * 0 + m < M), other=0).to(tl.float32)
            part = tl.sum(tl.sum(w * xm[None, :, :], axis=2), axis=1)  # [BLOCK_N]
            acc += tl.where(ms[:, None] == m, part[None, :], 0.0)
    if HAS_INDEX:
        cols = tl.load(index + rows, mask=row_ok, other=0)
    else:
        cols = col0 + rows
    dst = out + ms[:, None] * stride_om + cols[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=(ms[:, None] < M) & row_ok[None, :])


@triton.jit
def _dequant_kernel(raw, levels, out, index, N, K, row_bytes, stride_o, row0,
                    TYPE: tl.constexpr, BYTES: tl.constexpr, S: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_INDEX: tl.constexpr, ROUND: tl.constexpr):
    """out[row(r), unit's 256 columns] = the dequantized values, for this program's rows and unit."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    unit = tl.program_id(1)
    row_ok = rows < N
    w = _round(_tile(raw, levels, rows, row_ok, row_bytes, unit, K, TYPE, BYTES, S, V, 1), ROUND)
    if HAS_INDEX:
        dst_rows = tl.load(index + rows, mask=row_ok, other=0)
    else:
        dst_rows = row0 + rows
    k = unit * 256 + tl.arange(0, S)[None, :, None] * V + tl.arange(0, V)[None, None, :]
    dst = out + dst_rows[:, None, None].to(tl.int64) * stride_o + k
    tl.store(dst, w.to(out.dtype.element_ty), mask=row_ok[:, None, None] & (k < K))


_LEVELS: dict[torch.device, torch.Tensor] = {}


def _levels(device: torch.device) -> torch.Tensor:
    """IQ4_NL / IQ4_XS's 16 int8 levels as float32 on `device`, made once, at the first (eager) call: a CUDA graph's
    capture comes after its warm-up pass."""
    if device not in _LEVELS:
        _LEVELS[device] = iq4_levels(device).contiguous()
    return _LEVELS[device]


def _rounding(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


class KernelFailed(RuntimeError):
    """A kernel of this module did not build (or launch) for a type on this machine; the type is dropped from
    `supports` for the process, and the caller falls back to the torch-ops dequantization."""


FAILED: set[int] = set()  # types whose kernel failed here
_RAN: set[tuple] = set()  # (kernel, type, launch constants, dtypes, indexed): launched once without error


def _checked(key: tuple, type_id: int, launch) -> None:
    """Run `launch()`; the first time of a kind of launch (where Triton compiles), a failure marks the type failed
    and raises KernelFailed (the types timed on a GPU are listed in the module's docstring; others are checked under
    the interpreter only, and a compiler of another version may refuse what it took)."""
    if key in _RAN:
        launch()
        return
    try:
        launch()
    except Exception as e:  # noqa: BLE001  (Triton's compile errors have no common base across versions)
        FAILED.add(type_id)
        raise KernelFailed(f"the Triton kernel for GGUF type {type_id} failed here: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e
    _RAN.add(key)


def supports(type_id: int, k: int) -> bool:
    """Whether this module multiplies blocks of this GGUF type along k values."""
    return type_id in TYPES and type_id not in FAILED and k % TYPES[type_id][1] == 0


def _launch(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, units of 256 values per iteration, warps) for an n x k product."""
    units = min(8, triton.next_power_of_2(triton.cdiv(k, 256)))
    # one row a program keeps a few thousand programs streaming on the narrow matrices (H200, 1B shapes); the wide
    # ones (gate / up, the LM head) do better with 4 (Q6_K head: 114 against 157 us a product). The sweep at m = 1 in
    # results/cuda-gguf-h200-kernels.json has 4 rows within 0-10% of the best on the 2048-row ones too (not
    # re-measured end to end)
    return (1 if n <= 2048 else 2 if n <= 4096 else 4), units, 4


def gguf_rows(x: torch.Tensor, parts: list[tuple[torch.Tensor, int, int, torch.Tensor | None]], n_out: int,
              out_dtype: torch.dtype | None = None, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ W.T, W the parts stacked along the outputs (each (raw uint8 [rows, row bytes],
    GGUF type, rows, out_index int32 [rows] or None: the output column of each row)) → [M, n_out].
    `launch`: (rows per program, units per iteration, warps) (benchmarks/triton_gguf_kernels.py sweeps them;
    default: _launch's)."""
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"gguf_rows takes up to {MAX_ROWS} rows of x, got {m}")
    x = x.contiguous()
    out = torch.empty(m, n_out, dtype=out_dtype or x.dtype, device=x.device)
    block_m = max(1, triton.next_power_of_2(m))
    col0 = 0
    for raw, type_id, rows, index in parts:
        s, v = _TILE.get(type_id, (8, 32))
        bn, units, warps = launch or _launch(rows, k)
        _checked(("rows", type_id, block_m, bn, units, warps, x.dtype, out.dtype, index is not None), type_id,
                 lambda: _rows_kernel[(triton.cdiv(rows, bn),)](
                     x, raw, _levels(raw.device), out, index if index is not None else raw, m, rows, k, x.stride(0),
                     raw.stride(0), out.stride(0), col0, TYPE=type_id, BYTES=TYPES[type_id][0], S=s, V=v, U=units,
                     BLOCK_M=block_m, BLOCK_N=bn, HAS_INDEX=index is not None, num_warps=warps))
        col0 += rows
    return out


def gguf_dequantize(parts: list[tuple[torch.Tensor, int, int, torch.Tensor | None]], k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The parts' float weight [rows, k] in `dtype`, each value bit for bit gguf.quants' (rounded to dtype)."""
    n = sum(p[2] for p in parts)
    out = torch.empty(n, k, dtype=dtype, device=parts[0][0].device)
    row0 = 0
    for raw, type_id, rows, index in parts:
        s, v = _TILE.get(type_id, (8, 32))
        bn = 16
        _checked(("dequantize", type_id, dtype, index is not None), type_id,
                 lambda: _dequant_kernel[(triton.cdiv(rows, bn), triton.cdiv(k, 256))](
                     raw, _levels(raw.device), out, index if index is not None else raw, rows, k, raw.stride(0),
                     out.stride(0), row0, TYPE=type_id, BYTES=TYPES[type_id][0], S=s, V=v, BLOCK_N=bn,
                     HAS_INDEX=index is not None, ROUND=_rounding(dtype), num_warps=4, enable_fp_fusion=False))
        row0 += rows
    return out
