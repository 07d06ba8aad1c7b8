"""Attention against the KV cache, read in place: flash-decoding in torch (CPU/MPS) + dispatch.

Storages: kv_store.py (FloatKV, Int8KV, Int4KV; one per layer, preallocated).

`attention(q, store, kv_len, q_start, scale)`: query row i sits at absolute position q_start + i and
attends keys 0..q_start+i (causal against the cache). GQA: query heads h*g..h*g+g-1 share KV head h;
their g*T query rows are one matrix against that head's keys, so K/V are never repeated.

The torch implementation splits the KV sequence into tiles of `split` positions (flash-decoding,
Dao et al. 2023): each tile yields a partial output, its row max and its sum of exponentials, and the
partials are combined with log-sum-exp weights. A quantized tile is dequantized into a buffer of one
tile, so nothing cache-sized is ever allocated. Long query blocks (prefill on top of a kept prefix)
are processed `q_block` rows at a time, which bounds the score matrix at Hkv × g·q_block × split.

No host syncs: every branch depends on Python ints (lengths, positions), never on tensor values.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .kv_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from .kv_store import (FloatKV, Int4KV, Int8KV, KVStore, check_attention_args, groups, head_dim_of,  # noqa: F401
                       n_sink, triton_supports)

# fp32 bytes of work per KV tile in the torch path (see auto_split): 6 MiB is 8192 positions of the
# SmolLM2 shape (3 KV heads × 64) and stays in the last-level cache.
TILE_BYTES = 6 << 20
# A float cache up to this length with one query goes to F.scaled_dot_product_attention: measured
# faster than our matmuls below ~1k positions (one fused call), slower above.
SDPA_MAX_LEN = 768
# Query rows per block when T is large (prefill chunks); bounds the fp32 score matrix.
DEFAULT_Q_BLOCK = 256
# Query rows from which a CPU prefill (fp32, on a quantized or fp32 cache) takes torch's fused flash kernel
# (_flash_rows); fewer rows take the bmm tiles (quantized) or one SDPA call (float)
FLASH_MIN_ROWS = 32
CPU_CAUSAL_KERNEL = True  # prefill attention through kernels/cpu_attention.cpp where it is built (A/B switch)
# Finite "minus infinity": a row whose keys in one tile are all masked gets a finite running max, so
# exp() never sees inf - inf; its tile weight exp(m_tile - m_max) is exactly 0 at the combine.
_NEG = torch.finfo(torch.float32).min


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------
def write_kv(store: KVStore, k_new: torch.Tensor, v_new: torch.Tensor, start: int) -> None:
    """Quantize (if the storage asks) and write k_new, v_new [Hkv, T, D] at positions [start, start+T).

    Temporaries are the size of the new tokens only; the storage is updated in place."""
    end = start + k_new.shape[1]
    if end > store.k.shape[1]:
        raise ValueError(f"positions [{start}, {end}) do not fit a cache of {store.k.shape[1]}")
    if isinstance(store, FloatKV):
        store.k[:, start:end].copy_(k_new)
        store.v[:, start:end].copy_(v_new)
    elif isinstance(store, (Int8KV, Int4KV)):
        sd = store.k_scale.dtype
        gk, gv = groups(store)
        for x, g, parts, sink in ((k_new, gk, _k_parts(store), store.k_sink), (v_new, gv, _v_parts(store), store.v_sink)):
            q = quantize_int8(x, g, sd) if isinstance(store, Int8KV) else quantize_int4(x, g, sd)
            for dest, part in zip(parts, q):
                dest[:, start:end].copy_(part)
            if sink is not None and start < sink.shape[1] - 1:
                e = min(end, sink.shape[1] - 1)
                sink[:, start:e].copy_(x[:, : e - start])
    else:
        raise TypeError(f"unknown KV storage {type(store).__name__}")


def _k_parts(store: KVStore) -> tuple[torch.Tensor, ...]:
    return (store.k, store.k_scale) if isinstance(store, Int8KV) else (store.k, store.k_scale, store.k_min)


def _v_parts(store: KVStore) -> tuple[torch.Tensor, ...]:
    return (store.v, store.v_scale) if isinstance(store, Int8KV) else (store.v, store.v_scale, store.v_min)


def write_kv_at(store: KVStore, k_new: torch.Tensor, v_new: torch.Tensor, pos: torch.Tensor) -> None:
    """write_kv for one token at a position held on the device (int64 [1]): no host read of the
    position, so a CUDA graph can capture it. k_new, v_new [Hkv, 1, D]."""
    if isinstance(store, FloatKV):
        store.k.index_copy_(1, pos, k_new.to(store.k.dtype))
        store.v.index_copy_(1, pos, v_new.to(store.v.dtype))
        return
    if not isinstance(store, (Int8KV, Int4KV)):
        raise TypeError(f"unknown KV storage {type(store).__name__}")
    gk, gv = groups(store)
    for x, g, dests, sink in ((k_new, gk, _k_parts(store), store.k_sink), (v_new, gv, _v_parts(store), store.v_sink)):
        q = quantize_int8(x, g, store.k_scale.dtype) if isinstance(store, Int8KV) else quantize_int4(
            x, g, store.k_scale.dtype)
        for dest, part in zip(dests, q):
            dest.index_copy_(1, pos, part)
        if sink is not None:  # positions past the sinks land in the spare last row
            sink.index_copy_(1, pos.clamp(max=sink.shape[1] - 1), x.to(sink.dtype))


def dequantize_kv(store: KVStore, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions [start, end) in fp32 as attention reads them (sink rows exact; tests,
    references and debugging: attention never calls this on the whole cache)."""
    return _tile(store, 0, start, end, None), _tile(store, 1, start, end, None)


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        from . import triton_attention  # noqa: F401  (imports triton)
    except Exception:  # ImportError, or a triton that cannot initialise on this machine
        return False
    return True


def attention(q: torch.Tensor, store: KVStore, kv_len: int, q_start: int, scale: float) -> torch.Tensor:
    """q [1, Hq, T, D] at positions [q_start, q_start+T) → [1, Hq, T, D] in q's dtype.

    CUDA with triton importable (and a head dim it takes) → the Triton flash-decoding kernel;
    otherwise the torch one."""
    if q.is_cuda and triton_available() and triton_supports(store, q.shape[-1]):
        from .triton_attention import triton_attention

        return triton_attention(q, store, kv_len, q_start, scale)
    return attention_torch(q, store, kv_len, q_start, scale)


def attention_torch(q: torch.Tensor, store: KVStore, kv_len: int, q_start: int, scale: float, *,
                    split: int | None = None, q_block: int = DEFAULT_Q_BLOCK) -> torch.Tensor:
    """The torch flash-decoding implementation (any device). See the module docstring.

    split: KV positions per tile (None: sized by TILE_BYTES); q_block: query rows per block."""
    _, n_q_heads, T, D = q.shape
    n_kv = check_attention_args(q, store, kv_len)
    g = n_q_heads // n_kv
    n = min(kv_len, q_start + T)
    if (T == 1 and split is None and n <= SDPA_MAX_LEN and isinstance(store, FloatKV)
            and store.k.dtype == q.dtype):
        # Short float cache, one query: SDPA's single fused call beats a few matmul launches.
        return F.scaled_dot_product_attention(q, store.k[None, :, :n], store.v[None, :, :n], scale=scale,
                                              enable_gqa=g > 1)
    cdt = _compute_dtype(q, store)
    # The softmax scale goes into q once (T·D work instead of T·kv_len).
    qs = (q[0] if q.dtype == cdt else q[0].to(cdt)) * scale
    if n == q_start + T and cpu_flash_prefill(qs[None], store):
        # no score matrix to bound: all the rows at once, so each tile is dequantized once per call
        out = _flash_rows(qs.reshape(n_kv, g * T, D), store, q_start, T, split or auto_split(store, n_kv, 1, D))
        return out.reshape(1, n_q_heads, T, D).to(q.dtype)
    if T <= q_block:
        out = _attend_rows(qs.reshape(n_kv, g * T, D), store, n, q_start, T, split)
        return out.view(1, n_q_heads, T, D).to(q.dtype)
    qs = qs.reshape(n_kv, g, T, D)
    out = torch.empty(n_kv, g, T, D, dtype=cdt, device=q.device)
    for r0 in range(0, T, q_block):
        r1 = min(T, r0 + q_block)
        rows = qs[:, :, r0:r1].reshape(n_kv, g * (r1 - r0), D)
        ob = _attend_rows(rows, store, min(kv_len, q_start + r1), q_start + r0, r1 - r0, split)
        out[:, :, r0:r1] = ob.view(n_kv, g, r1 - r0, D)
    return out.view(1, n_q_heads, T, D).to(q.dtype)


def _compute_dtype(q: torch.Tensor, store: KVStore) -> torch.dtype:
    # CPU: fp32 everywhere (half matmuls are slow without AVX-512, and dequantized tiles are fp32).
    # Other devices keep a half-precision float cache in its dtype (matmuls accumulate in fp32).
    if q.device.type != "cpu" and isinstance(store, FloatKV):
        return store.k.dtype
    return torch.float32


def auto_split(store: KVStore, n_kv: int, rows: int, head_dim: int) -> int:
    """KV positions per tile: as many as fit TILE_BYTES of fp32 work per tile (the dequantized K or V
    tile, Hkv·split·D, and the score matrix, Hkv·rows·split), in multiples of 256. Measured on CPU:
    longer tiles always won (fewer launches, one combine), so the cap is memory, not speed."""
    in_place = isinstance(store, FloatKV) and store.k.dtype == torch.float32
    per_pos = 4 * n_kv * max(rows, 0 if in_place else head_dim)
    return max(256, TILE_BYTES // per_pos // 256 * 256)


def _attend_rows(qr: torch.Tensor, store: KVStore, n: int, pos0: int, t_rows: int, split: int | None
                 ) -> torch.Tensor:
    """qr [Hkv, R, D] (R = g·t_rows rows in (g, t) order, row t at position pos0 + t, already scaled)
    against keys [0, n) → [Hkv, R, D] in qr's dtype."""
    n_kv, R, D = qr.shape
    if split is None:
        split = auto_split(store, n_kv, R, D)
    n_tiles = -(-n // split)
    fold = (_folds_scales(store, 0), _folds_scales(store, 1))
    ws = None if isinstance(store, FloatKV) and store.k.dtype == qr.dtype else _Workspace(
        store, n_kv, min(split, n), D, qr.dtype, qr.device)
    # The int4 min term: q·(c·s + m) = s·(q·c) + m·Σq.
    qsum = qr.sum(-1, keepdim=True) if fold[0] and isinstance(store, Int4KV) else None

    if n_tiles == 1:
        s = _scores(qr, store, 0, n, ws, fold, qsum)
        _mask(s, 0, n, pos0, t_rows)
        p = torch.softmax(s, dim=-1)
        return _pv(p, store, 0, n, ws, fold)

    # Flash-decoding: per-tile partials written straight into stacked buffers, one LSE combine.
    m = torch.empty(n_tiles, n_kv, R, 1, dtype=qr.dtype, device=qr.device)
    l = torch.empty_like(m)
    o = torch.empty(n_tiles, n_kv, R, D, dtype=qr.dtype, device=qr.device)
    for i in range(n_tiles):
        a, b = i * split, min(n, (i + 1) * split)
        s = _scores(qr, store, a, b, ws, fold, qsum)
        _mask(s, a, b, pos0, t_rows)
        torch.amax(s, dim=-1, keepdim=True, out=m[i])
        p = s.sub_(m[i]).exp_()
        torch.sum(p, dim=-1, keepdim=True, out=l[i])
        o[i] = _pv(p, store, a, b, ws, fold)
    m_max = m.amax(0)
    w = m.sub_(m_max).exp_()  # [n_tiles, Hkv, R, 1]
    return (o.mul_(w).sum(0)).div_(l.mul_(w).sum(0))


@functools.lru_cache(maxsize=None)
def _cpu_flash_kernel():
    """torch's fused CPU flash-attention kernel, which also returns each row's log-sum-exp (what combining
    tiles needs; F.scaled_dot_product_attention does not return it), or None where this torch lacks it."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    try:  # the two calls _flash_rows makes: no mask, and is_causal
        q = torch.zeros(1, 1, 2, 8)
        shapes = [tuple(t.shape) for causal in (False, True) for t in op(q, q, q, 0.0, causal, scale=1.0)]
    except Exception:  # noqa: BLE001 - an older torch, another signature: the bmm tiles serve
        return None
    return op if shapes == [(1, 1, 2, 8), (1, 1, 2)] * 2 else None


def cpu_flash_prefill(q: torch.Tensor, store: KVStore) -> bool:
    """Whether attention() takes q [1, Hq, T, D] through the fused CPU flash kernel (_flash_rows): T rows
    at once, the prefix unmasked, the rows' own keys causal. For a float cache on the CPU this beats one
    masked SDPA call over the whole cache (whose mask makes it compute the blocks above the diagonal)."""
    return q.shape[2] >= FLASH_MIN_ROWS and _cpu_flash_op(q, store) is not None


def _cpu_flash_op(qr: torch.Tensor, store: KVStore):
    """The fused kernel for prefill rows on the CPU (fp32 queries; a quantized or fp32 cache), else None."""
    if qr.device.type != "cpu" or qr.dtype != torch.float32 or (
            isinstance(store, FloatKV) and store.k.dtype != torch.float32):
        return None
    return _cpu_flash_kernel()


def _flash_rows(qr: torch.Tensor, store: KVStore, pos0: int, t_rows: int, split: int) -> torch.Tensor:
    """Prefill rows on a CPU cache (int8 / int4, or fp32 read in place): qr [Hkv, R, D] (R = g·t_rows rows
    in (g, t) order, row t at position pos0 + t, already scaled) against keys [0, pos0 + t_rows), through
    torch's fused flash kernel (scores, softmax and P·V without materialising them; benchmarks/prefill_kv.py
    times it against the bmm tiles and, for a float cache, against one masked SDPA call). Two kinds of call,
    their outputs combined by log-sum-exp as the split-KV path does:
    - the prefix [0, pos0), a dequantized tile at a time: every row sees every key, so no mask, and the
      group's query heads ride as rows of their KV head;
    - the rows' own keys [pos0, pos0 + t_rows), once: causal (is_causal, so the kernel skips the blocks above
      the diagonal), per query head with K/V repeated over the group (a mask would be [R, t_rows] and make
      the kernel compute every block).
    Where kernels/cpu_attention.cpp is built: a quantized cache's own keys go through it instead of the second
    call, and an fp32 cache takes it alone, one call over [0, pos0 + t_rows) read in place."""
    op = _cpu_flash_kernel()
    n_kv, R, D = qr.shape
    g = R // t_rows
    causal = _causal_kernel(qr, D)
    if causal is not None and isinstance(store, FloatKV) and store.k.dtype == torch.float32:
        # ours over the prefix and the rows' own keys at once, read in place (no tiles to combine)
        end = pos0 + t_rows
        out, _ = causal(qr.reshape(n_kv * g, t_rows, D), store.k[:, :end], store.v[:, :end], pos0)
        return out.view(n_kv, R, D)
    ws = None if isinstance(store, FloatKV) else _Workspace(store, n_kv, max(min(split, pos0), t_rows), D,
                                                             qr.dtype, qr.device)  # (a float cache is read in place)
    acc = m_run = l_run = None

    def combine(out: torch.Tensor, lse: torch.Tensor) -> None:
        nonlocal acc, m_run, l_run
        if acc is None:
            acc, m_run, l_run = out, lse, torch.ones_like(lse)  # (each call's output is a fresh tensor)
            return
        m_new = torch.maximum(m_run, lse)
        w_old, w_new = (m_run - m_new).exp_(), (lse - m_new).exp_()
        acc.mul_(w_old).add_(out * w_new)
        l_run = l_run * w_old + w_new
        m_run = m_new

    for a in range(0, pos0, split):
        b = min(pos0, a + split)
        out, lse = op(qr[None], _tile(store, 0, a, b, ws)[None], _tile(store, 1, a, b, ws)[None], 0.0, False,
                      scale=1.0)  # q is scaled already
        combine(out[0], lse[0].unsqueeze(-1))
    end = pos0 + t_rows
    k, v = _tile(store, 0, pos0, end, ws), _tile(store, 1, pos0, end, ws)
    if causal is not None:  # ours: the triangle only, K/V shared by the group
        out, lse = causal(qr.reshape(n_kv * g, t_rows, D), k, v)
        combine(out.view(n_kv, R, D), lse.view(n_kv, R, 1))
        return acc.div_(l_run)
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    out, lse = op(qr.reshape(n_kv * g, t_rows, D)[None], k[None], v[None], 0.0, True, scale=1.0)
    combine(out[0].reshape(n_kv, R, D), lse[0].reshape(n_kv, R, 1))
    return acc.div_(l_run)


# Where the extension's AMX kernels run (Intel Xeon since Sapphire Rapids: ext.gguf_amx_available()), the causal
# kernel takes Q K^T and P V on AMX tiles, each operand as bf16 hi + lo parts (~2^-16 relative;
# kernels/cpu_attention.cpp "AMX"; head dims % 32 == 0): 0.86-0.91x the TTFT of 2048 tokens, KL unchanged
# (benchmarks/results/amx-attention-ab.json, gguf-amx-attention-kl.json). False: the fp32 kernel.
AMX_ATTENTION = True


def _causal_kernel(qr: torch.Tensor, D: int):
    """The C++ kernel for a chunk's rows (kernels/cpu_attention.cpp: query blocks stop at the diagonal, where
    torch's kernel computes whole 512-key blocks, the full square for a chunk of up to 512 rows: 1.6-2x faster at
    512 rows, benchmarks/prefill_attention.py), over the whole float cache or a quantized cache's own keys, or None:
    no AVX2 build, another dtype, a head dim it does not take."""
    if qr.dtype != torch.float32 or D % 16 or D > 256 or not CPU_CAUSAL_KERNEL:
        return None
    from .matmul import amx_kernels, cpu_extension

    ext = cpu_extension()
    if ext is None or not ext.flash_causal_fast():
        return None
    if AMX_ATTENTION and D % 32 == 0 and amx_kernels(ext):
        return functools.partial(ext.flash_causal, amx=True)
    return ext.flash_causal


def _folds_scales(store: KVStore, which: int = 1) -> bool:
    """Per-token scales (group == head dim) of K (which=0) or V (1): the scale (and min) is constant
    along the dot product, so it is applied to the [R, L] scores / probabilities instead of the [L, D]
    tile, saving one fp32 pass over each tile (two for int4). Measured: with two or more groups per row
    the extra small matmuls cost more than the passes they save, so smaller groups dequantize the tile."""
    return not isinstance(store, FloatKV) and groups(store)[which] == head_dim_of(store)


class _Workspace:
    """The float K and V tile buffers (and int4's byte buffer), kept between calls: a fresh multi-MB
    buffer per call costs page faults (measured ~30% of an int4 tile's time on CPU)."""
    _cache: dict = {}

    def __init__(self, store, n_kv, tile, D, dtype, device):
        shape = (n_kv, tile, D)
        self.k = self._get("k", shape, dtype, device)
        self.v = self._get("v", shape, dtype, device)
        self.u8 = self._get("u8", (n_kv, tile, D // 2), torch.uint8, device) if isinstance(store, Int4KV) else None

    @classmethod
    def _get(cls, name, shape, dtype, device) -> torch.Tensor:
        key = (name, str(device), dtype)
        numel = math.prod(shape)
        flat = cls._cache.get(key)
        # a buffer made under torch.inference_mode cannot be written outside it: make a new one then
        stale = flat is not None and flat.is_inference() and not torch.is_inference_mode_enabled()
        if flat is None or flat.numel() < numel or stale:
            flat = cls._cache[key] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)


def _tile(store: KVStore, which: int, a: int, b: int, ws: _Workspace | None, raw: bool = False
          ) -> torch.Tensor:
    """K (which=0) or V (which=1) of positions [a, b) as a float tile (in the workspace when given).
    raw=True: codes only, as floats (int4: the row in element order, thanks to the split-halves
    layout); the caller applies scales and mins."""
    buf = None if ws is None else (ws.k, ws.v)[which]
    out = None if buf is None else buf[:, : b - a]
    if isinstance(store, FloatKV):
        x = (store.k, store.v)[which][:, a:b]
        if out is None:
            return x.float()
        return x if x.dtype == out.dtype else out.copy_(x)
    group = groups(store)[which]
    if isinstance(store, Int8KV):
        codes, scales = (store.k, store.k_scale) if which == 0 else (store.v, store.v_scale)
        if raw:
            return out.copy_(codes[:, a:b])
        return _with_sinks(dequantize_int8(codes[:, a:b], scales[:, a:b], group, out=out), store, which, a, b)
    codes, scales, mins = ((store.k, store.k_scale, store.k_min) if which == 0
                           else (store.v, store.v_scale, store.v_min))
    if not raw:
        return _with_sinks(dequantize_int4(codes[:, a:b], scales[:, a:b], mins[:, a:b], group, out=out),
                           store, which, a, b)
    c, u8 = codes[:, a:b], ws.u8[:, : b - a]
    half = c.shape[-1]
    out[..., :half].copy_(torch.bitwise_and(c, 0xF, out=u8))
    out[..., half:].copy_(torch.bitwise_right_shift(c, 4, out=u8))
    return out


def _with_sinks(x: torch.Tensor, store: KVStore, which: int, a: int, b: int) -> torch.Tensor:
    """A dequantized tile of positions [a, b) with its rows < n_sink replaced by the exact ones."""
    ns = n_sink(store)
    if a < ns:
        e = min(b, ns)
        x[:, : e - a] = (store.k_sink, store.v_sink)[which][:, a:e]
    return x


def _scores(qr, store, a, b, ws, fold, qsum) -> torch.Tensor:
    """q·k for keys [a, b) → [Hkv, R, b-a], a fresh tensor the caller may modify in place.
    fold: (K, V) scales fold into the products; a tile holding sink rows never folds (it substitutes)."""
    if not fold[0] or a < n_sink(store):
        return torch.bmm(qr, _tile(store, 0, a, b, ws).transpose(1, 2))
    k = _tile(store, 0, a, b, ws, raw=True)
    s = torch.bmm(qr, k.transpose(1, 2)).mul_(store.k_scale[:, a:b].transpose(1, 2))  # · [Hkv, 1, L]
    if qsum is not None:
        s.addcmul_(qsum, store.k_min[:, a:b].transpose(1, 2))
    return s


def _pv(p, store, a, b, ws, fold) -> torch.Tensor:
    """p [Hkv, R, L] (may be modified) @ V of keys [a, b) → [Hkv, R, D]."""
    if not fold[1] or a < n_sink(store):
        return torch.bmm(p, _tile(store, 1, a, b, ws))
    v = _tile(store, 1, a, b, ws, raw=True)
    if isinstance(store, Int4KV):
        # Σ_l p·(c·s + m) = (p·s) @ c + p @ m
        pm = torch.bmm(p, store.v_min[:, a:b].to(p.dtype))  # [Hkv, R, 1]
        return torch.bmm(p.mul_(store.v_scale[:, a:b].transpose(1, 2)), v).add_(pm)
    return torch.bmm(p.mul_(store.v_scale[:, a:b].transpose(1, 2)), v)


def _mask(s: torch.Tensor, a: int, b: int, pos0: int, t_rows: int) -> None:
    """Causal mask in place on scores s [Hkv, g·t_rows, b-a]: row t (position pos0+t) sees keys ≤ pos0+t.
    Decided on Python ints only: a tile entirely at or before pos0 needs no mask."""
    if b - 1 <= pos0:
        return
    keys = torch.arange(a, b, device=s.device)
    rows = torch.arange(pos0, pos0 + t_rows, device=s.device)
    hide = keys[None, :] > rows[:, None]  # [t_rows, L]
    n_kv, R, L = s.shape
    s.view(n_kv, R // t_rows, t_rows, L).masked_fill_(hide, _NEG)


def masked_attention(q: torch.Tensor, store: KVStore, kv_len: int, q_start: int, scale: float, window: int = 0,
                     softcap: float = 0.0, lengths: torch.Tensor | None = None,
                     q_block: int = DEFAULT_Q_BLOCK) -> torch.Tensor:
    """attention() for the layers it does not describe: a sliding window (row at position p sees keys
    (p - window, p]; 0: all) and soft-capped scores (s -> c·tanh(s / c) before the softmax; 0: off), as Gemma 2/3
    and Phi-3 attend. q [1, Hq, T, D] at positions [q_start, q_start+T) → [1, Hq, T, D] in q's dtype.

    Plain masked softmax over the keys a block of `q_block` rows can see (a window's worth in decode), dequantized
    per call: the eager model's path for these layers (the fused CPU step has its own). `lengths` (int32 [kv_len,
    q_start] on the device, a DevicePosition's): the rows' positions are read on the device and kv_len is a host
    bound, so a CUDA graph can capture the call (one token; keys [0, kv_len) masked, none sliced off)."""
    _, n_q_heads, T, D = q.shape
    n_kv = check_attention_args(q, store, kv_len)
    g = n_q_heads // n_kv
    out = torch.empty(n_kv, g, T, D, dtype=torch.float32, device=q.device)
    qf = q[0].float().reshape(n_kv, g, T, D) * scale
    for r0 in range(0, T, q_block):
        r1 = min(T, r0 + q_block)
        if lengths is None:
            hi = min(kv_len, q_start + r1)
            lo = max(0, q_start + r0 - window + 1) if window else 0
            rows = torch.arange(q_start + r0, q_start + r1, device=q.device)
        else:
            lo, hi = 0, kv_len
            rows = lengths[1].long() + torch.arange(r0, r1, device=q.device)
        k, v = dequantize_kv(store, lo, hi)
        s = torch.matmul(qf[:, :, r0:r1], k[:, None].transpose(-1, -2).float())  # [Hkv, g, t, L]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        keys = torch.arange(lo, hi, device=q.device)
        hide = keys[None, :] > rows[:, None]
        if window:
            hide |= keys[None, :] <= rows[:, None] - window
        s = s.masked_fill(hide, -math.inf)
        out[:, :, r0:r1] = torch.matmul(torch.softmax(s, dim=-1), v[:, None].float())
    return out.reshape(1, n_q_heads, T, D).to(q.dtype)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, q_start: int,
                        scale: float) -> torch.Tensor:
    """Plain float64 softmax(QK^T)V with the causal mask against the cache, K/V repeated per query
    head. For tests and benchmarks: q [1, Hq, T, D], k/v [Hkv, ≥kv_len, D] (already dequantized)."""
    _, n_q_heads, T, D = q.shape
    g = n_q_heads // k.shape[0]
    kk = k[:, :kv_len].double().repeat_interleave(g, 0)
    vv = v[:, :kv_len].double().repeat_interleave(g, 0)
    s = (q[0].double() @ kk.transpose(1, 2)) * scale
    pos = torch.arange(q_start, q_start + T, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > pos, -math.inf)
    return (torch.softmax(s, -1) @ vv)[None]
