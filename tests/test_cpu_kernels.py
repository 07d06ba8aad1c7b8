"""The C++ CPU int4/int8 matmul kernels against a dequantize-then-float64 reference.

The reference dequantizer is written here from the weight-format spec (not imported from
edgellm.quant.groups) so these tests pin the format on their own.

Error bounds, and why they differ per variant:
- variant 1 "int-dot" (the default, llama.cpp's approach) rounds every 32-block of x to int8 with one
  scale d = max|x|/127 before the integer dot products. Each x_i moves by at most d/2, i.e. ~0.4% of the
  block's largest entry, so for Gaussian x the result is off by ~0.5% relative: we bound it at 1e-2 vs the
  exact fp64 reference. That bound alone would hide small indexing bugs, so the same outputs must also
  match, to 1e-4, an fp64 reference computed on the *rounded* x (emulated here): only fp32 summation
  order separates the two.
- variants 2 "float-fma" and 3 "portable float" dequantize the weights to fp32 and use fp32 x: only fp32
  rounding of ~K products, so 1e-5 relative.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.kernels import cpu_ext

INT_DOT, FLOAT_FMA, PORTABLE_FLOAT, PORTABLE_INT_DOT, INT_DOT_RESIDUAL = 1, 2, 3, 4, 5
TOL = {INT_DOT: 1e-2, PORTABLE_INT_DOT: 1e-2, FLOAT_FMA: 1e-5, PORTABLE_FLOAT: 1e-5, INT_DOT_RESIDUAL: 1e-4}
TOL_EMULATED = 1e-4


@pytest.fixture(scope="module")
def ext():
    e = cpu_ext.get_extension()
    if e is None:
        pytest.fail("the CPU kernel extension did not build (see the warning above)")
    return e


# ------------------------------------------------------------------------------------------------ reference
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 -> [N, K/2], GGUF Q4_0/Q4_1 order: per 32-block, byte j = c[j] | c[j+16] << 4."""
    n, k = codes.shape
    c = codes.view(n, k // 32, 2, 16)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    b = packed.view(n, half // 16, 16)
    return torch.stack([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


def dequant_int4(packed, scales, mins, group_size) -> torch.Tensor:
    codes = unpack_int4(packed).double()
    s = scales.double().repeat_interleave(group_size, dim=1)
    if mins.numel():
        return codes * s + mins.double().repeat_interleave(group_size, dim=1)
    return (codes - 8) * s


def dequant_int8(codes, scales, group_size) -> torch.Tensor:
    return codes.double() * scales.double().repeat_interleave(group_size, dim=1)


def emulate_int8_x(x: torch.Tensor) -> torch.Tensor:
    """x as the int-dot kernels see it: per 32-block, q = round_half_even(x * (127/amax)), times amax/127,
    all in IEEE fp32. numpy, because torch's tensor-by-scalar division is not correctly rounded (it
    multiplies by a reciprocal), and a 1-ulp different 127/amax flips q at near-ties."""
    m, k = x.shape
    xb = x.float().numpy().reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return torch.from_numpy(q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def make_int4(n, k, g, asym, gen):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.002).half()
    mins = (-torch.rand(n, k // g, generator=gen) * 0.15).half() if asym else torch.empty(0, dtype=torch.float16)
    return pack_int4(codes), scales, mins


def make_int8(n, k, g, gen):
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.002).half()
    return codes, scales


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------ int4
# (M, N, K, G): odd N, K a multiple of the group but not of the kernels' 256-wide chunks (96, 160, 288,
# 576 leave 3, 5, 1 and 2 tail blocks), the model's shapes, and every M from 1 to 16.
INT4_SHAPES = [
    (1, 33, 96, 32), (2, 577, 96, 32), (3, 33, 160, 32), (4, 65, 288, 32), (5, 40, 576, 32),
    (6, 33, 192, 64), (7, 31, 320, 64), (8, 48, 384, 128), (9, 17, 640, 128), (10, 24, 256, 32),
    (11, 33, 1536, 32), (12, 19, 512, 64), (13, 21, 768, 128), (14, 37, 576, 64), (15, 9, 96, 32),
    (16, 35, 576, 32), (16, 64, 1536, 128), (1, 960, 576, 32), (1, 576, 1536, 64),
]


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("m,n,k,g", INT4_SHAPES)
def test_int4_matches_reference(ext, m, n, k, g, asym):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + g + asym)
    packed, scales, mins = make_int4(n, k, g, asym, gen)
    x = torch.randn(m, k, generator=gen)
    w = dequant_int4(packed, scales, mins, g)
    ref = x.double() @ w.T
    ref_q = emulate_int8_x(x) @ w.T
    y = ext.int4_gemm(x, packed, scales, mins, g)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, ref) <= TOL[INT_DOT]
    assert rel_err(y, ref_q) <= TOL_EMULATED
    for variant in (INT_DOT, FLOAT_FMA, PORTABLE_FLOAT, PORTABLE_INT_DOT, INT_DOT_RESIDUAL):
        yv = ext.int4_gemm_variant(x, packed, scales, mins, g, variant)
        assert rel_err(yv, ref) <= TOL[variant], variant
        if variant in (INT_DOT, PORTABLE_INT_DOT):
            assert rel_err(yv, ref_q) <= TOL_EMULATED, variant


# ------------------------------------------------------------------------------------------------ int8
# G == K is per output channel; K = 100 and K = 40 are not multiples of 32 (per channel only) and take the
# portable path.
INT8_SHAPES = [
    (1, 33, 96, 32), (2, 577, 96, 96), (3, 33, 160, 160), (4, 65, 288, 32), (5, 40, 576, 576),
    (6, 33, 192, 64), (7, 31, 320, 64), (8, 48, 384, 128), (9, 17, 640, 128), (10, 24, 256, 256),
    (11, 33, 1536, 32), (12, 19, 512, 64), (13, 21, 768, 128), (14, 37, 576, 64), (15, 9, 100, 100),
    (16, 35, 576, 32), (16, 64, 1536, 1536), (1, 960, 576, 32), (3, 7, 40, 40),
]


@pytest.mark.parametrize("m,n,k,g", INT8_SHAPES)
def test_int8_matches_reference(ext, m, n, k, g):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + g)
    codes, scales = make_int8(n, k, g, gen)
    x = torch.randn(m, k, generator=gen)
    w = dequant_int8(codes, scales, g)
    ref = x.double() @ w.T
    y = ext.int8_gemm(x, codes, scales, g)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, ref) <= TOL[INT_DOT]
    ref_q = emulate_int8_x(x) @ w.T if k % 32 == 0 else ref  # K % 32 != 0 runs the exact float path
    assert rel_err(y, ref_q) <= TOL_EMULATED
    for variant in (INT_DOT, FLOAT_FMA, PORTABLE_FLOAT, PORTABLE_INT_DOT, INT_DOT_RESIDUAL):
        yv = ext.int8_gemm_variant(x, codes, scales, g, variant)
        assert rel_err(yv, ref) <= TOL[variant], variant
        if variant in (INT_DOT, PORTABLE_INT_DOT) and k % 32 == 0:
            assert rel_err(yv, ref_q) <= TOL_EMULATED, variant


@pytest.mark.parametrize("kind", ["int4 asym", "int8"])
def test_residual_activations_close_the_gap_to_fp32(ext, kind):
    """--activations int8x2 (variant 5): the int8 blocks plus their int8 residual as a second kernel row. Against
    the float64 product it is ~100x closer than int8 alone, and each row is the same bits for 1 or 9 tokens."""
    gen = torch.Generator().manual_seed(11)
    n, k, g = 96, 1536, 32
    x = torch.randn(9, k, generator=gen) * torch.linspace(0.1, 3.0, k)
    if kind == "int8":
        codes, scales = make_int8(n, k, g, gen)
        w = dequant_int8(codes, scales, g)
        gemm = lambda xs, v: ext.int8_gemm_variant(xs, codes, scales, g, v)  # noqa: E731
    else:
        packed, scales, mins = make_int4(n, k, g, True, gen)
        w = dequant_int4(packed, scales, mins, g)
        gemm = lambda xs, v: ext.int4_gemm_variant(xs, packed, scales, mins, g, v)  # noqa: E731
    ref = x.double() @ w.T
    one, two = rel_err(gemm(x, INT_DOT), ref), rel_err(gemm(x, INT_DOT_RESIDUAL), ref)
    assert two < one / 50 and two < 1e-4, (one, two)
    alone = torch.cat([gemm(x[i:i + 1], INT_DOT_RESIDUAL) for i in range(9)])
    assert torch.equal(gemm(x, INT_DOT_RESIDUAL), alone)


# ------------------------------------------------------------------------------------------------ T-invariance
# N = 35 and 13 leave rows outside every group of 8 (those take the one-row kernel); K = 96, 288 and 576 leave
# blocks after the last 256-wide chunk (the one-row kernel's pair loop and last block); M = 2..9 gives the 8-row
# kernel every tile size and, at 5+ (AVX2) or 9 (AVX-512) tokens, more than one tile.
ROWS_SHAPES = [(35, 576, 32), (16, 1536, 32), (13, 96, 32), (24, 288, 32), (40, 576, 64), (16, 1536, 128)]


@pytest.mark.parametrize("kind", ["int4 sym", "int4 asym", "int8"])
@pytest.mark.parametrize("n,k,g", ROWS_SHAPES)
def test_rows_bit_identical_whatever_the_number_of_tokens(ext, kind, n, k, g):
    """A token's output row is the same bits whether it is computed alone (the one-row kernel) or among
    2..9 tokens (the 8-row kernel on AVX2; 16-row groups, with an 8-row one where a thread's share is odd, on
    AVX-512 VNNI): what keeps greedy speculative decoding identical to plain."""
    gen = torch.Generator().manual_seed(n * 7 + k + g)
    x = torch.randn(9, k, generator=gen) * torch.linspace(0.1, 3.0, k)
    if kind == "int8":
        codes, scales = make_int8(n, k, g, gen)
        gemm = lambda xs: ext.int8_gemm(xs, codes, scales, g)  # noqa: E731
    else:
        packed, scales, mins = make_int4(n, k, g, kind == "int4 asym", gen)
        if kind == "int4 sym":
            mins = torch.empty(0, dtype=torch.float16)
        gemm = lambda xs: ext.int4_gemm(xs, packed, scales, mins, g)  # noqa: E731
    alone = torch.cat([gemm(x[i:i + 1]) for i in range(9)])
    for m in range(2, 10):
        together = gemm(x[:m])
        assert torch.equal(together, alone[:m]), m


# ------------------------------------------------------------------------------------------------ edge cases
def test_kernel_tuning_switches_keep_the_bits(ext):
    """The benchmarks' A/B switches (kernels.matmul.set_kernel_tuning: 16-row groups on AVX-512 VNNI, the token
    count from which rows go 8 at a time) change which kernel runs, never a result: the same bits, close to the
    float64 reference, with either setting."""
    from edgellm.kernels import matmul as K

    gen = torch.Generator().manual_seed(11)
    packed, scales, mins = make_int4(64, 256, 32, True, gen)
    x = torch.randn(5, 256, generator=gen)
    ref = x.double() @ dequant_int4(packed, scales, mins, 32).T
    default = ext.int4_gemm_variant(x, packed, scales, mins, 32, INT_DOT)
    try:
        for rows16, rows8_min in ((False, 2), (True, 100), (False, 1)):
            K.set_kernel_tuning(rows16=rows16, rows8_min_tokens=rows8_min)
            assert torch.equal(ext.int4_gemm_variant(x, packed, scales, mins, 32, INT_DOT), default), rows8_min
    finally:
        K.set_kernel_tuning()
    assert rel_err(default, ref) <= TOL[INT_DOT]


def test_zero_rows_give_exact_zeros(ext):
    """All-zero activation rows (max|x| = 0: the int-dot scale must not divide by zero) and weight rows
    with zero scales give exact zeros, and do not disturb their neighbours."""
    gen = torch.Generator().manual_seed(7)
    m, n, k, g = 5, 33, 576, 32
    x = torch.randn(m, k, generator=gen)
    x[1] = 0.0
    x[3] = 0.0
    packed, scales, mins = make_int4(n, k, g, True, gen)
    scales[4] = 0.0
    mins[4] = 0.0
    codes8, scales8 = make_int8(n, k, g, gen)
    scales8[4] = 0.0
    outs = {
        "int4 asym": (ext.int4_gemm(x, packed, scales, mins, g), x.double() @ dequant_int4(packed, scales, mins, g).T),
        "int4 sym": (ext.int4_gemm(x, packed, scales, torch.empty(0, dtype=torch.float16), g),
                     x.double() @ dequant_int4(packed, scales, torch.empty(0), g).T),
        "int8": (ext.int8_gemm(x, codes8, scales8, g), x.double() @ dequant_int8(codes8, scales8, g).T),
    }
    for name, (y, ref) in outs.items():
        assert torch.isfinite(y).all(), name
        assert (y[1] == 0).all() and (y[3] == 0).all(), name
        assert (y[:, 4] == 0).all(), name
        keep = [0, 2, 4]
        assert rel_err(y[keep], ref[keep]) <= TOL[INT_DOT], name


def test_thread_count_does_not_change_results(ext):
    """Columns are split across threads, each computed whole by one thread: results are bit-identical."""
    gen = torch.Generator().manual_seed(3)
    packed, scales, mins = make_int4(1000, 576, 32, True, gen)
    x = torch.randn(3, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = ext.int4_gemm(x, packed, scales, mins, 32)
        torch.set_num_threads(2)
        y2 = ext.int4_gemm(x, packed, scales, mins, 32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


def test_out_variants_write_in_place(ext):
    gen = torch.Generator().manual_seed(9)
    packed, scales, mins = make_int4(33, 96, 32, True, gen)
    codes8, scales8 = make_int8(33, 96, 32, gen)
    x = torch.randn(3, 96, generator=gen)
    out = torch.full((3, 33), float("nan"))
    assert ext.int4_gemm_out(x, packed, scales, mins, 32, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, ext.int4_gemm(x, packed, scales, mins, 32))
    ext.int8_gemm_out(x, codes8, scales8, 32, out)
    assert torch.equal(out, ext.int8_gemm(x, codes8, scales8, 32))
    with pytest.raises(RuntimeError):
        ext.int4_gemm_out(x, packed, scales, mins, 32, torch.empty(3, 32))


def test_non_contiguous_and_non_fp32_inputs(ext):
    gen = torch.Generator().manual_seed(5)
    packed, scales, mins = make_int4(40, 128, 32, False, gen)
    x = torch.randn(128, 3, generator=gen).T  # non-contiguous [3, 128]
    ref = ext.int4_gemm(x.contiguous(), packed, scales, mins, 32)
    assert torch.equal(ext.int4_gemm(x, packed, scales, mins, 32), ref)
    y16 = ext.int4_gemm(x.to(torch.bfloat16), packed, scales, mins, 32)
    assert y16.dtype == torch.float32
    assert rel_err(y16, ref.double()) < 2e-2


@pytest.mark.parametrize(
    "bad",
    ["codes_k", "group", "scales_shape", "scales_dtype", "mins_shape", "x_1d"],
)
def test_bad_arguments_raise(ext, bad):
    gen = torch.Generator().manual_seed(0)
    packed, scales, mins = make_int4(8, 64, 32, True, gen)
    x = torch.randn(2, 64)
    args = dict(x=x, codes=packed, scales=scales, mins=mins, group_size=32)
    if bad == "codes_k":
        args["codes"] = packed[:, :16].contiguous()
    elif bad == "group":
        args["group_size"] = 48
    elif bad == "scales_shape":
        args["scales"] = scales[:, :1].contiguous()
    elif bad == "scales_dtype":
        args["scales"] = scales.float()
    elif bad == "mins_shape":
        args["mins"] = mins[:4].contiguous()
    elif bad == "x_1d":
        args["x"] = x[0]
    with pytest.raises(RuntimeError):
        ext.int4_gemm(**args)


def test_torch_op_matches_module(ext):
    """The same kernels are reachable as torch ops (for torch.compile), with shape-only fake kernels."""
    gen = torch.Generator().manual_seed(11)
    packed, scales, mins = make_int4(24, 96, 32, True, gen)
    codes8, scales8 = make_int8(24, 96, 96, gen)
    x = torch.randn(2, 96, generator=gen)
    assert torch.equal(torch.ops.edgellm_cpu.int4_gemm(x, packed, scales, mins, 32),
                       ext.int4_gemm(x, packed, scales, mins, 32))
    assert torch.equal(torch.ops.edgellm_cpu.int8_gemm(x, codes8, scales8, 96), ext.int8_gemm(x, codes8, scales8, 96))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        out = torch.ops.edgellm_cpu.int4_gemm(fx, mode.from_tensor(packed), mode.from_tensor(scales),
                                              mode.from_tensor(mins), 32)
        assert tuple(out.shape) == (2, 24)


def test_disabled_by_settings():
    assert cpu_ext.get_extension(cpu_ext.ExtensionSettings(enabled=False)) is None


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_failed_build_warns_once_and_returns_none(monkeypatch, tmp_path, compiler):
    """No compiler, or a compiler that fails: one warning, None, no exception (callers use the torch path)."""
    settings = cpu_ext.ExtensionSettings(cache_dir=tmp_path / "cache")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++") if compiler == "missing" else "false")
    monkeypatch.setattr(cpu_ext, "_state", {"tried": False, "ext": None})
    with pytest.warns(RuntimeWarning, match="CPU kernels unavailable") as record:
        assert cpu_ext.get_extension(settings) is None
        assert cpu_ext.get_extension(settings) is None  # remembered: no second attempt, no second warning
    assert len([w for w in record if "CPU kernels unavailable" in str(w.message)]) == 1


def test_cached_build_loads_fast(ext, tmp_path):
    """A second process finds the cached library and imports it without compiling (well under a second)."""
    import subprocess
    import sys

    code = (
        "import time, torch\n"
        "from edgellm.kernels import cpu_ext\n"
        "t = time.perf_counter(); e = cpu_ext.get_extension(); dt = time.perf_counter() - t\n"
        "assert e is not None\n"
        "print(dt)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "compiling" not in out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 1.0

# ------------------------------------------------------------------------------------------------ other ISAs
# The kernel source also builds without torch (-DEDGELLM_STANDALONE, serial), which lets us check the paths
# this machine does not run through the extension: the portable C++ path natively, and arm64 NEON (with and
# without the dot-product extension) under qemu when a cross compiler and qemu-user are installed
# (Debian: g++-aarch64-linux-gnu qemu-user-static). The harness checks the same bounds as above.
KERNEL_SOURCE = Path(cpu_ext.__file__).resolve().parent / "cpu_kernels.cpp"
HARNESS = r"""
// Standalone check of cpu_kernels.cpp (compiled with -DEDGELLM_STANDALONE): every variant against an fp64
// reference on the dequantized weights; int-dot variants also against x rounded the way they round it.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
namespace edgellm {
void q4_gemm(const float*, int64_t, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, float*, int);
void q8_gemm(const float*, int64_t, int64_t, const int8_t*, const uint16_t*, int64_t, int64_t, float*, int);
const char* isa_name();
}
static uint64_t rng = 88172645463325252ull;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t)rng; }
static float uni() { return (rnd() >> 8) * (1.0f / 16777216.0f); }
static float gauss() { float u = uni() + 1e-7f, v = uni(); return std::sqrt(-2 * std::log(u)) * std::cos(6.2831853f * v); }
static uint16_t f2h(float f) {  // exact for the values used (normal range, 10-bit mantissa truncation)
  uint32_t b; std::memcpy(&b, &f, 4);
  uint32_t s = (b >> 16) & 0x8000, e = (b >> 23) & 0xff, m = b & 0x7fffff;
  if (e < 113) return (uint16_t)s;  // flush what fp16 cannot hold as a normal
  return (uint16_t)(s | ((e - 112) << 10) | (m >> 13));
}
static double h2d(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023; double v = e ? std::ldexp(1024 + m, e - 25) : std::ldexp(m, -24);
  return (h & 0x8000) ? -v : v;
}
static void emulate(const std::vector<float>& x, int64_t M, int64_t K, std::vector<double>& xq) {
  xq.assign(M * K, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* p = &x[m * K + b * 32];
      float amax = 0; for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(p[i]));
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      for (int i = 0; i < 32; ++i) xq[m * K + b * 32 + i] = (double)std::nearbyint(p[i] * id) * (double)d;
    }
}
static double relerr(const std::vector<float>& y, const std::vector<double>& r) {
  double num = 0, den = 0;
  for (size_t i = 0; i < y.size(); ++i) { num += (y[i] - r[i]) * (y[i] - r[i]); den += r[i] * r[i]; }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}
static uint64_t digest = 1469598103934665603ull;  // FNV-1a over the int-dot outputs' bits (ISA builds compare it)
static void fold(const std::vector<float>& y) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(y.data());
  for (size_t i = 0; i < y.size() * sizeof(float); ++i) { digest ^= p[i]; digest *= 1099511628211ull; }
}
static std::vector<double> matmul(const std::vector<double>& x, const std::vector<double>& w, int64_t M, int64_t N, int64_t K) {
  std::vector<double> y(M * N, 0);
  for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) {
    double s = 0; for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k]; y[m * N + n] = s; }
  return y;
}
int main() {
  struct S { int64_t M, N, K, G; };
  const S shapes[] = {{1, 33, 96, 32}, {3, 577, 96, 32}, {5, 40, 576, 32}, {2, 33, 192, 64}, {7, 31, 320, 64},
                      {4, 48, 384, 128}, {16, 35, 576, 32}, {9, 17, 640, 128}, {1, 64, 1536, 32}, {16, 19, 1536, 128}};
  int fails = 0;
  std::printf("isa %s\n", edgellm::isa_name());
  for (const S& s : shapes) {
    const int64_t M = s.M, N = s.N, K = s.K, G = s.G;
    std::vector<float> x(M * K); for (auto& v : x) v = gauss();
    std::vector<double> xd(x.begin(), x.end()), xq; emulate(x, M, K, xq);
    for (int asym = 0; asym < 2; ++asym) {  // int4
      std::vector<uint8_t> codes(N * K / 2); std::vector<uint16_t> sc(N * K / G), mn(N * K / G);
      std::vector<int> c(N * K); for (auto& v : c) v = rnd() & 15;
      for (auto& v : sc) v = f2h(0.002f + 0.02f * uni());
      for (auto& v : mn) v = f2h(-0.15f * uni());
      for (int64_t n = 0; n < N; ++n) for (int64_t b = 0; b < K / 32; ++b) for (int j = 0; j < 16; ++j)
        codes[n * K / 2 + b * 16 + j] = (uint8_t)(c[n * K + b * 32 + j] | (c[n * K + b * 32 + j + 16] << 4));
      std::vector<double> w(N * K);
      for (int64_t n = 0; n < N; ++n) for (int64_t k = 0; k < K; ++k) {
        const double d = h2d(sc[n * (K / G) + k / G]);
        w[n * K + k] = asym ? c[n * K + k] * d + h2d(mn[n * (K / G) + k / G]) : (c[n * K + k] - 8) * d; }
      const auto ref = matmul(xd, w, M, N, K), refq = matmul(xq, w, M, N, K);
      for (int v : {1, 3, 4}) {
        std::vector<float> y(M * N, NAN);
        edgellm::q4_gemm(x.data(), M, K, codes.data(), sc.data(), asym ? mn.data() : nullptr, N, G, y.data(), v);
        if (v == 1) fold(y);
        const bool intdot = v != 3;
        const double e = relerr(y, ref), eq = relerr(y, refq);
        const bool ok = intdot ? (e <= 1e-2 && eq <= 1e-4) : e <= 1e-5;
        if (!ok) { ++fails; std::printf("FAIL int4 %s M=%ld N=%ld K=%ld G=%ld variant %d: %.3g %.3g\n", asym ? "asym" : "sym", (long)M, (long)N, (long)K, (long)G, v, e, eq); }
      }
    }
    for (int perch = 0; perch < 2; ++perch) {  // int8
      const int64_t g = perch ? K : G;
      std::vector<int8_t> codes(N * K); for (auto& v : codes) v = (int8_t)(rnd() & 255);
      std::vector<uint16_t> sc(N * K / g); for (auto& v : sc) v = f2h(0.002f + 0.02f * uni());
      std::vector<double> w(N * K);
      for (int64_t n = 0; n < N; ++n) for (int64_t k = 0; k < K; ++k) w[n * K + k] = codes[n * K + k] * h2d(sc[n * (K / g) + k / g]);
      const auto ref = matmul(xd, w, M, N, K), refq = matmul(xq, w, M, N, K);
      for (int v : {1, 3, 4}) {
        std::vector<float> y(M * N, NAN);
        edgellm::q8_gemm(x.data(), M, K, codes.data(), sc.data(), N, g, y.data(), v);
        if (v == 1) fold(y);
        const bool intdot = v != 3;
        const double e = relerr(y, ref), eq = relerr(y, refq);
        const bool ok = intdot ? (e <= 1e-2 && eq <= 1e-4) : e <= 1e-5;
        if (!ok) { ++fails; std::printf("FAIL int8 G=%ld M=%ld N=%ld K=%ld variant %d: %.3g %.3g\n", (long)g, (long)M, (long)N, (long)K, v, e, eq); }
      }
    }
  }
  std::printf("digest %016llx\n", (unsigned long long)digest);
  std::printf("%s: %d failures\n", fails ? "FAILED" : "ok", fails);
  return fails ? 1 : 0;
}
"""


def _cxx() -> str | None:
    import shutil

    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _cross() -> tuple[str | None, str | None]:
    import shutil

    return shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


# The compiler flags of each build of the kernels (NEON: for the aarch64 cross compiler).
ISA_FLAGS = {
    "scalar": ["-DEDGELLM_FORCE_SCALAR"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx2vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "neon": [],
    "neon-dotprod": ["-march=armv8.2-a+dotprod"],
}


VNNI_MISSING = ("neither an AVX-512 VNNI CPU (avx512f/bw/vl/vnni) nor SIMDe's headers to emulate one "
                "(apt: libsimde-dev; .ci/run installs it)")


def simde_flags(cxx: str) -> list[str] | None:
    """The extension's "avx512vnni-emulated" flags (AVX2 + kernels/simde_avx512.h) where `cxx` finds SIMDe's AVX-512
    header (Debian's libsimde-dev puts it in /usr/include), else None."""
    import subprocess

    flags = cpu_ext._isa_and_flags("avx512vnni-emulated")[1]
    probe = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", *flags, "-"], input="int main() { return 0; }\n",
                           capture_output=True, text=True)
    return flags if probe.returncode == 0 else None


def standalone_plan() -> dict[str, tuple[str, list[str], list[str]]]:
    """{build: (compiler, ISA flags, runner prefix)} for every standalone build this machine can make and run:
    the portable one, AVX2 where the CPU has it (and with AVX-VNNI where it has that too), AVX-512 VNNI where the CPU
    has it or else emulated through SIMDe on an AVX2 CPU, NEON under qemu where a cross toolchain is."""
    plan = {}
    cxx = _cxx()
    if cxx:
        plan["scalar"] = (cxx, ISA_FLAGS["scalar"], [])
        flags = cpu_ext._cpu_flags()
        if {"avx2", "fma", "f16c"} <= flags:
            plan["avx2"] = (cxx, ISA_FLAGS["avx2"], [])
            if "avx_vnni" in flags and cpu_ext._compiler_takes("-mavxvnni"):
                plan["avx2vnni"] = (cxx, ISA_FLAGS["avx2vnni"], [])
            if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
                plan["avx512vnni"] = (cxx, ISA_FLAGS["avx512vnni"], [])
            elif emulated := simde_flags(cxx):  # the same paths, the AVX-512 intrinsics emulated
                plan["avx512vnni"] = (cxx, emulated, [])
    cross, qemu = _cross()
    if cross and qemu:
        plan["neon"] = (cross, ["-static", *ISA_FLAGS["neon"]], [qemu])
        plan["neon-dotprod"] = (cross, ["-static", *ISA_FLAGS["neon-dotprod"]], [qemu])
    return plan


def start_builds(folder, prefix: str, command) -> dict:
    """Start every `standalone_plan` build in the background: {build: (process, executable, runner prefix)};
    `command(compiler, flags, exe)` is the compile line."""
    import subprocess

    jobs = {}
    for name, (compiler, flags, runner) in standalone_plan().items():
        exe = folder / f"{prefix}-{name}"
        proc = subprocess.Popen(command(compiler, flags, exe), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        jobs[name] = (proc, exe, runner)
    return jobs


def stop_builds(jobs: dict) -> None:
    for proc, _, _ in jobs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module", autouse=True)
def standalone_builds(tmp_path_factory):
    """Start the standalone compiles at once, in the background: they overlap the extension build (whose
    pybind half keeps one core busy for most of its time) instead of adding to the file's runtime."""
    folder = tmp_path_factory.mktemp("standalone")
    src = folder / "check.cpp"
    src.write_text(HARNESS)
    jobs = start_builds(folder, "check", lambda cxx, flags, exe: [
        cxx, "-O1", "-std=c++17", "-DEDGELLM_STANDALONE", *flags, str(src), str(KERNEL_SOURCE), "-o", str(exe)])
    yield jobs
    stop_builds(jobs)


def _run_standalone(jobs, name: str) -> str:
    import subprocess

    proc, exe, runner = jobs[name]
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok: 0 failures" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    return run.stdout


def test_portable_path_standalone(standalone_builds):
    if "scalar" not in standalone_builds:
        pytest.skip("no C++ compiler")
    assert _run_standalone(standalone_builds, "scalar").splitlines()[0] == "isa scalar"


@pytest.mark.parametrize("isa", ["neon", "neon-dotprod"])
def test_neon_path_under_qemu(standalone_builds, isa):
    if isa not in standalone_builds:
        pytest.skip("needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt: g++-aarch64-linux-gnu qemu-user-static)")
    assert _run_standalone(standalone_builds, isa).splitlines()[0] == f"isa {isa}"


def test_vnni_path_bit_identical_to_avx2(standalone_builds):
    """The AVX-512 VNNI build (vpdpbusd) gives the AVX2 build's results bit for bit: same integer block
    sums, same float order. Both also pass the fp64 bounds."""
    if "avx512vnni" not in standalone_builds:
        pytest.skip(VNNI_MISSING)
    avx2 = _run_standalone(standalone_builds, "avx2").splitlines()
    vnni = _run_standalone(standalone_builds, "avx512vnni").splitlines()
    assert avx2[0] == "isa avx2" and vnni[0] == "isa avx512vnni"
    assert avx2[1].startswith("digest ") and avx2[1] == vnni[1]


def test_activations_option_selects_the_kernel_variant():
    """`--activations` names the variants the tests above check; unknown names are refused."""
    from edgellm.kernels import matmul as K

    for name, variant in (("int8x2", INT_DOT_RESIDUAL), ("fp32", FLOAT_FMA), ("int8", 0)):
        assert K.KernelOptions(activations=name).variant == variant
        assert K.KernelOptions.from_names(name).variant == variant
    with pytest.raises(ValueError, match="int8x2"):
        K.KernelOptions(activations="int4")
