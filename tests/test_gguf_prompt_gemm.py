"""The prompt GEMM (kernels/cpu_gguf.cpp "prompt GEMM", `ext.gguf_linear_prompt`) against an independent reference.

Reference, computed here in float64 from the inputs alone: gguf.quants.dequantize(W) times x rounded to int8 the
way the kernels document it (per 32 values: q = round_half_even(x * 127 / amax), times amax / 127), so only fp32
summation order separates the two: each output row must agree to 1e-5 of its norm. Every type, M across the
microkernel's row blocks (17, 33, 100, 512), N not a multiple of the panel width, K a multiple of 256 and (32-value
block types) not; out_index, multi-part linears; the standalone ISA builds (portable, AVX2, AVX-512 VNNI, NEON
where qemu is); and a GGUF model end to end against its `--weights fp` twin.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from edgellm.kernels import gguf_ops, matmul
from tests.test_cpu_kernels import ext, start_builds, stop_builds  # noqa: F401  (ext: the extension fixture)
from tests.test_gguf_kernels import (GRID_IQUANTS, K_QUANTS, KERNELS, L4_TYPES, TYPES, X8_ANY, X8_BUILDS,
                                     dequant_ref, make_weights)

ROW_TOL = 1e-5


def int8_x(x: np.ndarray) -> np.ndarray:
    """x rounded as the kernels round it, in float64: per 32 values amax, q = rint(x * (127 / amax)) (fp32 product,
    round half to even), x ~ q * (amax / 127)."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv)
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * (amax / np.float32(127.0)).astype(np.float32).astype(np.float64)).reshape(m, k)


def reference(x: np.ndarray, parts: list[tuple[np.ndarray, Q, np.ndarray | None]], n_total: int) -> np.ndarray:
    """float64 y [M, n_total] for parts (raw blocks, type, out_index or None), placed as gguf_linear places them."""
    k = x.shape[1]
    w = np.zeros((n_total, k))
    offset = 0
    for raw, qtype, idx in parts:
        rows = dequant_ref(raw, qtype).astype(np.float64)
        if idx is None:
            w[offset:offset + rows.shape[0]] = rows
        else:
            w[idx] = rows
        offset += rows.shape[0]
    return int8_x(x) @ w.T


def assert_rows_close(y, ref, what):
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == ref.shape, what
    err = np.linalg.norm(y - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    assert err.max() <= ROW_TOL, (what, float(err.max()), int(err.argmax()))


def _x(m, k, seed):
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


# ------------------------------------------------------------------------------------------------ the extension
def _ks(qtype):
    return [512, 2304] if qtype in K_QUANTS else [512, 800, 288]  # 800, 288: K % 256 != 0


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [17, 33, 100, 512])
def test_prompt_gemm_matches_reference(ext, qtype, m):
    for k in _ks(qtype):
        n = 45 if m < 512 else 37  # not a multiple of the panel width (8 / 16)
        raw = make_weights(qtype, n, k, seed=int(qtype) * 1000 + m + k)
        x = _x(m, k, seed=m + k)
        y = ext.gguf_linear_prompt(torch.from_numpy(x), [(torch.from_numpy(raw), int(qtype), n, None)], n).numpy()
        assert_rows_close(y, reference(x, [(raw, qtype, None)], n), (qtype.name, m, n, k))


@pytest.mark.parametrize("qtype", [Q.Q3_K, Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_prompt_gemm_any_row_count(ext, qtype):
    """Every row count of a last partial block of rows (1 .. 9; the decode sizes take the row kernel in the model,
    but the function serves any M)."""
    k, n = 512, 23
    raw = make_weights(qtype, n, k, seed=int(qtype) + 5)
    for m in range(1, 10):
        x = _x(m, k, seed=m)
        y = ext.gguf_linear_prompt(torch.from_numpy(x), [(torch.from_numpy(raw), int(qtype), n, None)], n).numpy()
        assert_rows_close(y, reference(x, [(raw, qtype, None)], n), (qtype.name, m))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prompt_gemm_several_blocks_of_k(ext, qtype):
    """Long prompts split K into blocks (x block of ~2 MiB: 600 rows -> 3328 values), the first block's partial
    products stored and the next added, here with out_index (scattered columns) and, for the 32-value block types,
    a last block that ends inside a group of 8 blocks."""
    m, n = 600, 20
    k = 4608 if qtype in K_QUANTS else 4384
    raw = make_weights(qtype, n, k, seed=int(qtype) + 9)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    x = _x(m, k, seed=int(qtype))
    y = ext.gguf_linear_prompt(torch.from_numpy(x), [(torch.from_numpy(raw), int(qtype), n, idx)], n).numpy()
    assert_rows_close(y, reference(x, [(raw, qtype, idx.numpy())], n), qtype.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prompt_gemm_out_index(ext, qtype):
    k = 768 if qtype in K_QUANTS else 544
    n, m = 70, 41
    raw = make_weights(qtype, n, k, seed=int(qtype))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(int(qtype))).to(torch.int32)
    x = _x(m, k, seed=3)
    y = ext.gguf_linear_prompt(torch.from_numpy(x), [(torch.from_numpy(raw), int(qtype), n, idx)], n).numpy()
    assert_rows_close(y, reference(x, [(raw, qtype, idx.numpy())], n), qtype.name)


def test_prompt_gemm_multi_part(ext):
    """A fused linear as a Q4_K_M file has them (Q4_K + Q4_K + Q6_K parts), plus 32-value block parts: rows of
    the first two interleaved over the columns by out_index (as llama.cpp's RoPE permutation of Q / K), the rest
    at the running offset; x quantized once for all parts."""
    k, m = 1024, 77
    gen = torch.Generator().manual_seed(11)
    specs = [(Q.Q4_K, 40), (Q.Q6_K, 24), (Q.Q5_0, 19), (Q.Q5_1, 8), (Q.Q6_K, 3)]
    raws = [make_weights(t, r, k, seed=i) for i, (t, r) in enumerate(specs)]
    perm = torch.randperm(64, generator=gen).to(torch.int32)
    idxs = [perm[:40].clone(), perm[40:].clone(), None, None, None]
    x = _x(m, k, seed=5)
    n_total = sum(r for _, r in specs)
    parts = [(torch.from_numpy(raw), int(t), r, idx) for raw, (t, r), idx in zip(raws, specs, idxs)]
    y = ext.gguf_linear_prompt(torch.from_numpy(x), parts, n_total).numpy()
    ref = reference(x, [(raw, t, None if idx is None else idx.numpy()) for raw, (t, _), idx in zip(raws, specs, idxs)],
                    n_total)
    assert_rows_close(y, ref, "multi-part")
    # each part alone: the same bits in its columns
    alone = ext.gguf_linear_prompt(torch.from_numpy(x), [(parts[0][0], int(Q.Q4_K), 40, None)], 40)
    assert torch.equal(torch.from_numpy(y)[:, perm[:40].long()], alone)


def test_prompt_gemm_close_to_the_row_kernel(ext):
    """The same integer sums and scales as gguf_linear, summed in another order."""
    k, n, m = 2048, 96, 64
    raw = torch.from_numpy(make_weights(Q.Q4_K, n, k, seed=2))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    parts = [(raw, int(Q.Q4_K), n, None)]
    a, b = ext.gguf_linear(x, parts, n), ext.gguf_linear_prompt(x, parts, n)
    assert_rows_close(b.numpy(), a.double().numpy(), "row kernel")


def test_prompt_gemm_threads_do_not_change_results(ext):
    raw = torch.from_numpy(make_weights(Q.Q6_K, 200, 1024, seed=4))
    x = torch.randn(50, 1024, generator=torch.Generator().manual_seed(4))
    parts = [(raw, int(Q.Q6_K), 200, None)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.gguf_linear_prompt(x, parts, 200)
        torch.set_num_threads(max(2, old))
        many = ext.gguf_linear_prompt(x, parts, 200)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)


def test_prompt_gemm_zero_and_extreme_inputs(ext):
    """All-zero blocks of x (amax 0), one huge value per block, and x of a single row past a block of rows."""
    k, n = 512, 33
    raw = make_weights(Q.Q5_K, n, k, seed=6)
    x = _x(19, k, seed=6)
    x[3] = 0.0
    x[5, ::32] = 1e4
    y = ext.gguf_linear_prompt(torch.from_numpy(x), [(torch.from_numpy(raw), int(Q.Q5_K), n, None)], n).numpy()
    assert np.all(y[3] == 0.0)
    assert_rows_close(np.delete(y, 3, 0), np.delete(reference(x, [(raw, Q.Q5_K, None)], n), 3, 0), "extreme")


@pytest.mark.parametrize("bad", ["type", "k", "rows", "index"])
def test_prompt_gemm_bad_arguments_raise(ext, bad):
    raw = torch.from_numpy(make_weights(Q.Q4_K, 4, 256, seed=0))
    x = torch.randn(20, 256)
    calls = {
        "type": lambda: ext.gguf_linear_prompt(x, [(raw, 10, 4, None)], 4),
        "k": lambda: ext.gguf_linear_prompt(torch.randn(20, 288), [(raw, int(Q.Q4_K), 4, None)], 4),
        "rows": lambda: ext.gguf_linear_prompt(x, [(raw, int(Q.Q4_K), 4, None)], 5),
        "index": lambda: ext.gguf_linear_prompt(x, [(raw, int(Q.Q4_K), 4, torch.tensor([0, 1, 1, 2], dtype=torch.int32))], 4),
    }
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        calls[bad]()


# ------------------------------------------------------------------------------------------------ dispatch
def test_method_keeps_decode_and_verification_on_the_row_kernel():
    q4k, q6k = int(Q.Q4_K), int(Q.Q6_K)
    for rows in range(1, 17):
        assert gguf_ops.method([q4k, q6k], rows, True) == "rows"
    assert gguf_ops.method([q4k, q6k], 17, True) == "prompt"
    assert gguf_ops.method([q4k], 512, True) == "prompt"
    # builds without a vectorized prompt GEMM: the row kernel up to the measured rows, then dequantize + GEMM
    assert gguf_ops.method([q4k], 64, False) == "rows" and gguf_ops.method([q4k], 65, False) == "dequantize"
    assert gguf_ops.method([q4k, q6k], 33, False) == "dequantize"
    # where the extension has the AMX kernel: it takes the prefills from AMX_MIN_ROWS rows on
    edge = gguf_ops.AMX_MIN_ROWS
    assert [gguf_ops.method([q4k], r, True, True) for r in (1, 16, 17, edge - 1, edge, 2048)] == \
        ["rows", "rows", "prompt", "prompt", "amx", "amx"]
    assert gguf_ops.method([q4k, q6k], edge, False, True) == "amx"


def amx_or_skip(ext):
    """Skip where the extension's AMX kernels do not run (the callers' "no AMX here" checks run there instead)."""
    if not matmul.amx_kernels(ext):
        pytest.skip(f"no AMX on this CPU (the AMX kernels need AMX-BF16: Intel Xeon since Sapphire Rapids; "
                    f"{ext.isa()} build)")


AMX_CASES = [(1, 40, 512), (17, 24, 768), (64, 48, 256), (100, 56, 1024), (1000, 40, 2304)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", AMX_CASES, ids=lambda v: str(v))
def test_amx_kernel_is_the_bf16_product(ext, qtype, m, n, k):
    """gguf_linear_amx: x and gguf.quants' weights rounded to bf16, summed in fp32: against that product in float64,
    for the parts as stored and as the CPU loader lays them out (x8 / r8 / l4); odd panel counts, a last block of
    rows shorter than a tile, and (1000 x 2304) K in several blocks; a bf16 x gives the same as its fp32 x."""
    from edgellm.quant.gguf_linear import GGUFPart, repack_for_cpu

    amx_or_skip(ext)
    k = k if qtype in K_QUANTS else k + 96  # the 32-value types: K not a multiple of 256, as where files use them
    raw = make_weights(qtype, n, k, seed=int(qtype) + m)
    w = torch.from_numpy(dequant_ref(raw, qtype)).to(torch.bfloat16).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + n))
    xb = x.to(torch.bfloat16).double()
    want = xb @ w.T
    bound = 1e-6 * (xb.abs() @ w.abs().T).max().item()  # fp32 sums of K products
    stored = [(torch.from_numpy(raw), int(qtype), n, None)]
    laid = [(p.raw, p.type, p.rows, p.out_index)
            for p in repack_for_cpu([GGUFPart(torch.from_numpy(raw), int(qtype), n)], k)]
    for parts in (stored, laid):
        y = ext.gguf_linear_amx(x, parts, n)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        err = (y.double() - want).abs().max().item()
        assert err <= bound, (qtype.name, [p[1] for p in parts], m, n, k, err, bound)
    assert torch.equal(ext.gguf_linear_amx(x.to(torch.bfloat16), laid, n), ext.gguf_linear_amx(x, laid, n))


def test_amx_kernel_out_index_and_parts(ext):
    """Two parts of different types, one writing its rows to permuted columns: each column its own row's product."""
    amx_or_skip(ext)
    k = 512
    raw_a, raw_b = make_weights(Q.Q4_K, 24, k, seed=21), make_weights(Q.Q8_0, 8, k, seed=22)
    index = torch.tensor([30, 1, 7, 3, 25, 0, 12, 9], dtype=torch.int32)
    order = torch.tensor([r for r in range(32) if r not in set(index.tolist())], dtype=torch.int32)
    w = torch.empty(32, k, dtype=torch.float64)
    w[order.long()] = torch.from_numpy(dequant_ref(raw_a, Q.Q4_K)).to(torch.bfloat16).double()
    w[index.long()] = torch.from_numpy(dequant_ref(raw_b, Q.Q8_0)).to(torch.bfloat16).double()
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(5))
    y = ext.gguf_linear_amx(x, [(torch.from_numpy(raw_a), int(Q.Q4_K), 24, order),
                                (torch.from_numpy(raw_b), int(Q.Q8_0), 8, index)], 32)
    want = x.to(torch.bfloat16).double() @ w.T
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_amx_kernel_bad_arguments(ext):
    raw = torch.from_numpy(make_weights(Q.Q4_K, 16, 256, seed=1))
    part = [(raw, int(Q.Q4_K), 16, None)]
    if not matmul.amx_kernels(ext):
        with pytest.raises(RuntimeError, match="no AMX here"):
            ext.gguf_linear_amx(torch.randn(70, 256), part, 16)
        return
    for bad in (lambda: ext.gguf_linear_amx(torch.randn(70, 128), part, 16),  # K of another tensor
                lambda: ext.gguf_linear_amx(torch.randn(70, 256), part, 17),  # a column no part writes
                lambda: ext.gguf_linear_amx(torch.randn(70, 256).half(), part, 16),
                lambda: ext.gguf_linear_amx(torch.randn(2, 70, 256), part, 16)):
        with pytest.raises((RuntimeError, ValueError)):
            bad()


def test_gguf_linear_module_takes_each_path(ext, monkeypatch):
    """GGUFLinear: 16 rows give gguf_linear's bits, 24 rows gguf_linear_prompt's where it is vectorized, 70 rows
    gguf_linear_amx's where AMX runs; with AMX_GEMM and PROMPT_GEMM off, the paths before them (row kernel, then
    dequantize + GEMM)."""
    from edgellm.quant.gguf_linear import GGUFLinear, GGUFPart

    k = 512
    raw = make_weights(Q.Q4_K, 24, k, seed=8)
    lin = GGUFLinear([GGUFPart(torch.from_numpy(raw), int(Q.Q4_K), 24)], k)
    parts = [(torch.from_numpy(raw), int(Q.Q4_K), 24, None)]
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(8))  # below gguf_ops.AMX_MIN_ROWS
    assert 16 < x.shape[0] < gguf_ops.AMX_MIN_ROWS
    monkeypatch.setattr(matmul, "cpu_extension", lambda: ext)
    with torch.no_grad():
        assert torch.equal(lin(x[:16]), ext.gguf_linear(x[:16], parts, 24))
        y = lin(x)
    if ext.gguf_prompt_gemm_fast():
        assert torch.equal(y, ext.gguf_linear_prompt(x, parts, 24))
        assert_rows_close(y.numpy(), reference(x.numpy(), [(raw, Q.Q4_K, None)], 24), "module")
    x70 = torch.randn(70, k, generator=torch.Generator().manual_seed(9))
    if matmul.amx_kernels(ext):  # 70 rows: the AMX kernel, where it runs
        with torch.no_grad():
            assert torch.equal(lin(x70), ext.gguf_linear_amx(x70, parts, 24))
    monkeypatch.setattr(gguf_ops, "AMX_GEMM", False)
    monkeypatch.setattr(gguf_ops, "PROMPT_GEMM", False)  # as before the prompt GEMM
    with torch.no_grad():
        assert torch.equal(lin(x), ext.gguf_linear(x, parts, 24))  # Q4_K: the row kernel up to 64 rows
        w = torch.from_numpy(dequant_ref(raw, Q.Q4_K))
        torch.testing.assert_close(lin(x70), F.linear(x70, w), rtol=1e-5, atol=1e-5)  # then dequantize + GEMM


# ------------------------------------------------------------------------------------------------ ISA builds
HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include "cpu_gguf.h"
namespace edgellm { const char* isa_name(); }
template <class T> static bool rd(FILE* f, T* p, size_t n) { return std::fread(p, sizeof(T), n, f) == n; }
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 2;
  std::printf("isa %s fast %d\n", edgellm::isa_name(), (int)edgellm::gguf_prompt_gemm_fast());
  int64_t hdr[5];  // type, M, N, K, has out_index
  while (rd(in, hdr, 5)) {
    const int type = (int)hdr[0];
    const int64_t M = hdr[1], N = hdr[2], K = hdr[3], rb = edgellm::gguf_row_bytes(type, K);
    std::vector<uint8_t> raw(N * rb);
    std::vector<float> x(M * K), y(M * N, -1.0f);
    std::vector<int32_t> idx(N);
    if (!rd(in, raw.data(), raw.size()) || !rd(in, x.data(), x.size())) return 3;
    if (hdr[4] && !rd(in, idx.data(), idx.size())) return 3;
    const edgellm::GgufActs a = edgellm::gguf_quantize_acts(x.data(), M, K);
    edgellm::gguf_gemm_prompt(a, raw.data(), type, N, K, y.data(), N, hdr[4] ? idx.data() : nullptr);
    std::fwrite(y.data(), 4, y.size(), out);
    // the first N / 8 * 8 rows repacked (x8), where this build has that layout: n8 (as a float), y8 [M, N] (the
    // columns of those rows written, the rest left at -1)
    const int64_t n8 = edgellm::gguf_x8_supported(type) ? N / 8 * 8 : 0;
    std::vector<float> y8(M * N, -1.0f);
    if (n8) {
      std::vector<uint8_t> x8(n8 * edgellm::gguf_row_bytes(type + edgellm::GGUF_X8, K));
      edgellm::gguf_repack_x8(raw.data(), type, n8, K, x8.data());
      edgellm::gguf_gemm_prompt(a, x8.data(), type + edgellm::GGUF_X8, n8, K, y8.data(), N,
                                hdr[4] ? idx.data() : nullptr);
    }
    const float n8f = (float)n8;
    std::fwrite(&n8f, 4, 1, out);
    std::fwrite(y8.data(), 4, y8.size(), out);
    // Q8_0 / Q4_0 / Q4_1 blocks as our int8 / int4 layout (codes, scales, mins apart; quant_gemm_prompt): has (as a
    // float), yq [M, N]
    const bool ours = (type == 8 || type == 2 || type == 3) && !hdr[4];
    std::vector<float> yq(M * N, -1.0f);
    if (ours) {
      const int64_t nb = K / 32, bb = edgellm::gguf_block_bytes(type), head = type == 3 ? 4 : 2, cb = type == 8 ? 32 : 16;
      std::vector<uint8_t> codes(N * nb * cb);
      std::vector<uint16_t> sc(N * nb), mn(N * nb);
      for (int64_t b = 0; b < N * nb; ++b) {
        const uint8_t* blk = raw.data() + b * bb;
        std::memcpy(&sc[b], blk, 2);
        if (type == 3) std::memcpy(&mn[b], blk + 2, 2);
        std::memcpy(codes.data() + b * cb, blk + head, cb);
      }
      edgellm::QuantWeights w;
      w.codes = codes.data();
      w.scales = sc.data();
      w.mins = type == 3 ? mn.data() : nullptr;
      w.bits = type == 8 ? 8 : 4;
      w.group = 32;
      edgellm::quant_gemm_prompt(a, w, N, yq.data(), N);
    }
    const float oursf = ours ? 1.0f : 0.0f;
    std::fwrite(&oursf, 4, 1, out);
    std::fwrite(yq.data(), 4, yq.size(), out);
  }
  std::fclose(out);
  std::printf("done\n");
  return 0;
}
"""
# (type, M, N, K, out_index): every type at two row counts, K a multiple of 256 and not (32-value blocks), and
# prompts long enough to split K into blocks
ISA_CASES = [(t, m, 21, k, m == 33) for t in TYPES for m in (17, 33) for k in _ks(t)[:2]
             if t not in GRID_IQUANTS | set(L4_TYPES) or (m == 33 and k == _ks(t)[1])] + \
    [(Q.Q4_K, 130, 40, 2048, True), (Q.Q6_K, 130, 19, 1024, False),  # several blocks of K:
     (Q.Q6_K, 600, 20, 4608, True), (Q.Q5_0, 600, 9, 4384, False)]


@pytest.fixture(scope="module")
def prompt_builds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_prompt_isa")
    src = folder / "harness.cpp"
    src.write_text(HARNESS)
    jobs = start_builds(folder, "prompt", lambda cxx, flags, exe: [
        cxx, "-O2", "-std=c++17", "-DEDGELLM_STANDALONE", f"-I{KERNELS}", *flags, str(src),
        str(KERNELS / "cpu_gguf.cpp"), str(KERNELS / "cpu_gguf_x8.cpp"), str(KERNELS / "cpu_kernels.cpp"), "-o",
        str(exe)])
    yield folder, jobs
    stop_builds(jobs)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx2vnni", "avx512vnni", "neon", "neon-dotprod"])
def test_isa_builds_prompt_gemm_match_reference(prompt_builds, isa):
    import subprocess

    folder, jobs = prompt_builds
    if isa not in jobs:
        pytest.skip(f"no {isa} build here (AVX2, AVX-VNNI: the CPU; AVX-512 VNNI: the CPU or SIMDe; NEON: "
                    "aarch64-linux-gnu-g++ and qemu-aarch64)")
    proc, exe, runner = jobs[isa]
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    cases, blob = [], bytearray()
    for i, (t, m, n, k, with_idx) in enumerate(ISA_CASES):
        raw = make_weights(t, n, k, seed=70 + i)
        x = _x(m, k, seed=i)
        idx = np.random.default_rng(i).permutation(n).astype(np.int32) if with_idx else None
        cases.append((t, m, n, k, raw, x, idx))
        blob += np.array([int(t), m, n, k, int(with_idx)], dtype=np.int64).tobytes() + raw.tobytes() + x.tobytes()
        if with_idx:
            blob += idx.tobytes()
    (folder / f"cases-{isa}.bin").write_bytes(bytes(blob))
    res = folder / f"out-{isa}.bin"
    run = subprocess.run([*runner, str(exe), str(folder / f"cases-{isa}.bin"), str(res)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith(f"isa {isa} fast "), run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.split()[3] == ("1" if isa in X8_BUILDS else "0")
    data, pos = np.fromfile(res, dtype=np.float32), 0
    for t, m, n, k, raw, x, idx in cases:
        y, pos = data[pos:pos + m * n].reshape(m, n), pos + m * n
        ref = reference(x, [(raw, t, idx)], n)
        assert_rows_close(y, ref, (isa, t.name, m, n, k, idx is not None))
        n8, pos = int(data[pos]), pos + 1
        y8, pos = data[pos:pos + m * n].reshape(m, n), pos + m * n
        # the x8 layout's panels, built from 8-row groups
        assert n8 == (n // 8 * 8 if isa in X8_BUILDS and t in X8_ANY else 0)
        if n8:
            cols = (idx if idx is not None else np.arange(n))[:n8]
            assert_rows_close(y8[:, cols], ref[:, cols], (isa, t.name, m, n, k, "x8"))
        # our int8 / int4 layout (quant_gemm_prompt) over the same codes and scales
        ours, pos = bool(data[pos]), pos + 1
        yq, pos = data[pos:pos + m * n].reshape(m, n), pos + m * n
        assert ours == (t in (Q.Q8_0, Q.Q4_0, Q.Q4_1) and idx is None)
        if ours:
            assert_rows_close(yq, ref, (isa, t.name, m, n, k, "ours"))
    assert pos == data.size


# ------------------------------------------------------------------------------------------------ end to end
def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(softmax b || softmax a) per position."""
    p, q = torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def test_prefill_logits_track_fp(tmp_path, monkeypatch):
    """A Q4_K_M-like GGUF model (K-quant mix, fused Q/K/V and gate/up of mixed types, Q/K rows permuted by
    out_index): a 150-token prefill through the prompt GEMM against the same file as `--weights fp`. The error
    allowed is that of the int8 activations themselves: the same model with every GGUF linear computed in fp32 as
    F.linear(x rounded to int8 per 32 values (emulated in torch), gguf.quants' weights) sets the bounds."""
    from edgellm.loading import load_model
    from edgellm.quant.gguf_linear import GGUFLinear
    from tests.test_gguf_as_stored import K_MIX, SHAPE, _logits
    from tests.fixtures.tiny import make_gguf, make_hf_model

    e = matmul.cpu_extension()
    if e is None or not hasattr(e, "gguf_linear_prompt"):
        pytest.fail("the C++ GGUF kernels did not build")
    folder = make_hf_model(tmp_path / "hf", "llama_gqa", seed=3, **SHAPE)
    path = make_gguf(folder, tmp_path / "kmix.gguf", quant_types=K_MIX, seed=7)
    ids = [(7 * i + 3) % 250 + 3 for i in range(151)]
    fp = _logits(load_model(path, weights="fp"), ids)
    auto = load_model(path, weights="auto")
    rows = []
    real = GGUFLinear._method

    def spy(self, x2):
        how, ext = real(self, x2)
        rows.append((x2.shape[0], how))
        return how, ext

    monkeypatch.setattr(GGUFLinear, "_method", spy)
    monkeypatch.setattr(gguf_ops, "AMX_GEMM", False)  # the prompt GEMM here, on any CPU
    new = _logits(auto, ids)
    if e.gguf_prompt_gemm_fast():
        assert {r for r in rows if r[0] == 150} == {(150, "prompt")}
    assert {r for r in rows if r[0] == 1} == {(1, "rows")}
    amx = matmul.amx_kernels(e)
    bf16 = []
    if amx:  # the AMX kernel, where this CPU has it
        rows.clear()
        monkeypatch.setattr(gguf_ops, "AMX_GEMM", True)
        bf16 = _logits(auto, ids)
        assert {r for r in rows if r[0] == 150} == {(150, "amx")} and {r for r in rows if r[0] == 1} == {(1, "rows")}

    def emulated(self, x):
        xb = x.float().reshape(*x.shape[:-1], -1, 32)
        amax = xb.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        xq = (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)
        return F.linear(xq, self.dequantized_weight(torch.float32), self.bias)

    monkeypatch.setattr(GGUFLinear, "forward", emulated)
    emu = _logits(auto, ids)
    for got, ref, want in zip(new, emu, fp):
        kl_new, kl_emu = _kl(got, want), _kl(ref, want)
        assert kl_new.mean() <= 1.25 * kl_emu.mean() + 1e-4, (kl_new.mean(), kl_emu.mean())
        assert kl_new.max() <= 2.0 * kl_emu.max() + 1e-3, (kl_new.max(), kl_emu.max())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    if not amx:
        return

    # the AMX kernel: bounded by the same model with every GGUF linear computed in float64 from x and gguf.quants'
    # weights rounded to bf16 (its own rounding: one position of this tiny random model is far more sensitive to it
    # than to int8 x), and on average no worse than the int8 path's bound
    def emulated_bf16(self, x):
        w = self.dequantized_weight(torch.float32).to(torch.bfloat16).double()
        y = F.linear(x.to(torch.bfloat16).double(), w, None if self.bias is None else self.bias.double())
        return y.to(x.dtype)

    monkeypatch.setattr(GGUFLinear, "forward", emulated_bf16)
    emu_bf16 = _logits(auto, ids)
    for i, (got, ref, ref8, want) in enumerate(zip(bf16, emu_bf16, emu, fp)):
        kl_amx, kl_ref, kl_8 = _kl(got, want), _kl(ref, want), _kl(ref8, want)
        if i == 0:  # the prefill (the decode step after it runs the row kernel: the int8 bounds alone)
            assert kl_amx.mean() <= 1.25 * kl_ref.mean() + 1e-4, (kl_amx.mean(), kl_ref.mean())
            assert kl_amx.max() <= 2.0 * kl_ref.max() + 1e-3, (kl_amx.max(), kl_ref.max())
        assert kl_amx.mean() <= 1.25 * kl_8.mean() + 1e-4, (kl_amx.mean(), kl_8.mean())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
