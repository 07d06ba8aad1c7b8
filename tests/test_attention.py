"""The torch attention path and the KV quantization math, against a float64 softmax(QK^T)V."""
import pytest
import torch

from edgellm.kernels import attention as A
from edgellm.kernels.attention import FloatKV, Int4KV, Int8KV, attention, attention_torch, dequantize_kv, write_kv
from edgellm.kernels.kv_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from edgellm.torch_import import load_meta_kernels

# int8s4: per-token int8 with 4 exact sink rows; int4k16s4: the cache's default int4 (keys in groups of 16,
# values 32, 4 sink rows)
KINDS = ["fp32", "int8", "int8g32", "int4", "int4g32", "int8s4", "int4k16s4"]


def make_store(kind: str, n_kv: int, S: int, D: int, scale_dtype=torch.float32):
    if kind == "fp32":
        return FloatKV.empty(n_kv, S, D)
    if kind in ("bf16", "fp16"):
        return FloatKV.empty(n_kv, S, D, getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[kind]))
    if kind == "int8s4":
        return Int8KV.empty(n_kv, S, D, None, scale_dtype, n_sink=4)
    if kind == "int4k16s4":
        return Int4KV.empty(n_kv, S, D, 32, scale_dtype, k_group=16, n_sink=4)
    group = 32 if kind.endswith("g32") else D
    if kind.startswith("int8"):
        return Int8KV.empty(n_kv, S, D, group, scale_dtype)
    return Int4KV.empty(n_kv, S, D, group, scale_dtype)


@pytest.mark.parametrize("kind", ["int8s4", "int4k16s4"])
def test_sink_rows_exact_and_device_position_writes(kind):
    """Positions < n_sink read back exactly (the rest quantized); a write at a device-held position
    fills the same rows as a write at a host position, and past the sinks it touches only the spare row."""
    n_kv, S, D = 2, 12, 64
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(n_kv, 10, D, generator=gen) * 3, torch.randn(n_kv, 10, D, generator=gen)
    store = make_store(kind, n_kv, S, D)
    write_kv(store, k, v, 0)
    kd, vd = dequantize_kv(store, 0, 10)
    assert torch.equal(kd[:, :4], k[:, :4]) and torch.equal(vd[:, :4], v[:, :4])
    assert not torch.equal(kd[:, 4:], k[:, 4:]) and (kd[:, 4:] - k[:, 4:]).abs().max() < 0.1 * k.abs().max()
    twin = make_store(kind, n_kv, S, D)
    for p in range(10):
        A.write_kv_at(twin, k[:, p:p + 1], v[:, p:p + 1], torch.tensor([p]))
    for x, y in zip(store, twin):
        if isinstance(x, torch.Tensor) and x.shape[1] == S:
            assert torch.equal(x, y)
    assert torch.equal(twin.k_sink[:, :4], store.k_sink[:, :4]) and torch.equal(twin.k_sink[:, 4], k[:, 9])


def poison_tail(store, n: int) -> None:
    """NaN (float) or NaN scales (quantized) at positions ≥ n: a kernel that reads past kv_len fails."""
    if isinstance(store, FloatKV):
        store.k[:, n:] = float("nan")
        store.v[:, n:] = float("nan")
    else:
        for t in store:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[1] == store.k.shape[1]:
                t[:, n:] = float("nan")


def reference(q, k, v, q_start: int, scale: float):
    """float64 softmax(QK^T)V; q [1, Hq, T, D], k/v [Hkv, n, D]; row i sees keys ≤ q_start + i."""
    n_q, T = q.shape[1], q.shape[2]
    n = k.shape[1]
    g = n_q // k.shape[0]
    out = torch.empty(n_q, T, q.shape[3], dtype=torch.float64)
    for h in range(n_q):
        kh, vh = k[h // g].double(), v[h // g].double()
        for i in range(T):
            last = min(n, q_start + i + 1)
            w = torch.softmax((kh[:last] @ q[0, h, i].double()) * scale, 0)
            out[h, i] = w @ vh[:last]
    return out[None]


def filled(kind, n_kv, n, D, S=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_kv, n, D, generator=gen)
    v = torch.randn(n_kv, n, D, generator=gen)
    store = make_store(kind, n_kv, S or n + 7, D)
    poison_tail(store, n)
    write_kv(store, k, v, 0)
    return store, k, v


def amx_attention(D: int) -> bool:
    """Whether a CPU prefill with head dim D takes the causal kernel's AMX path here (bf16 hi + lo operands: ~2^-16
    relative, where the fp32 path is ~2^-23; the fp16 cache itself rounds to 2^-11)."""
    from edgellm.kernels import matmul

    ext = matmul.cpu_extension()
    return A.AMX_ATTENTION and D % 32 == 0 and ext is not None and ext.flash_causal_fast() and matmul.amx_kernels(ext)


def check(kind, g, D, n, T, split, n_kv=2, q_block=A.DEFAULT_Q_BLOCK, tol=1e-5):
    if T > 1 and amx_attention(D):
        tol = max(tol, 5e-5)
    store, k, v = filled(kind, n_kv, n, D, seed=n + 7 * g + D + T)
    q_start = n - T
    q = torch.randn(1, n_kv * g, T, D, generator=torch.Generator().manual_seed(1)) * 1.5
    scale = D ** -0.5
    out = attention_torch(q, store, n, q_start, scale, split=split, q_block=q_block)
    assert out.shape == q.shape and out.dtype == q.dtype
    kd, vd = dequantize_kv(store, 0, n)
    if kind == "fp32":
        assert torch.equal(kd, k)  # the reference below is then the unquantized one
    ref = reference(q, kd, vd, q_start, scale)
    err = (out.double() - ref).abs().max().item()
    assert err < tol, f"{kind} g={g} D={D} n={n} T={T} split={split}: max err {err:.2e}"


SPLIT = 64


# KV lengths around the split boundary, every GQA ratio, both head dims, decode and verification.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,T", [(n, T) for n in (1, SPLIT - 1, SPLIT, SPLIT + 1, 3 * SPLIT + 5)
                                  for T in (1, 6) if T <= n])
@pytest.mark.parametrize("g", [1, 3, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_split_boundaries(kind, n, T, g, D):
    check(kind, g, D, n, T, split=SPLIT)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("g,D", [(3, 64), (8, 128)])
def test_4k_default_split(kind, T, g, D):
    check(kind, g, D, 4096, T, split=None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 6])
def test_4k_many_splits(kind, T):
    check(kind, 3, 64, 4096, T, split=1000)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 6])
def test_32k(kind, T):
    # Small heads keep it cheap; default split (several tiles for quantized kinds). fp32 rounding of sums
    # over n keys grows like sqrt(n): the 4k tolerance scaled by sqrt(32k / 4k).
    check(kind, 3, 64, 32768, T, split=None, n_kv=1, tol=1e-5 * 8 ** 0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunk_on_kept_prefix(kind):
    # T=300 new tokens on a 500-token prefix, in query blocks of 128 and KV tiles of 256 (quantized kinds on
    # CPU: torch's fused flash kernel per tile, A._flash_rows, from A.FLASH_MIN_ROWS query rows).
    check(kind, 3, 64, 800, 300, split=256, q_block=128)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g,D", [(3, 64), (2, 128)])
def test_prefill_from_position_zero(kind, g, D):
    # A whole 300-token prompt in tiles of 64: the first rows see nothing of the later tiles (the flash
    # path's fully masked rows, weighed out by their log-sum-exp); 37 rows: just over FLASH_MIN_ROWS.
    check(kind, g, D, 300, 300, split=64, q_block=128)
    check(kind, g, D, 37, 37, split=16)


def test_flash_rows_are_used_for_quantized_prefill(monkeypatch):
    """The fused-kernel path is what a quantized CPU cache's prefill takes where this torch has the kernel."""
    if A._cpu_flash_kernel() is None:
        pytest.skip("this torch has no aten._scaled_dot_product_flash_attention_for_cpu: the bmm tiles serve")
    calls = []
    real = A._flash_rows
    monkeypatch.setattr(A, "_flash_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    check("int4", 3, 64, 100, 40, split=32)
    assert calls


def causal_kernel():
    from edgellm.kernels import matmul

    ext = matmul.cpu_extension()
    if ext is None or not ext.flash_causal_fast():
        pytest.skip("no AVX2 build of the CPU kernels here: prefills use torch's flash kernel")
    return ext


def _check_causal_against_float64(ext, T: int, D: int, g: int, pos0: int, seed: int, amx: bool, tol: float) -> None:
    """flash_causal (amx or not) on random q / k / v against the float64 softmax attention: outputs and lse within
    `tol`."""
    gen = torch.Generator().manual_seed(seed)
    n_kv, L = 2, pos0 + T
    # a cache's slice, read in place: rows of D contiguous, heads a cache length apart
    cache_k, cache_v = torch.randn(2, n_kv, L + 9, D, generator=gen)
    k, v = cache_k[:, :L], cache_v[:, :L]
    q = torch.randn(n_kv * g, T, D, generator=gen) * 2 * D ** -0.5  # scaled as the caller scales it
    out, lse = ext.flash_causal(q, k, v, pos0, amx)
    s = q.double() @ k.double().repeat_interleave(g, 0).transpose(1, 2)
    s.masked_fill_(torch.ones(T, L, dtype=torch.bool).triu_(pos0 + 1), float("-inf"))
    ref = torch.softmax(s, -1) @ v.double().repeat_interleave(g, 0)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert (out.double() - ref).abs().max().item() < tol
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < tol


# Rows around the kernel's blocks (32 query rows, 64 keys), every head dim it takes, GQA and not, from position 0
# and after a prefix (the rows at positions pos0.., keys [0, pos0 + T)).
@pytest.mark.parametrize("T", [1, 5, 31, 32, 33, 63, 64, 65, 100, 200])
@pytest.mark.parametrize("D,g", [(16, 1), (64, 3), (128, 2), (256, 4)])
@pytest.mark.parametrize("pos0", [0, 1, 70, 512])
def test_causal_kernel_against_float64(T, D, g, pos0):
    _check_causal_against_float64(causal_kernel(), T, D, g, pos0, T * 31 + D + g + pos0, amx=False, tol=1e-5)


@pytest.mark.parametrize("T", [1, 31, 33, 64, 65, 200])
@pytest.mark.parametrize("D,g", [(16, 1), (64, 3), (96, 1), (128, 2), (256, 4)])
@pytest.mark.parametrize("pos0", [0, 70, 512])
def test_causal_kernel_on_amx_against_float64(T, D, g, pos0):
    """amx=True (Q K^T and P V on AMX tiles, each operand as bf16 hi + lo parts, fp32 sums): fp32-level agreement
    with the float64 reference; head dims not a multiple of 32 (16) take the fp32 path."""
    from edgellm.kernels import matmul

    ext = causal_kernel()
    if not matmul.amx_kernels(ext):
        with pytest.raises(RuntimeError, match="no AMX here"):
            ext.flash_causal(torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 4, 64), 0, True)
        pytest.skip(f"no AMX on this CPU ({ext.isa()} build): the check above is what runs here")
    _check_causal_against_float64(ext, T, D, g, pos0, T * 37 + D + g + pos0, amx=True, tol=5e-5)


def test_causal_kernel_rejects_what_it_does_not_take():
    ext = causal_kernel()
    q = torch.randn(4, 8, 72)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.flash_causal(q, q[:2], q[:2])
    with pytest.raises(RuntimeError, match="Hkv dividing Hq"):
        ext.flash_causal(q[..., :64], q[:3, :, :64], q[:3, :, :64])
    with pytest.raises(RuntimeError, match="pos0"):
        ext.flash_causal(q[..., :64], q[:2, :, :64], q[:2, :, :64], 3)  # keys: 8 rows, not 3 + 8
    with pytest.raises(RuntimeError, match="fp32"):
        ext.flash_causal(q[..., :64].double(), q[:2, :, :64].double(), q[:2, :, :64].double())


@pytest.mark.parametrize("kind", ["fp32", "int8", "int4k16s4"])
def test_prefill_takes_the_causal_kernel(monkeypatch, kind):
    """A CPU prefill goes through kernels/cpu_attention.cpp where it is built (an fp32 cache: prefix and own keys in
    one call; int8 / int4: the own keys, the prefix's tiles through torch's kernel), once per call, and the result is
    the reference's; a head dim it does not take (72) falls back to torch's kernel, as right."""
    ext = causal_kernel()
    if A._cpu_flash_kernel() is None:
        pytest.skip("this torch has no aten._scaled_dot_product_flash_attention_for_cpu: the bmm tiles serve")
    calls = []
    real = ext.flash_causal

    class Counting:
        def __getattr__(self, name):
            return getattr(ext, name)

        def flash_causal(self, *a, **kw):
            calls.append(a[0].shape)
            return real(*a, **kw)

    from edgellm.kernels import matmul
    monkeypatch.setattr(matmul, "cpu_extension", lambda: Counting())
    check(kind, 3, 64, 300, 200, split=64)  # a 100-token prefix, then 200 rows
    assert calls == [(2 * 3, 200, 64)]
    if kind != "int4k16s4":  # (its groups of 16 and 32 values need a head dim that the kernel takes)
        check(kind, 2, 72, 100, 100, split=64)
        assert len(calls) == 1


@pytest.mark.parametrize("n", [5, 300, 2000])
def test_float_short_path_matches(n):
    # T=1 on a short float cache goes to SDPA (SDPA_MAX_LEN); longer to the matmul path.
    check("fp32", 3, 64, n, 1, split=None)


def test_q_start_without_full_kv_len():
    # kv_len larger than q_start+T: keys beyond each row's position stay masked.
    store, k, v = filled("int8", 2, 100, 64)
    q = torch.randn(1, 6, 4, 64)
    out = attention_torch(q, store, 100, 50, 0.125, split=32)
    kd, vd = dequantize_kv(store, 0, 100)
    assert (out.double() - reference(q, kd[:, :54], vd[:, :54], 50, 0.125)).abs().max() < 1e-5


def test_bf16_cache_and_queries():
    store, k, v = filled("bf16", 2, 300, 64)
    q = torch.randn(1, 6, 3, 64).bfloat16()
    out = attention_torch(q, store, 300, 297, 0.125, split=128)
    assert out.dtype == torch.bfloat16
    ref = reference(q, store.k[:, :300], store.v[:, :300], 297, 0.125)
    assert (out.double() - ref).abs().max() < 2e-2


def test_dispatch_on_cpu_is_the_torch_path():
    store, _, _ = filled("int4g32", 3, 500, 64)
    q = torch.randn(1, 9, 1, 64)
    assert torch.equal(attention(q, store, 500, 499, 0.125), attention_torch(q, store, 500, 499, 0.125))


def test_non_contiguous_query_layout():
    # The model builds q as a transpose of [1, T, H, D]: the kernel must not assume [H, T, D] memory.
    store, k, v = filled("fp32", 2, 200, 64)
    q = torch.randn(1, 5, 6, 64).transpose(1, 2)
    out = attention_torch(q, store, 200, 195, 0.125, split=64)
    assert (out.double() - reference(q, k, v, 195, 0.125)).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------------
# Quantization error against the unquantized reference: explicit bounds
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,bound", [("int8", 0.03), ("int8g32", 0.03), ("int4g32", 0.3), ("int4", 0.3)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_quantization_error_bounded(kind, bound, scale_dtype):
    n_kv, g, D, n, T = 2, 3, 64, 512, 6
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(n_kv, n, D, generator=gen), torch.randn(n_kv, n, D, generator=gen)
    q = torch.randn(1, n_kv * g, T, D, generator=gen) * 2  # peaky attention, as in trained models
    store = make_store(kind, n_kv, n, D, scale_dtype)
    write_kv(store, k, v, 0)
    out = attention_torch(q, store, n, n - T, D ** -0.5).double()
    ref = reference(q, k, v, n - T, D ** -0.5)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < bound, f"{kind}: relative error {rel:.3f} ≥ {bound}"
    assert rel > 1e-4  # the storage really is quantized


def test_quantize_int8_error_is_half_a_step():
    x = torch.randn(3, 17, 64) * torch.logspace(-3, 2, 64)  # channels of very different magnitude
    for group in (64, 32):
        codes, scales = quantize_int8(x, group)
        assert codes.dtype == torch.int8 and scales.shape == (3, 17, 64 // group)
        assert codes.abs().max() <= 127
        err = (dequantize_int8(codes, scales, group) - x).abs()
        step = scales.repeat_interleave(group, -1)
        assert (err <= step / 2 * (1 + 1e-6)).all()
        assert codes.abs().amax(-1).max() == 127  # the largest element of a group uses the full range


def test_quantize_int4_error_is_half_a_step():
    x = torch.randn(2, 9, 64) + torch.linspace(-5, 5, 64)  # offsets: asymmetric ranges
    for group in (64, 32):
        packed, scales, mins = quantize_int4(x, group)
        assert packed.dtype == torch.uint8 and packed.shape == (2, 9, 32)
        assert scales.shape == mins.shape == (2, 9, 64 // group)
        err = (dequantize_int4(packed, scales, mins, group) - x).abs()
        assert (err <= scales.repeat_interleave(group, -1) / 2 * (1 + 1e-5) + 1e-6).all()


def test_zero_groups_quantize_to_zero():
    x = torch.zeros(1, 2, 64)
    c, s = quantize_int8(x, 32)
    assert (c == 0).all() and torch.isfinite(s).all()
    assert (dequantize_int8(c, s, 32) == 0).all()
    p, s, m = quantize_int4(x, 32)
    assert torch.isfinite(s).all() and (dequantize_int4(p, s, m, 32) == 0).all()


# ---------------------------------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS + ["bf16"])
def test_write_kv_round_trip(kind):
    n_kv, D, S = 2, 64, 40
    k, v = torch.randn(n_kv, 30, D), torch.randn(n_kv, 30, D)
    store = make_store(kind, n_kv, S, D)
    # prefill 12, decode 1, verify 6, prefill 11: as the engine writes
    for a, b in ((0, 12), (12, 13), (13, 19), (19, 30)):
        write_kv(store, k[:, a:b], v[:, a:b], a)
    kd, vd = dequantize_kv(store, 0, 30)
    if kind == "fp32":
        assert torch.equal(kd, k) and torch.equal(vd, v)
    elif kind == "bf16":
        assert torch.equal(kd, k.bfloat16().float())
    else:
        # chunked writes equal one whole write: quantization is per token
        whole = make_store(kind, n_kv, S, D)
        write_kv(whole, k, v, 0)
        for x, y in zip(dequantize_kv(whole, 0, 30), (kd, vd)):
            assert torch.equal(x, y)
        tol = 0.02 if kind.startswith("int8") else 0.35
        assert (kd - k).abs().max() < tol * k.abs().max()
    for t in store:  # positions past the write are untouched
        if isinstance(t, torch.Tensor):
            assert (t[:, 30:] == 0).all()


def test_write_kv_overwrites_after_truncate():
    store = make_store("int4g32", 1, 8, 64)
    write_kv(store, torch.randn(1, 8, 64), torch.randn(1, 8, 64), 0)
    k2, v2 = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    write_kv(store, k2, v2, 4)  # speculative rollback to 4, then 3 new tokens
    fresh = make_store("int4g32", 1, 3, 64)
    write_kv(fresh, k2, v2, 0)
    assert torch.equal(dequantize_kv(store, 4, 7)[0], dequantize_kv(fresh, 0, 3)[0])


def test_write_kv_past_the_end_raises():
    with pytest.raises(ValueError, match="do not fit"):
        write_kv(make_store("int8", 1, 8, 64), torch.randn(1, 3, 64), torch.randn(1, 3, 64), 6)


def test_bytes_per_token():
    D, n_kv = 64, 3
    assert make_store("fp32", n_kv, 8, D).bytes_per_token == 2 * n_kv * D * 4
    assert Int8KV.empty(n_kv, 8, D).bytes_per_token == 2 * n_kv * (D + 4)
    assert Int8KV.empty(n_kv, 8, D, 32, torch.float16).bytes_per_token == 2 * n_kv * (D + 2 * 2)
    assert Int4KV.empty(n_kv, 8, D, 32, torch.float16).bytes_per_token == 2 * n_kv * (D // 2 + 2 * 2 * 2)


# ---------------------------------------------------------------------------------------------------
# Implementation properties
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_no_data_dependent_host_logic(kind):
    """On the meta device no value exists: .item(), bool(tensor) or value-dependent shapes would raise.
    So the path neither syncs with the device nor branches on tensor values. (Running it there takes torch's Python
    meta kernels, which the suite imports torch without: edgellm/torch_import.py.)"""
    load_meta_kernels()
    store = make_store(kind, 2, 4096, 64)
    store = type(store)(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in store))
    write_kv(store, torch.randn(2, 6, 64, device="meta"), torch.randn(2, 6, 64, device="meta"), 3000)
    for T, split in ((1, 1024), (6, 1024), (6, None), (300, 512)):
        q = torch.randn(1, 6, T, 64, device="meta")
        out = attention_torch(q, store, 3006, 3006 - T, 0.125, split=split)
        assert out.shape == q.shape and out.device.type == "meta"


@pytest.mark.parametrize("kind", ["int8", "int4g32"])
def test_no_cache_sized_allocation(kind):
    """A quantized cache is dequantized a tile at a time: no allocation reaches the size of the fp32
    K of the whole cache."""
    from torch.profiler import ProfilerActivity, profile

    n_kv, S, D = 2, 32768, 64
    store, _, _ = filled(kind, n_kv, S, D, S=S)
    A._Workspace._cache.clear()
    q = torch.randn(1, 6, 1, D)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        attention_torch(q, store, S, S - 1, 0.125)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    whole = n_kv * S * D * 4
    assert 0 < biggest <= min(A.TILE_BYTES, whole // 2), f"an allocation of {biggest} bytes (whole fp32 K: {whole})"


def test_auto_split_is_bounded_by_memory():
    for kind in KINDS:
        for rows in (4, 8 * 300):
            split = A.auto_split(make_store(kind, 8, 16, 128), 8, rows, 128)
            assert split % 256 == 0
            assert split == 256 or split * 8 * rows * 4 <= A.TILE_BYTES  # the score matrix
            if kind != "fp32":  # the dequantized tile
                assert split == 256 or split * 8 * 128 * 4 <= A.TILE_BYTES


def test_workspace_made_in_inference_mode_serves_later_calls():
    """The reused tile buffers may first be allocated under torch.inference_mode (perplexity, bench);
    a later call outside it must still run (an inference tensor cannot be written there)."""
    A._Workspace._cache.clear()
    store, k, v = filled("int8s4", 2, 40, 64)
    q = torch.randn(1, 4, 1, 64)
    with torch.inference_mode():
        inside = attention_torch(q, store, 40, 39, 0.125)
    store2, _, _ = filled("int8s4", 2, 40, 64)
    outside = attention_torch(q, store2, 40, 39, 0.125)
    torch.testing.assert_close(inside, outside)
