"""The Triton flash-decoding kernel against a float64 reference.

By default under TRITON_INTERPRET=1 on CPU tensors at small shapes (CI, no GPU). On a CUDA machine,
`TRITON_INTERPRET=0 pytest tests/test_triton_attention.py` compiles the kernel and runs the same cases
on the GPU, plus long-context fp16 cases.
"""
import pytest
import torch

from tests.triton_mode import DEVICE, INTERPRET  # before triton is imported (sets TRITON_INTERPRET)
from edgellm.kernels.attention import dequantize_kv, write_kv  # noqa: E402
from edgellm.kernels.triton_attention import triton_attention  # noqa: E402
from tests.test_attention import make_store, poison_tail, reference  # noqa: E402


def run_case(kind, g, D, n, T, split, n_kv=2, dtype=torch.float32, tol=1e-5, q_start=None, seed=0, **launch):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n_kv, n, D, generator=gen), torch.randn(n_kv, n, D, generator=gen)
    q = torch.randn(1, n_kv * g, T, D, generator=gen) * 1.5
    store = make_store(kind, n_kv, n + 5, D)
    poison_tail(store, n)
    write_kv(store, k, v, 0)
    kd, vd = dequantize_kv(store, 0, n)
    q_start = n - T if q_start is None else q_start
    ref = reference(q.to(dtype), kd, vd, q_start, D ** -0.5)
    store = type(store)(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in store))
    out = triton_attention(q.to(DEVICE, dtype), store, n, q_start, D ** -0.5, split=split, **launch)
    assert out.shape == q.shape and out.dtype == dtype
    err = (out.cpu().double() - ref).abs().max().item()
    assert err < tol, f"{kind} g={g} D={D} n={n} T={T} split={split}: max err {err:.2e}"


from tests.test_attention import KINDS  # noqa: E402  (float, int8/int4 per token and g32, sinks, K16/V32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g,D,n,T", [
    (3, 64, 1, 1),      # a single key
    (3, 64, 65, 1),     # split + 1: two splits, the second with one key
    (8, 64, 130, 6),    # GQA 8, causal T=6 on a kept prefix, three splits
    (1, 128, 64, 6),    # head dim 128, exactly one split
])
def test_kernel_matches_reference(kind, g, D, n, T):
    run_case(kind, g, D, n, T, split=64)


@pytest.mark.parametrize("n", [63, 64, 65])
def test_split_boundaries(n):
    run_case("int4g32", 3, 64, n, 1, split=32, block_n=32)  # the CUDA default BLOCK_N of quantized kinds


def test_many_query_rows_span_row_blocks():
    # g·T = 90 rows: two BLOCK_M=64 row blocks of one KV head.
    run_case("int8g32", 3, 64, 100, 30, split=64)


def test_kv_len_beyond_the_rows():
    # kv_len = 100 but the rows sit at 50..53: keys 54.. are never visible.
    run_case("int8", 3, 64, 100, 4, split=32, q_start=50)


def test_planned_split():
    run_case("int4g32", 3, 64, 300, 1, split=None)


def test_fp16():
    run_case("fp16", 3, 64, 130, 6, split=64, dtype=torch.float16, tol=3e-3)
    run_case("int4g32", 3, 64, 130, 1, split=64, dtype=torch.float16, tol=3e-3)


@pytest.mark.skipif(INTERPRET, reason="long contexts only when compiled on a GPU")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [4096, 32768])
def test_long_context_gpu(kind, n):
    run_case("fp16" if kind == "fp32" else kind, 4, 128, n, 1, split=None, n_kv=8, dtype=torch.float16,
             tol=3e-3)
    run_case(kind, 3, 64, n, 6, split=None, n_kv=3)


@pytest.mark.skipif(INTERPRET, reason="dispatch to Triton happens on CUDA tensors only")
def test_dispatch_uses_triton_on_cuda(monkeypatch):
    from edgellm.kernels import attention as A
    from edgellm.kernels import triton_attention as TA

    called = []
    monkeypatch.setattr(TA, "triton_attention", lambda *a, **kw: called.append(1) or a[0])
    A.attention(torch.zeros(1, 3, 1, 64, device="cuda"), make_store("fp32", 1, 8, 64), 4, 3, 0.125)
    assert called


@pytest.mark.parametrize("kind,T", [("fp32", 1), ("int4g32", 6)])
def test_device_side_lengths(kind, T):
    """lengths=[kv_len, q_start] on the device: the grid covers the bound given as kv_len; the kernel
    uses the device-side values (what a captured CUDA graph replays with)."""
    n_kv, g, D, bound = 2, 3, 64, 150
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(n_kv, bound, D, generator=gen), torch.randn(n_kv, bound, D, generator=gen)
    store = make_store(kind, n_kv, bound, D)
    write_kv(store, k, v, 0)
    kd, vd = dequantize_kv(store, 0, bound)
    store = type(store)(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in store))
    q = torch.randn(1, n_kv * g, T, D, generator=gen)
    for kv_len in (T, 77, bound):
        lengths = torch.tensor([kv_len, kv_len - T], dtype=torch.int32, device=DEVICE)
        out = triton_attention(q.to(DEVICE), store, bound, 0, D ** -0.5, split=64, lengths=lengths)
        ref = reference(q, kd[:, :kv_len], vd[:, :kv_len], kv_len - T, D ** -0.5)
        assert (out.cpu().double() - ref).abs().max() < 1e-5, kv_len


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_device_lengths():
    n_kv, g, D, S = 8, 4, 128, 4096
    store = make_store("int4g32", n_kv, S, D, torch.float16)
    k, v = torch.randn(n_kv, S, D), torch.randn(n_kv, S, D)
    write_kv(store, k, v, 0)
    kd, vd = dequantize_kv(store, 0, S)
    store = type(store)(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in store))
    q = torch.randn(1, n_kv * g, 1, D, device="cuda", dtype=torch.float16)
    lengths = torch.tensor([10, 9], dtype=torch.int32, device="cuda")
    call = lambda: triton_attention(q, store, S, 0, D ** -0.5, lengths=lengths)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for kv_len in (1, 1000, S):
        lengths.copy_(torch.tensor([kv_len, kv_len - 1], dtype=torch.int32))
        graph.replay()
        ref = reference(q.cpu(), kd[:, :kv_len], vd[:, :kv_len], kv_len - 1, D ** -0.5)
        assert (out.cpu().double() - ref).abs().max() < 3e-3, kv_len
