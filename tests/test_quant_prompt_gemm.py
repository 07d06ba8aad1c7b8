"""Prefill of edgellm's own int8 / int4 weights through the int8 prompt GEMM (`ext.quant_linear_prompt`,
kernels/cpu_gguf.cpp "prompt GEMM" over the quant/groups.py layout) against an independent reference.

Reference, in float64 from the inputs alone: the weight dequantized by the torch reference (`quant.groups.dequantize`,
the format's definition) times x rounded to int8 per 32 values as the kernels document it
(tests/test_gguf_prompt_gemm.int8_x): only fp32 summation order separates the two. Every format (int8, int4
symmetric / asymmetric), group sizes 32 / 64 / 128 and int8 per channel, M across the microkernel's row blocks, N not
a multiple of the panel width, K not a multiple of 256; long prompts that split K into blocks; and the module
dispatch (QuantLinear: decode sizes on the int kernel, prefills on the prompt GEMM where it is vectorized).
The standalone ISA builds (portable, AVX2, AVX-512 VNNI, NEON) run the same function in
tests/test_gguf_prompt_gemm.py's harness.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edgellm.kernels import gguf_ops, matmul
from edgellm.quant.groups import dequantize, quantize
from tests.test_cpu_kernels import ext  # noqa: F401  (the extension fixture)
from tests.test_gguf_prompt_gemm import amx_or_skip, assert_rows_close, int8_x

NO_MINS = torch.empty(0, dtype=torch.float16)
FORMATS = [(8, True, 32), (8, True, 64), (8, True, 128), (4, True, 32), (4, True, 128), (4, False, 32),
           (4, False, 64)]


def _weights(bits, sym, group, n, k, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0, :32] *= 40.0  # one loud group: codes at the ends of their range
    return quantize(w, bits, group, symmetric=sym, search=False)


def _reference(x: torch.Tensor, qt) -> np.ndarray:
    return int8_x(x.numpy()) @ dequantize(qt).double().numpy().T


def _run(ext, x, qt):
    mins = NO_MINS if qt.mins is None else qt.mins
    return ext.quant_linear_prompt(x, qt.codes, qt.scales, mins, qt.group_size, qt.bits)


@pytest.mark.parametrize("bits,sym,group", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [17, 33, 100])
def test_matches_reference(ext, bits, sym, group, m):
    for k in (384, 1024):
        n = 45
        qt = _weights(bits, sym, group, n, k, seed=bits * 100 + group + m + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
        assert_rows_close(_run(ext, x, qt).numpy(), _reference(x, qt), (bits, sym, group, m, k))


def test_int8_per_channel_and_several_blocks_of_k(ext):
    """int8 with one scale per row (group = K), and a 600-row prompt whose K is split into blocks."""
    k = 4384
    qt = _weights(8, True, k, 20, k, seed=1)
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(1))
    assert_rows_close(_run(ext, x, qt).numpy(), _reference(x, qt), "per channel")
    qt4 = _weights(4, False, 32, 20, k, seed=2)
    assert_rows_close(_run(ext, x, qt4).numpy(), _reference(x, qt4), "int4 asym, blocks of K")


def test_close_to_the_int_kernel(ext):
    """The same int8 activations and integer sums as the decode kernels (int{4,8}_gemm_variant), summed in another
    order: the prefill agrees with what the same rows would give one at a time."""
    k, n, m = 1536, 72, 40
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    for bits, sym in ((8, True), (4, True), (4, False)):
        qt = _weights(bits, sym, 32, n, k, seed=bits)
        mins = NO_MINS if qt.mins is None else qt.mins
        if bits == 8:
            kernel = ext.int8_gemm_variant(x, qt.codes, qt.scales, 32, 0)
        else:
            kernel = ext.int4_gemm_variant(x, qt.codes, qt.scales, mins, 32, 0)
        assert_rows_close(_run(ext, x, qt).numpy(), kernel.double().numpy(), (bits, sym))


@pytest.mark.parametrize("bits,sym,group", FORMATS, ids=lambda v: str(v))
def test_amx_is_the_bf16_product(ext, bits, sym, group):
    """quant_linear_prompt(..., amx=True): x and the dequantized weight (the format's torch definition) rounded to
    bf16, summed in fp32, against that product in float64; short and long prompts (K in several blocks)."""
    amx_or_skip(ext)
    for m, k in ((64, 384), (100, 1024), (600, 4352)):
        n = 45
        qt = _weights(bits, sym, group, n, k, seed=bits * 10 + group + m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
        xb, w = x.to(torch.bfloat16).double(), dequantize(qt).to(torch.bfloat16).double()
        want = xb @ w.T
        mins = NO_MINS if qt.mins is None else qt.mins
        y = ext.quant_linear_prompt(x, qt.codes, qt.scales, mins, qt.group_size, qt.bits, True)
        err, bound = (y.double() - want).abs().max().item(), 1e-6 * (xb.abs() @ w.abs().T).max().item()
        assert err <= bound, (bits, sym, group, m, k, err, bound)


def test_amx_unavailable_says_so(ext):
    qt = _weights(4, True, 32, 8, 256, seed=0)
    if matmul.amx_kernels(ext):
        pytest.skip("this CPU has AMX (the kernel runs: test_amx_is_the_bf16_product)")
    with pytest.raises(RuntimeError, match="no AMX here"):
        ext.quant_linear_prompt(torch.randn(70, 256), qt.codes, qt.scales, NO_MINS, 32, 4, True)


@pytest.mark.parametrize("bad", ["bits", "codes", "group", "scales", "mins"])
def test_bad_arguments_raise(ext, bad):
    qt = _weights(4, False, 32, 8, 256, seed=0)
    x = torch.randn(20, 256)
    calls = {
        "bits": lambda: ext.quant_linear_prompt(x, qt.codes, qt.scales, qt.mins, 32, 5),
        "codes": lambda: ext.quant_linear_prompt(x, qt.codes, qt.scales, qt.mins, 32, 8),
        "group": lambda: ext.quant_linear_prompt(x, qt.codes, qt.scales, qt.mins, 48, 4),
        "scales": lambda: ext.quant_linear_prompt(x, qt.codes, qt.scales[:4], qt.mins, 32, 4),
        "mins": lambda: ext.quant_linear_prompt(x, qt.codes, qt.scales, qt.mins[:4], 32, 4),
    }
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        calls[bad]()


def test_quant_linear_takes_each_path(ext, monkeypatch):
    """QuantLinear: decode sizes (<= 16 rows) give the int kernel's bits, a prefill the prompt GEMM's where it is
    vectorized, 70 rows the AMX kernel's where it runs; AMX_GEMM and QUANT_PROMPT_GEMM False keep the path before
    them (the int kernel, at 24 rows, in the vector builds)."""
    from edgellm.quant.linear import QuantLinear

    k, n = 576, 40
    qt = _weights(4, False, 32, n, k, seed=5)
    lin = QuantLinear(qt)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(5))  # below gguf_ops.AMX_MIN_ROWS
    assert 16 < x.shape[0] < gguf_ops.AMX_MIN_ROWS
    monkeypatch.setattr(matmul, "cpu_extension", lambda: ext)
    monkeypatch.setitem(matmul._cpu_ext_state, "ext", ext)
    with torch.no_grad():
        assert torch.equal(lin(x[:16]), ext.int4_gemm_variant(x[:16], qt.codes, qt.scales, qt.mins, 32, 0))
        y = lin(x)
    # (an AVX2 build beside a native bf16 GEMM, as EDGELLM_EXT_ISA=avx2 on an AMX host, keeps prefills on
    # dequantize + the bf16 GEMM: PREFILL_KERNEL_MAX_M has no row for it; no AVX2-only CPU has such a GEMM)
    avx2_beside_bf16 = ext.isa() in ("avx2", "avx2vnni") and matmul.DEFAULT_OPTIONS.dense_bf16(4)
    if ext.gguf_prompt_gemm_fast() and not matmul.DEFAULT_OPTIONS.dense_bf16(4):
        assert torch.equal(y, _run(ext, x, qt))
    if avx2_beside_bf16:  # its rounding is bf16's, not int8 activations'
        ref = x.double() @ dequantize(qt).double().T
        assert ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-2
    else:
        assert_rows_close(y.numpy(), _reference(x, qt), "module")
    if matmul.amx_kernels(ext):  # from AMX_MIN_ROWS rows on: the AMX kernel
        x70 = torch.randn(70, k, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            assert torch.equal(lin(x70), ext.quant_linear_prompt(x70, qt.codes, qt.scales, qt.mins, 32, 4, True))
    monkeypatch.setattr(gguf_ops, "AMX_GEMM", False)
    monkeypatch.setattr(matmul, "QUANT_PROMPT_GEMM", False)
    if ext.isa() in ("avx2", "avx2vnni", "avx512vnni") and not avx2_beside_bf16:
        with torch.no_grad():
            assert torch.equal(lin(x), ext.int4_gemm_variant(x, qt.codes, qt.scales, qt.mins, 32, 0))
