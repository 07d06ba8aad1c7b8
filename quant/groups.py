"""Group-wise int8 / int4 weight quantization: the packed format, quantize / dequantize, GGUF blocks.

The format (kernels are written against it; do not change it):
  QuantizedTensor(bits, group_size, symmetric, shape=(N, K), codes, scales, mins)
  bits=8: codes int8 [N, K], symmetric, group_size 32/64/128 or K (per output channel)
  bits=4: codes uint8 [N, K//2], values 0..15 packed per block of 32 along K exactly as GGUF Q4_0/Q4_1:
          byte j of block b = code[b*32+j] | code[b*32+j+16] << 4
  scales float16 [N, K//group_size]; mins float16 [N, K//group_size] for asymmetric int4 only.
  dequantize (float32, in this order, so GGUF imports match gguf.quants.dequantize bit for bit):
    int8: w = codes * scale;  int4 sym: w = (codes - 8) * scale;  int4 asym: w = codes * scale + min

quantize(search=True) picks per group the scale (and min) that minimise the squared reconstruction
error, as llama.cpp's make_qx_quants (symmetric) and make_qkx2_quants + an HQQ-like alternation
(asymmetric) do, then re-derives the codes from the float16-rounded scale (and min) that is stored,
and keeps whichever candidate — round-to-nearest included — is best after that rounding. So search is
never worse than round-to-nearest on any group. Everything is vectorised over a chunk of rows.
"""
from __future__ import annotations

import warnings

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..errors import QuantizationError
from ..kernels.int4_layout import pack_q4_blocks, unpack_q4_blocks
from ..kernels.matmul import dequantize_int4, dequantize_int8

__all__ = ["QuantizedTensor", "quantize", "dequantize", "pack_q4_blocks", "unpack_q4_blocks", "from_gguf", "gguf_into",
           "empty_gguf_exact", "to_gguf",
           "check_format", "GROUP_SIZES"]

GROUP_SIZES = (32, 64, 128)
CHUNK_ELEMENTS = 1 << 19  # rows are quantized in chunks of about this many weights: bounded memory
FP16_MAX = 65504.0


# ------------------------------------------------------------------------------------------------
# The packed tensor
# ------------------------------------------------------------------------------------------------
@dataclass
class QuantizedTensor:
    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, int]
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        check_format(self.bits, self.group_size, self.shape, self.symmetric)
        n, k = self.shape
        codes_shape, codes_dtype = ((n, k), torch.int8) if self.bits == 8 else ((n, k // 2), torch.uint8)
        groups = (n, k // self.group_size)
        if tuple(self.codes.shape) != codes_shape or self.codes.dtype != codes_dtype:
            raise QuantizationError(f"int{self.bits} codes for shape {self.shape} must be {codes_dtype} "
                                    f"{list(codes_shape)}, got {self.codes.dtype} {list(self.codes.shape)}")
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float16:
            raise QuantizationError(f"scales for shape {self.shape}, group {self.group_size} must be float16 "
                                    f"{list(groups)}, got {self.scales.dtype} {list(self.scales.shape)}")
        if (self.mins is None) != self.symmetric:
            raise QuantizationError("mins must be given for asymmetric int4 and only then")
        if self.mins is not None and (tuple(self.mins.shape) != groups or self.mins.dtype != torch.float16):
            raise QuantizationError(f"mins for shape {self.shape} must be float16 {list(groups)}, "
                                    f"got {self.mins.dtype} {list(self.mins.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales (+ mins): what the weight costs in memory and on disk."""
        tensors = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.shape[0] * self.shape[1])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> QuantizedTensor:
        mins = None if self.mins is None else self.mins.to(device)
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device), mins=mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def check_format(bits: int, group_size: int, shape: tuple[int, int], symmetric: bool = True) -> None:
    """Raise QuantizationError unless (bits, group_size, symmetric) can quantize a weight of `shape`."""
    if bits not in (4, 8):
        raise QuantizationError(f"bits must be 4 or 8, not {bits}")
    if len(shape) != 2:
        raise QuantizationError(f"only 2-D weights can be quantized, got shape {tuple(shape)}")
    n, k = shape
    if bits == 8 and not symmetric:
        raise QuantizationError("int8 quantization is symmetric only")
    if group_size not in GROUP_SIZES and not (bits == 8 and group_size == k):
        allowed = "32, 64, 128" + (" or K (per channel)" if bits == 8 else "")
        raise QuantizationError(f"group size {group_size} is not supported for int{bits} (choose {allowed})")
    if k == 0 or n == 0 or k % group_size:
        raise QuantizationError(f"weight of shape ({n}, {k}): in_features {k} is not a multiple of "
                                f"the group size {group_size}")
    if bits == 4 and k % 32:
        raise QuantizationError(f"weight of shape ({n}, {k}): int4 needs in_features a multiple of 32")


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] (computed in float32, then cast to `dtype`)."""
    if qt.bits == 8:
        return dequantize_int8(qt.codes, qt.scales, qt.group_size, dtype)
    return dequantize_int4(qt.codes, qt.scales, qt.mins, qt.group_size, dtype)


# ------------------------------------------------------------------------------------------------
# Quantization
# ------------------------------------------------------------------------------------------------
def quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = True, search: bool = True,
             importance: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize a float weight [N, K] (out, in) group-wise along K.

    search=False: round-to-nearest as llama.cpp's reference quantizers do it (int4 symmetric: the
    largest |w| of a group maps to code -8, Q4_0; int8: to ±127, Q8_0; asymmetric: min → 0, max → 15,
    Q4_1), so weights already on one of those grids come back exactly. search=True: least-squares scale
    (and min) search per group. `importance` [K] (optional, e.g. mean squared activations per input
    channel) weights the error the search minimises."""
    if w.dim() != 2:
        raise QuantizationError(f"only 2-D weights can be quantized, got shape {tuple(w.shape)}")
    n, k = w.shape
    if bits == 8:
        symmetric = True
    check_format(bits, group_size, (n, k), symmetric)
    if not w.is_floating_point():
        raise QuantizationError(f"cannot quantize a {w.dtype} tensor of shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise QuantizationError(f"weight of shape ({n}, {k}) has NaN or infinite values")
    g = k // group_size
    codes = torch.empty((n, k) if bits == 8 else (n, k // 2), dtype=torch.int8 if bits == 8 else torch.uint8,
                        device=w.device)
    scales = torch.empty(n, g, dtype=torch.float16, device=w.device)
    mins = None if symmetric else torch.empty(n, g, dtype=torch.float16, device=w.device)
    imp = None
    if importance is not None:
        imp = importance.to(device=w.device, dtype=torch.float32).reshape(1, g, group_size)
    rows = max(1, CHUNK_ELEMENTS // k)
    for r0 in range(0, n, rows):
        x = w[r0:r0 + rows].to(torch.float32).reshape(-1, g, group_size)
        if symmetric:
            q, s = _quantize_symmetric(x, bits, search, imp)
        else:
            q, s, m = _quantize_asymmetric(x, search, imp)
            mins[r0:r0 + rows] = m
        scales[r0:r0 + rows] = s
        q = q.reshape(-1, k)
        codes[r0:r0 + rows] = q.to(torch.int8) if bits == 8 else pack_q4_blocks(q)
    return QuantizedTensor(bits, group_size, symmetric, (n, k), codes, scales, mins)


def _half(t: torch.Tensor) -> torch.Tensor:
    """Round to float16 (and back to float32): the precision the scale is stored with."""
    return t.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)


def _safe_recip(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.zeros_like(s), 1.0 / torch.where(s == 0, torch.ones_like(s), s))


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) over each group → [R, G, 1]. A batched matmul: one pass, no product temporary
    (twice as fast as mul + sum(-1) over 32-wide groups)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1)


class _Sums:
    """Weighted sums over each group of x [R, G, gs], the importance weights folded in once."""

    def __init__(self, x: torch.Tensor, imp: torch.Tensor | None):
        self.imp = imp
        self.xw = x if imp is None else x * imp

    def xc(self, c: torch.Tensor) -> torch.Tensor:  # sum w x c
        return _dot(self.xw, c)

    def cc(self, c: torch.Tensor) -> torch.Tensor:  # sum w c^2
        return _dot(c, c) if self.imp is None else _dot(c * self.imp, c)

    def c(self, c: torch.Tensor) -> torch.Tensor:  # sum w c
        return c.sum(-1, keepdim=True) if self.imp is None else _dot(self.imp, c)


def _pick(x: torch.Tensor, sums: _Sums | None, candidates: list[tuple], codes_of, dequant_of):
    """The candidate (after fp16 rounding of its parameters, with the codes those give) of least
    error per group → (codes, *fp16-rounded parameters)."""
    best = None
    for params in candidates:
        p16 = tuple(_half(p) for p in params)
        c = codes_of(x, *p16)
        if len(candidates) == 1:
            return (c, *p16)
        err = sums.cc(x - dequant_of(c, *p16))
        if best is None:
            best = (err, c, *p16)
            continue
        better = err < best[0]
        best = tuple(torch.where(better, new, old) for new, old in zip((err, c, *p16), best))
    return best[1:]


# -- symmetric: codes c in [-qneg, qneg-1], w = c * s (stored as c + 8 for int4) ----------------------
def _sym_codes(x: torch.Tensor, s: torch.Tensor, qneg: int) -> torch.Tensor:
    return torch.round(x * _safe_recip(s)).clamp_(-qneg, qneg - 1)


def _sym_grid(bits: int) -> list[float]:
    # llama.cpp make_qx_quants tries nmax + 0.1*i, i = -9..9 (int4). For int8, the same relative span.
    if bits == 4:
        return [8.0 + 0.1 * i for i in range(-9, 10)]
    return [128.0 * (1.0 + 0.0125 * i) for i in range(-9, 10)]


def _quantize_symmetric(x: torch.Tensor, bits: int, search: bool, imp: torch.Tensor | None):
    """x [R, G, gs] → (codes as stored: int4 0..15 / int8 -128..127, scales fp16 [R, G])."""
    qneg = 1 << (bits - 1)
    # int4 (Q4_0): the signed extreme maps to -8 exactly, so the other side never needs more than 7 levels.
    # int8 (Q8_0): the largest |w| maps to ±127, so weights already on a Q8_0 grid come back exactly.
    extreme = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    rtn = extreme / -8.0 if bits == 4 else extreme.abs() / 127.0
    candidates = [(rtn,)]
    sums = None
    if search:
        sums = _Sums(x, imp)
        y = x * _safe_recip(extreme)  # the extreme at exactly -1 or 1
        best_s, best_score = rtn, torch.full_like(rtn, -1.0)
        for f in _sym_grid(bits):
            c = (y * -f).round_().clamp_(-qneg, qneg - 1)
            sxl, sll = sums.xc(c), sums.cc(c)
            ok = sll > 0
            sll = torch.where(ok, sll, torch.ones_like(sll))
            # least-squares scale for these codes; the error it leaves is sum(w x^2) - sxl^2 / sll
            score = torch.where(ok, sxl * sxl / sll, torch.zeros_like(sll))
            better = score > best_score
            best_s = torch.where(better, sxl / sll, best_s)
            best_score = torch.where(better, score, best_score)
        candidates.append((best_s,))
        # one more least-squares step on the codes the fp16-rounded scale gives (HQQ-like alternation)
        c = _sym_codes(x, _half(best_s), qneg)
        sll = sums.cc(c)
        candidates.append((torch.where(sll > 0, sums.xc(c) / sll.clamp_min(1e-30), best_s),))
    codes, s16 = _pick(x, sums, candidates, lambda x, s: _sym_codes(x, s, qneg), lambda c, s: c * s)
    return (codes + 8 if bits == 4 else codes), s16.squeeze(-1).to(torch.float16)


# -- asymmetric int4: codes 0..15, w = c * s + m ----------------------------------------------------
def _asym_codes(x: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.round((x - m) * _safe_recip(s)).clamp_(0, 15)


def _asym_fit(x, c, sums: _Sums, sw, sx):
    """Least-squares (scale, min) for fixed codes c, and the squared error they leave."""
    sl, sll, sxl = sums.c(c), sums.cc(c), sums.xc(c)
    det = sw * sll - sl * sl
    ok = det > 0
    d = torch.where(ok, det, torch.ones_like(det))
    s = (sw * sxl - sx * sl) / d
    m = (sll * sx - sl * sxl) / d
    # least-squares residual: sum(w x^2) - s*sum(w x c) - m*sum(w x), no extra pass
    return s, m, ok, sxl


def _quantize_asymmetric(x: torch.Tensor, search: bool, imp: torch.Tensor | None):
    """x [R, G, gs] → (codes 0..15, scales fp16 [R, G], mins fp16 [R, G])."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = hi - lo
    candidates = [(span / 15.0, lo)]
    sums = None
    if search:
        sums = _Sums(x, imp)
        ones = torch.ones_like(x[:1])
        sw = sums.c(ones)
        sx, sxx = sums.c(x), sums.xc(x)
        y = (x - lo) * _safe_recip(span)  # in [0, 1]
        best = (span / 15.0, lo)
        best_err = torch.full_like(span, float("inf"))
        # make_qkx2_quants: iscale = (nmax + rmin + rdelta * i) / (max - min), rmin=-1, rdelta=0.1, 21 steps
        for i in range(21):
            c = (y * (14.0 + 0.1 * i)).round_().clamp_(0, 15)
            s, m, ok, sxl = _asym_fit(x, c, sums, sw, sx)
            err = sxx - s * sxl - m * sx
            better = ok & (err < best_err)
            best = (torch.where(better, s, best[0]), torch.where(better, m, best[1]))
            best_err = torch.where(better, err, best_err)
        candidates.append(best)
        s, m = best
        for _ in range(2):  # alternate: codes for the stored (fp16) scale/min, then refit
            c = _asym_codes(x, _half(s), _half(m))
            s2, m2, ok, _ = _asym_fit(x, c, sums, sw, sx)
            s, m = torch.where(ok, s2, s), torch.where(ok, m2, m)
            candidates.append((s, m))
    codes, s16, m16 = _pick(x, sums, candidates, _asym_codes, lambda c, s, m: c * s + m)
    return codes, s16.squeeze(-1).to(torch.float16), m16.squeeze(-1).to(torch.float16)


# ------------------------------------------------------------------------------------------------
# GGUF blocks: Q8_0, Q4_0, Q4_1 are our int8 g32 / int4 g32 sym / int4 g32 asym, byte for byte
# ------------------------------------------------------------------------------------------------
# type name → (bits, symmetric, bytes per block of 32, float16 fields at the block's start)
GGUF_BLOCKS = {"Q8_0": (8, True, 34, 1), "Q4_0": (4, True, 18, 1), "Q4_1": (4, False, 20, 2)}
# the GGUF types that are exactly one of our formats: type name → (bits, symmetric)
GGUF_EXACT = {name: (bits, sym) for name, (bits, sym, _, _) in GGUF_BLOCKS.items()}


def _gguf_type_name(ggml_type: Any) -> str:
    from ..gguf_file import GGML_BLOCKS

    if isinstance(ggml_type, str):
        name = ggml_type
    else:
        if int(ggml_type) not in GGML_BLOCKS:
            raise QuantizationError(f"unknown GGML type {ggml_type!r}")
        name = GGML_BLOCKS[int(ggml_type)][0]
    if name not in GGUF_BLOCKS:
        raise QuantizationError(f"GGML type {name} does not map onto edgellm's packed format "
                                f"(only {', '.join(GGUF_BLOCKS)}); dequantize and requantize it")
    return name


def empty_gguf_exact(ggml_type: Any, rows: int, k: int) -> QuantizedTensor:
    """An uninitialised QuantizedTensor of `rows` rows in the format a Q8_0 / Q4_0 / Q4_1 tensor maps onto."""
    bits, sym, _, _ = GGUF_BLOCKS[_gguf_type_name(ggml_type)]
    codes = torch.empty(rows, k, dtype=torch.int8) if bits == 8 else torch.empty(rows, k // 2, dtype=torch.uint8)
    mins = None if sym else torch.empty(rows, k // 32, dtype=torch.float16)
    return QuantizedTensor(bits, 32, sym, (rows, k), codes, torch.empty(rows, k // 32, dtype=torch.float16), mins)


def gguf_into(raw: np.ndarray, ggml_type: Any, shape: tuple[int, int], out: QuantizedTensor, row0: int = 0,
              heads: int | None = None) -> None:
    """Raw GGUF blocks (uint8, a view of the mapped file) of a weight of our shape (N, K) copied into rows [row0,
    row0 + N) of `out` (empty_gguf_exact's, e.g. the rows of a fused q/k/v): one strided copy per field, a byte
    reshuffle only; `heads`: llama.cpp's Q/K row order undone on the way (gguf_file.unpermute_rope_rows)."""
    name = _gguf_type_name(ggml_type)
    bits, sym, block_bytes, n_fp16 = GGUF_BLOCKS[name]
    n, k = int(shape[0]), int(shape[1])
    if k % 32:
        raise QuantizationError(f"{name} tensor of shape ({n}, {k}): in_features must be a multiple of 32")
    arr = np.asarray(raw)
    if arr.dtype != np.uint8 or arr.size != n * (k // 32) * block_bytes:
        raise QuantizationError(f"{name} tensor of shape ({n}, {k}): expected {n * (k // 32) * block_bytes} "
                                f"raw bytes (uint8), got {arr.size} {arr.dtype}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only view of the mapped file: only read, then copied
        blocks = torch.from_numpy(arr.reshape(n, k // 32, block_bytes))

    def put(dst: torch.Tensor, first_byte: int, nbytes: int) -> None:
        # dst: our rows as uint8 [n, k/32, nbytes]; torch's strided copy (7x numpy's for these 32-byte runs at a
        # 34-byte stride: a 30 MB Q8_0 table in 13 vs 90 ms), the row permutation a view of both sides
        src = blocks[:, :, first_byte:first_byte + nbytes]
        if heads:
            half = n // heads // 2
            dst.view(heads, 2, half, k // 32, nbytes).copy_(src.view(heads, half, 2, k // 32, nbytes).swapaxes(1, 2))
        else:
            dst.copy_(src)

    rows = slice(row0, row0 + n)
    payload = 32 if bits == 8 else 16
    put(out.codes[rows].view(torch.uint8).view(n, k // 32, payload), 2 * n_fp16, payload)
    put(out.scales[rows].view(torch.uint8).view(n, k // 32, 2), 0, 2)  # (GGUF is little-endian, as every host)
    if not sym:
        put(out.mins[rows].view(torch.uint8).view(n, k // 32, 2), 2, 2)


def from_gguf(raw: np.ndarray, ggml_type: Any, shape: tuple[int, int]) -> QuantizedTensor:
    """Raw GGUF blocks (uint8, as `gguf.GGUFReader` gives `tensor.data`) of a weight of our shape
    (N, K) → QuantizedTensor, by a byte reshuffle only (no float round trip)."""
    n, k = int(shape[0]), int(shape[1])
    if k % 32:
        raise QuantizationError(f"{_gguf_type_name(ggml_type)} tensor of shape ({n}, {k}): in_features must be a "
                                f"multiple of 32")
    out = empty_gguf_exact(ggml_type, n, k)
    gguf_into(raw, ggml_type, shape, out)
    return out


def to_gguf(qt: QuantizedTensor) -> tuple[np.ndarray, Any]:
    """(uint8 [N, K/32 * block bytes] raw blocks, GGMLQuantizationType) for GGUFWriter.add_tensor(...,
    raw_dtype=type). Needs group size 32: int8 → Q8_0, int4 sym → Q4_0, int4 asym → Q4_1."""
    import gguf

    if qt.group_size != 32:
        raise QuantizationError(f"GGUF export needs group size 32 (this tensor of shape {qt.shape} "
                                f"uses {qt.group_size})")
    name = "Q8_0" if qt.bits == 8 else ("Q4_0" if qt.symmetric else "Q4_1")
    n, k = qt.shape
    g = k // 32

    def fp16_bytes(t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().contiguous().numpy().astype("<f2").view(np.uint8).reshape(n, g, 2)

    parts = [fp16_bytes(qt.scales)]
    if qt.mins is not None:
        parts.append(fp16_bytes(qt.mins))
    payload = qt.codes.detach().cpu().contiguous().numpy().view(np.uint8).reshape(n, g, -1)
    raw = np.concatenate(parts + [payload], axis=-1).reshape(n, -1)
    return raw, gguf.GGMLQuantizationType[name]
