"""Flash-decoding in Triton for CUDA: a split stage and a reduce stage, int8/int4 KV dequantized
inside the kernel, GQA rows grouped per KV head, causal against the cache for T > 1.

Split stage, one program per (KV split, KV head, block of query rows): the g·T query rows that share
KV head h form one [BLOCK_M, D] tile (row r = query head h·g + r // T, token r % T, at absolute
position q_start + r % T), so each K/V tile is read once for the whole group. The program walks its
split BLOCK_N keys at a time with the online softmax (base 2), dequantizing each K/V tile in
registers, and writes its unnormalised partial output, running max and sum. The reduce stage weights
the partials of each row by exp2(m_split - m_max) and normalises.

int4 uses the split-halves nibble layout of kv_quant: byte j of a row holds element j (low nibble) and
element j + D/2 (high nibble), so the kernel keeps q as two halves and does two half-width dots per
tile: no interleave or shuffle of the unpacked codes.

Keys and values may have their own groups (GROUP / GROUP_V). A store's exact sink rows (the first
N_SINK positions, kernels/attention.py) replace the dequantized ones in the tile that holds them: their
scores are dotted against the fp32 rows, and their probabilities go to the fp32 V rows only.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests); dispatch from attention.py uses it on CUDA only. Imports
the storages from kv_store.py, never attention.py (which imports this module on first CUDA use).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .kv_store import FloatKV, Int4KV, Int8KV, KVStore, check_attention_args, groups, n_sink, triton_supports

_FLOAT, _INT8, _INT4 = 0, 1, 2
_LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptr, s_ptr, m_ptr, h, offs_n, n_ok, offs_c, col0,
               stride_h, stride_n, stride_sh, stride_sn,
               KIND: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr, NIBBLE: tl.constexpr,
               BLOCK_N: tl.constexpr, RAW_NIBBLES: tl.constexpr):
    """One [BLOCK_N, C] tile of K or V in fp32; its C columns are elements col0.. of the row.
    RAW_NIBBLES: the int4 codes of the plane, without scale and min (the caller folds them).
    KIND float: plain load. int8: code * scale. int4: NIBBLE 0/1 picks the low/high nibble plane of
    bytes offs_c (elements offs_c / offs_c + D/2), then code * scale + min. Scales (and mins) are
    loaded once per group, [BLOCK_N, C // GROUP], and broadcast over the group's columns."""
    base = ptr + h * stride_h + offs_n[:, None] * stride_n + offs_c[None, :]
    x = tl.load(base, mask=n_ok[:, None], other=0)
    # if/else on constexprs (no early return) so the compiler only generates the branch taken.
    if RAW_NIBBLES:  # int4 codes of one plane, unscaled
        if NIBBLE == 0:
            out = (x & 0xF).to(tl.float32)
        else:
            out = (x >> 4).to(tl.float32)
    elif KIND == 0:  # a float cache, or int8 codes unscaled
        out = x.to(tl.float32)
    else:
        if KIND == 1:
            code = x.to(tl.float32)
        else:
            if NIBBLE == 0:
                code = (x & 0xF).to(tl.float32)
            else:
                code = (x >> 4).to(tl.float32)
        if GROUP >= C:  # one group spans this plane: a scale per row
            sidx = h * stride_sh + offs_n * stride_sn + col0 // GROUP
            scale = tl.load(s_ptr + sidx, mask=n_ok, other=0).to(tl.float32)[:, None]
            if KIND == 1:
                out = code * scale
            else:
                mn = tl.load(m_ptr + sidx, mask=n_ok, other=0).to(tl.float32)[:, None]
                out = code * scale + mn
        else:
            offs_g = tl.arange(0, C // GROUP)
            sidx = h * stride_sh + offs_n[:, None] * stride_sn + col0 // GROUP + offs_g[None, :]
            scale = tl.load(s_ptr + sidx, mask=n_ok[:, None], other=0).to(tl.float32)
            code3 = tl.reshape(code, [BLOCK_N, C // GROUP, GROUP])
            if KIND == 1:
                out3 = code3 * scale[:, :, None]
            else:
                mn = tl.load(m_ptr + sidx, mask=n_ok[:, None], other=0).to(tl.float32)
                out3 = code3 * scale[:, :, None] + mn[:, :, None]
            out = tl.reshape(out3, [BLOCK_N, C])
    return out


@triton.jit
def _row_vec(ptr, h, offs_n, n_ok, gidx, stride_sh, stride_sn):
    """The scale (or min) of group gidx for each key: [BLOCK_N] fp32."""
    return tl.load(ptr + h * stride_sh + offs_n * stride_sn + gidx, mask=n_ok, other=0).to(tl.float32)


@triton.jit
def _plane_scores(q, qsum, K, KS, KM, h, offs_n, n_ok, offs_c, col0,
                  stride_kh, stride_kn, stride_sh, stride_sn,
                  KIND: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr, NIBBLE: tl.constexpr,
                  FOLD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """q [BLOCK_M, C] · (one plane of K)^T → [BLOCK_M, BLOCK_N] fp32.
    FOLD (one scale per key over the whole plane): dot the raw codes, then scale the columns of the
    product, q·(c·s + m) = s·(q·c) + m·Σq, instead of dequantizing every element of the tile."""
    if FOLD:
        code = _load_tile(K, K, K, h, offs_n, n_ok, offs_c, col0, stride_kh, stride_kn, 0, 0,
                          0, C, GROUP, NIBBLE, BLOCK_N, KIND == 2)
        s = tl.dot(q, tl.trans(code.to(q.dtype)), input_precision=PRECISION)
        s = s * _row_vec(KS, h, offs_n, n_ok, col0 // GROUP, stride_sh, stride_sn)[None, :]
        if KIND == 2:
            s += qsum[:, None] * _row_vec(KM, h, offs_n, n_ok, col0 // GROUP, stride_sh, stride_sn)[None, :]
    else:
        k = _load_tile(K, KS, KM, h, offs_n, n_ok, offs_c, col0, stride_kh, stride_kn, stride_sh, stride_sn,
                       KIND, C, GROUP, NIBBLE, BLOCK_N, False)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    return s


@triton.jit
def _plane_pv(p, V, VS, VM, h, offs_n, n_ok, offs_c, col0,
              stride_kh, stride_kn, stride_sh, stride_sn,
              KIND: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr, NIBBLE: tl.constexpr,
              FOLD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr):
    """p [BLOCK_M, BLOCK_N] fp32 @ one plane of V → [BLOCK_M, C] fp32.
    FOLD: Σ p·(c·s + m) = (p·s) @ c + Σ p·m."""
    if FOLD:
        code = _load_tile(V, V, V, h, offs_n, n_ok, offs_c, col0, stride_kh, stride_kn, 0, 0,
                          0, C, GROUP, NIBBLE, BLOCK_N, KIND == 2)
        ps = p * _row_vec(VS, h, offs_n, n_ok, col0 // GROUP, stride_sh, stride_sn)[None, :]
        o = tl.dot(ps.to(DT), code.to(DT), input_precision=PRECISION)
        if KIND == 2:
            vm = _row_vec(VM, h, offs_n, n_ok, col0 // GROUP, stride_sh, stride_sn)
            o += tl.sum(p * vm[None, :], 1)[:, None]
    else:
        v = _load_tile(V, VS, VM, h, offs_n, n_ok, offs_c, col0, stride_kh, stride_kn, stride_sh, stride_sn,
                       KIND, C, GROUP, NIBBLE, BLOCK_N, False)
        o = tl.dot(p.to(DT), v.to(DT), input_precision=PRECISION)
    return o


@triton.jit
def _sink_plane(SINK, h, offs_n, offs_c, col0, stride_zh, D: tl.constexpr, N_SINK: tl.constexpr):
    """Columns col0.. of the exact sink rows for keys offs_n (zero past the sinks): [BLOCK_N, C] fp32."""
    ptr = SINK + h * stride_zh + offs_n[:, None] * D + col0 + offs_c[None, :]
    return tl.load(ptr, mask=(offs_n < N_SINK)[:, None], other=0.0)


@triton.jit(do_not_specialize=["n_keys", "q_start", "split_len"])
def _split_kernel(Q, K, KS, KM, V, VS, VM, KSINK, VSINK, O_part, M_part, L_part, LENS,
                  stride_qh, stride_qr,
                  stride_kh, stride_kn, stride_sh, stride_sn, stride_vsh, stride_vsn, stride_zh,
                  n_keys, q_start, T, R, split_len, n_kv, qk_scale,
                  KIND: tl.constexpr, D: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_V: tl.constexpr, FOLD: tl.constexpr, FOLD_V: tl.constexpr, N_SINK: tl.constexpr,
                  DEVICE_LENS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    pid_s = tl.program_id(0)
    h = tl.program_id(1)
    pid_m = tl.program_id(2)
    if DEVICE_LENS:  # (kv_len, q_start) read on the device: one CUDA graph serves every step
        kv_len = tl.load(LENS)
        q_start = tl.load(LENS + 1)
        n_keys = tl.minimum(kv_len, q_start + T)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    q_pos = q_start + rows % T  # absolute position of each query row
    start = pid_s * split_len
    end = tl.minimum(start + split_len, n_keys)

    # C = D, or D/2 for int4: the columns of one nibble plane (q is loaded as two halves).
    offs_c = tl.arange(0, C)
    q_ptr = Q + h * stride_qh + rows[:, None] * stride_qr + offs_c[None, :]
    q0 = tl.load(q_ptr, mask=row_ok[:, None], other=0)
    qsum0 = tl.sum(q0.to(tl.float32), 1)
    if KIND == 2:
        q1 = tl.load(q_ptr + C, mask=row_ok[:, None], other=0)
        qsum1 = tl.sum(q1.to(tl.float32), 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, C], tl.float32)
    if KIND == 2:
        acc1 = tl.zeros([BLOCK_M, C], tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        s = _plane_scores(q0, qsum0, K, KS, KM, h, offs_n, n_ok, offs_c, 0, stride_kh, stride_kn,
                          stride_sh, stride_sn, KIND, C, GROUP, 0, FOLD, BLOCK_N, PRECISION)
        if KIND == 2:
            s += _plane_scores(q1, qsum1, K, KS, KM, h, offs_n, n_ok, offs_c, C, stride_kh, stride_kn,
                               stride_sh, stride_sn, KIND, C, GROUP, 1, FOLD, BLOCK_N, PRECISION)
        if N_SINK > 0:  # the first keys are read from the exact sink rows instead
            if n0 < N_SINK:
                ss = tl.dot(q0, tl.trans(_sink_plane(KSINK, h, offs_n, offs_c, 0, stride_zh, D, N_SINK).to(q0.dtype)),
                            input_precision=PRECISION)
                if KIND == 2:
                    ss += tl.dot(q1, tl.trans(_sink_plane(KSINK, h, offs_n, offs_c, C, stride_zh, D,
                                                          N_SINK).to(q1.dtype)), input_precision=PRECISION)
                s = tl.where((offs_n < N_SINK)[None, :], ss, s)
        s = s * qk_scale
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; subtract 0 instead so exp2 sees -inf, not nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc0 = acc0 * alpha[:, None]
        if KIND == 2:
            acc1 = acc1 * alpha[:, None]
        if N_SINK > 0:
            if n0 < N_SINK:  # sink columns: p times the exact rows; the quantized rows get weight 0
                is_sink = (offs_n < N_SINK)[None, :]
                ps = tl.where(is_sink, p, 0.0).to(q0.dtype)
                acc0 += tl.dot(ps, _sink_plane(VSINK, h, offs_n, offs_c, 0, stride_zh, D, N_SINK).to(q0.dtype),
                               input_precision=PRECISION)
                if KIND == 2:
                    acc1 += tl.dot(ps, _sink_plane(VSINK, h, offs_n, offs_c, C, stride_zh, D, N_SINK).to(q0.dtype),
                                   input_precision=PRECISION)
                p = tl.where(is_sink, 0.0, p)
        acc0 += _plane_pv(p, V, VS, VM, h, offs_n, n_ok, offs_c, 0, stride_kh, stride_kn, stride_vsh, stride_vsn,
                          KIND, C, GROUP_V, 0, FOLD_V, BLOCK_N, PRECISION, q0.dtype)
        if KIND == 2:
            acc1 += _plane_pv(p, V, VS, VM, h, offs_n, n_ok, offs_c, C, stride_kh, stride_kn, stride_vsh,
                              stride_vsn, KIND, C, GROUP_V, 1, FOLD_V, BLOCK_N, PRECISION, q0.dtype)
        m_i = m_new

    part = (pid_s * n_kv + h) * R + rows  # [n_splits, Hkv, R] layout
    tl.store(M_part + part, m_i, mask=row_ok)
    tl.store(L_part + part, l_i, mask=row_ok)
    o_ptr = O_part + part[:, None] * D + offs_c[None, :]
    tl.store(o_ptr, acc0, mask=row_ok[:, None])
    if KIND == 2:
        tl.store(o_ptr + C, acc1, mask=row_ok[:, None])


@triton.jit
def _reduce_kernel(O_part, M_part, L_part, Out, n_splits, n_kv, R,
                   D: tl.constexpr, BLOCK_S: tl.constexpr):
    h = tl.program_id(0)
    r = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    part = (offs_s * n_kv + h) * R + r
    m = tl.load(M_part + part, mask=s_ok, other=float("-inf"))
    l = tl.load(L_part + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)  # finite: key 0 is visible to every row
    w = tl.exp2(m - m_max)  # splits that saw no visible key (m = -inf) weigh exactly 0
    offs_d = tl.arange(0, D)
    o = tl.load(O_part + part[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(Out + (h * R + r) * D + offs_d, out.to(Out.dtype.element_ty))


def _config(kind: int, dot_dtype: torch.dtype, device: torch.device) -> dict:
    """Launch parameters. fp32 tiles (fp32 caches) need fewer pipeline stages to fit shared memory at
    D=128. The CPU interpreter runs each loop iteration in Python: longer tiles keep tests fast."""
    cfg = dict(CONFIG["float" if kind == _FLOAT else "quantized"])
    if dot_dtype == torch.float32:
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    if device.type != "cuda":
        cfg["block_n"] = 64
    return cfg


# Measured on an H100 with CUDA-graph replays (benchmarks/attention.py --tune, Hq 32, Hkv 8, D 128,
# kv 4k and 32k): within ~5% of the best of 36 configurations for every kind. Quantized tiles prefer
# short BLOCK_N and more splits (the dequant math, not bandwidth, limits one program).
# waves: splits are planned to give about waves × (number of SMs) programs.
CONFIG = {"float": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2},
          "quantized": {"block_n": 32, "num_warps": 4, "num_stages": 2, "waves": 4}}


@functools.lru_cache(maxsize=None)
def _n_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so the reduce is exercised


def _plan(n: int, n_programs_other: int, block_n: int, waves: float, device: torch.device) -> int:
    """Positions per split: enough splits to fill `waves` waves of the SMs, each at least one BLOCK_N."""
    want = max(1, int(waves * _n_sms(device)) // max(1, n_programs_other))
    n_splits = min(triton.cdiv(n, block_n), want)
    return triton.cdiv(triton.cdiv(n, n_splits), block_n) * block_n


def triton_attention(q: torch.Tensor, store: KVStore, kv_len: int, q_start: int, scale: float, *,
                     split: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, waves: float | None = None,
                     lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as attention.attention: q [1, Hq, T, D] → [1, Hq, T, D] in q's dtype.

    lengths: for CUDA graphs, an int32 device tensor [kv_len, q_start] read by the kernel, so one
    captured graph serves every decode step; the launch grid then covers keys [0, kv_len) of the
    *arguments*, which must bound the device-side kv_len (e.g. max_seq_len, or a captured bucket).
    Splits past the device-side length write an empty partial that the reduce weighs 0.
    split: KV positions per split (None: planned from the SM count); block_n / num_warps /
    num_stages / waves: launch parameters (None: the defaults measured on an H100, see CONFIG)."""
    _, n_q_heads, T, D = q.shape
    n_kv = check_attention_args(q, store, kv_len)
    if not triton_supports(store, D):
        need = 32 if isinstance(store, Int4KV) else 16
        raise ValueError(f"the Triton kernel needs a power-of-two head dim ≥ {need} for this cache, got {D}")
    g = n_q_heads // n_kv
    R = g * T
    n = kv_len if lengths is not None else min(kv_len, q_start + T)

    ksink = vsink = None
    if isinstance(store, FloatKV):
        kind, group, group_v, dot_dtype = _FLOAT, D, D, store.k.dtype
        ks = km = vs = vm = store.k  # unused pointers
        stride_sh = stride_sn = 0
    elif isinstance(store, (Int8KV, Int4KV)):
        kind = _INT8 if isinstance(store, Int8KV) else _INT4
        (group, group_v), dot_dtype = groups(store), torch.float32 if q.dtype == torch.float32 else q.dtype
        ks, vs = store.k_scale, store.v_scale
        km, vm = (ks, vs) if kind == _INT8 else (store.k_min, store.v_min)
        stride_sh, stride_sn = ks.stride(0), ks.stride(1)
        if n_sink(store):
            ksink, vsink = store.k_sink, store.v_sink
            if not (ksink.is_contiguous() and vsink.is_contiguous() and ksink.stride() == vsink.stride()):
                raise ValueError("the sink rows must be contiguous, K's and V's alike")
    else:
        raise TypeError(f"unknown KV storage {type(store).__name__}")
    for t in (store.k, store.v, ks, km, vs, vm):
        if t.stride(-1) != 1:
            raise ValueError("KV storage tensors must be contiguous along the last dim")
    if store.v.stride() != store.k.stride():
        raise ValueError("K and V storages must share strides")

    if lengths is not None and (lengths.dtype != torch.int32 or lengths.numel() != 2
                                or lengths.device != q.device):
        raise ValueError("lengths must be an int32 tensor [kv_len, q_start] on q's device")
    C = D // 2 if kind == _INT4 else D  # columns of one nibble plane
    # [Hkv, R, D]: the g query heads of KV head h, then tokens, one row each (small copy).
    qr = q[0].to(dot_dtype).reshape(n_kv, R, D).contiguous()
    cfg = _config(kind, dot_dtype, q.device)
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    block_m = max(16, min(64, triton.next_power_of_2(R)))
    n_mblocks = triton.cdiv(R, block_m)
    if split is None:
        split = _plan(n, n_kv * n_mblocks, block_n, waves or cfg["waves"], q.device)
    n_splits = triton.cdiv(n, split)

    o_part = torch.empty(n_splits, n_kv, R, D, dtype=torch.float32, device=q.device)
    m_part = torch.empty(n_splits, n_kv, R, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    out = torch.empty(n_kv, R, D, dtype=q.dtype, device=q.device)
    precision = "ieee" if dot_dtype == torch.float32 else "tf32"
    _split_kernel[(n_splits, n_kv, n_mblocks)](
        qr, store.k, ks, km, store.v, vs, vm, ksink if ksink is not None else m_part,
        vsink if vsink is not None else m_part, o_part, m_part, l_part, m_part if lengths is None else lengths,
        qr.stride(0), qr.stride(1),
        store.k.stride(0), store.k.stride(1), stride_sh, stride_sn,
        *((vs.stride(0), vs.stride(1)) if kind != _FLOAT else (0, 0)),
        0 if ksink is None else ksink.stride(0),
        n, q_start, T, R, split, n_kv, scale * _LOG2E,
        KIND=kind, D=D, C=C, GROUP=group, GROUP_V=group_v, FOLD=kind != _FLOAT and group >= C,
        FOLD_V=kind != _FLOAT and group_v >= C, N_SINK=0 if ksink is None else ksink.shape[1] - 1,
        DEVICE_LENS=lengths is not None, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    _reduce_kernel[(n_kv, R)](o_part, m_part, l_part, out, n_splits, n_kv, R,
                              D=D, BLOCK_S=max(2, triton.next_power_of_2(n_splits)))
    return out.view(1, n_q_heads, T, D)
