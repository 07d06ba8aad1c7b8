"""The prefill's one-pass RMSNorm and gated MLP activation (kernels/cpu_pointwise.cpp) against float64 torch."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edgellm.kernels import matmul, pointwise


def ext_or_skip():
    ext = matmul.cpu_extension()
    if ext is None:
        pytest.skip("no C++ compiler here: the model's torch ops serve")
    return ext


# widths around the 8- and 16-lane loops, one row and a prompt chunk's worth
@pytest.mark.parametrize("rows", [1, 3, 512])
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 576, 2048])
def test_rms_norm_against_float64(rows, n):
    ext = ext_or_skip()
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, n, generator=gen) * 5
    w = torch.randn(n, generator=gen)
    ref = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-6) * w.double()
    out = ext.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape
    assert torch.allclose(out.double(), ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("hidden", [1, 9, 16, 1536])
def test_gated_activation_against_float64(gelu, hidden):
    ext = ext_or_skip()
    gen = torch.Generator().manual_seed(hidden + gelu)
    gate_up = torch.randn(1, 37, 2 * hidden, generator=gen) * 6
    gate_up[0, 0, :hidden] = torch.linspace(-120, 120, hidden)  # the exp's clamped ends
    g, u = gate_up.double().split(hidden, -1)
    ref = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u
    out = ext.gated_mlp(gate_up, gelu)
    assert out.shape == (1, 37, hidden)
    assert torch.allclose(out.double(), ref, rtol=3e-6, atol=1e-5)


def test_model_paths_take_them_and_match_the_torch_ops():
    """RMSNorm / FeedForward of the model on fp32 CPU tensors go through the C++ pass, and agree with the torch ops
    they replace (pointwise.ENABLED = False)."""
    ext_or_skip()
    from edgellm.config import ModelConfig
    from edgellm.model import FeedForward, RMSNorm

    cfg = ModelConfig(arch="llama", vocab_size=64, dim=48, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=80,
                      norm_eps=1e-5)
    torch.manual_seed(0)
    norm, ffn = RMSNorm(48, 1e-5), FeedForward(cfg)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(1, 33, 48)
    with torch.inference_mode():
        assert pointwise.rms_norm(x, norm.weight, 1e-5) is not None
        assert pointwise.gated_activation(torch.randn(2, 160), False) is not None
        fused = norm(x), ffn(x)
        pointwise.ENABLED = False
        try:
            plain = norm(x), ffn(x)
        finally:
            pointwise.ENABLED = True
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_the_torch_ops():
    ext_or_skip()
    assert pointwise.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-5) is None
    assert pointwise.gated_activation(torch.randn(2, 8, dtype=torch.float64), False) is None


POINTWISE_HARNESS = r"""
// Standalone check of cpu_pointwise.cpp on a build of its own (portable, AVX2, NEON under qemu) against double math.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>
namespace edgellm {
void parallel_run(int64_t b, int64_t e, int64_t, const std::function<void(int64_t, int64_t)>& f) { if (b < e) f(b, e); }
void gated_mlp(const float* gu, int64_t M, int64_t H, bool gelu, float* y);
void rms_norm(const float* x, const float* w, int64_t M, int64_t N, float eps, float* y);
}
int main() {
  int failures = 0;
  uint64_t s = 88172645463325252ull;
  auto rnd = [&]() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return (double)(s >> 11) / 9007199254740992.0 * 2 - 1; };
  for (int64_t n : {1, 7, 8, 17, 576}) {
    const int64_t M = 3;
    std::vector<float> x(M * n), w(n), y(M * n), gu(M * 2 * n), g(M * n);
    for (auto& v : x) v = (float)(8 * rnd());
    for (auto& v : w) v = (float)rnd();
    for (auto& v : gu) v = (float)(20 * rnd());
    edgellm::rms_norm(x.data(), w.data(), M, n, 1e-6f, y.data());
    for (int64_t m = 0; m < M; ++m) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += (double)x[m * n + i] * x[m * n + i];
      const double inv = 1 / std::sqrt(ss / n + 1e-6);
      for (int64_t i = 0; i < n; ++i)
        if (std::fabs(y[m * n + i] - w[i] * x[m * n + i] * inv) > 2e-6 * (1 + std::fabs(w[i] * x[m * n + i] * inv))) ++failures;
    }
    for (int gelu = 0; gelu < 2; ++gelu) {
      edgellm::gated_mlp(gu.data(), M, n, gelu, g.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < n; ++i) {
          const double a = gu[m * 2 * n + i], u = gu[m * 2 * n + n + i];
          const double act = gelu ? 0.5 * a * (1 + std::tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))
                                  : a / (1 + std::exp(-a));
          if (std::fabs(g[m * n + i] - act * u) > 3e-6 * (1 + std::fabs(act * u))) ++failures;
        }
    }
  }
  std::printf("ok: %d failures\n", failures);
  return failures != 0;
}
"""


@pytest.mark.parametrize("build", ["scalar", "avx2", "neon"])
def test_pointwise_builds_standalone(tmp_path, build):
    """The portable loops (NEON builds run them too) and the AVX2 ones, each a build of its own."""
    import subprocess

    from edgellm.kernels import cpu_ext
    from tests.test_cpu_kernels import standalone_plan

    plan = standalone_plan()
    if build not in plan:
        pytest.skip(f"no {build} build on this machine (needs the compiler / CPU / aarch64 cross compiler and qemu)")
    compiler, flags, runner = plan[build]
    src = tmp_path / "check.cpp"
    src.write_text(POINTWISE_HARNESS)
    exe = tmp_path / "check"
    source = Path(cpu_ext.__file__).resolve().parent / "cpu_pointwise.cpp"
    subprocess.run([compiler, "-O1", "-std=c++17", *flags, str(src), str(source), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok: 0 failures" in run.stdout, run.stdout + run.stderr
