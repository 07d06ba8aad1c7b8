"""The prefill's one-pass RMSNorm and gated MLP activation (kernels/cpu_pointwise.cpp) against float64 torch."""
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
