"""Q5_0 / Q5_1 rows with their runs of 8 blocks regrouped (the r8 layout, kernels/cpu_gguf.cpp) against gguf.quants
and against the same blocks as stored.

- gguf_repack_r8 / gguf_unrepack_r8: the layout holds the stored blocks bit for bit (the round trip is the identity,
  the blocks after a row's last chunk of 8 untouched), and the r8 tensor dequantizes to gguf.quants' floats exactly.
- gguf_linear (decode, verification) on r8 parts: bit-identical to the same product on the stored blocks, at every
  M across the row kernel's tiles: the regrouping changes how the codes are decoded, not one integer sum.
- gguf_linear_prompt (the panel GEMM) on r8 parts with out_index: to 1e-5 of a float64 product of gguf.quants'
  weights with x rounded to int8 per 32 values (tests/test_gguf_kernels.py's emulation).
- The loader gives a GGUF's Q5_0 / Q5_1 linears the x8 layout (tests/test_gguf_x8.py) for their rows in groups of
  8 and the r8 layout for the rest, where the build multiplies them; with Q5_LAYOUT = "r8", r8 for all.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.test_cpu_kernels import ext  # noqa: F401  (the extension fixture, shared)
from tests.test_gguf_kernels import TOL_EMULATED, dequant_ref, emulate_int8_x, make_weights, rel_err, require_layout
from tests.test_gguf_x8 import X8_TYPES

R8 = 2000
R8_TYPES = [Q.Q5_0, Q.Q5_1]
# K: 2 chunks and 2 stored blocks (SmolLM2's 576), whole chunks, fewer than a chunk
SHAPES = [(5, 576), (16, 1536), (3, 96)]


@pytest.fixture
def r8_ext(ext):  # noqa: F811
    require_layout(ext, "r8", R8_TYPES)
    return ext


def regrouped(ext, qtype, n, k, seed):
    raw = make_weights(qtype, n, k, seed)
    return raw, ext.gguf_repack_r8(torch.from_numpy(raw), int(qtype), n, k)


@pytest.mark.parametrize("qtype", R8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_round_trip_and_dequantize(r8_ext, qtype, n, k):
    raw, r8 = regrouped(r8_ext, qtype, n, k, seed=n + k)
    assert r8.dtype == torch.uint8 and tuple(r8.shape) == raw.shape
    full = k // 256 * 8 * (raw.shape[1] // (k // 32))  # bytes of a row's full chunks (8 blocks each)
    assert np.array_equal(r8.numpy()[:, full:], raw[:, full:])  # the tail blocks as stored
    if full:
        assert not np.array_equal(r8.numpy()[:, :full], raw[:, :full])
    np.testing.assert_array_equal(r8_ext.gguf_unrepack_r8(r8, int(qtype), n, k).numpy(), raw)
    got = r8_ext.gguf_dequantize(r8.reshape(-1), int(qtype) + R8, n, k).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), dequant_ref(raw, qtype).view(np.uint32))
    bf16 = r8_ext.gguf_dequantize(r8.reshape(-1), int(qtype) + R8, n, k, torch.empty(n, k, dtype=torch.bfloat16))
    assert torch.equal(bf16, torch.from_numpy(dequant_ref(raw, qtype)).to(torch.bfloat16))  # the AMX prefill's


@pytest.mark.parametrize("qtype", R8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_bit_identical_to_stored_blocks(r8_ext, qtype, n, k):
    raw, r8 = regrouped(r8_ext, qtype, n, k, seed=3 * n + k)
    stored = [(torch.from_numpy(raw), int(qtype), n, None)]
    parts = [(r8, int(qtype) + R8, n, None)]
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(k))
    for m in (1, 2, 3, 4, 5, 8, 17):
        assert torch.equal(r8_ext.gguf_linear(x[:m], parts, n), r8_ext.gguf_linear(x[:m], stored, n)), (m, n, k)
    w = dequant_ref(raw, qtype).astype(np.float64)
    y = r8_ext.gguf_linear(x[:3], parts, n).numpy()
    assert rel_err(y, emulate_int8_x(x[:3].numpy()) @ w.T) <= TOL_EMULATED


@pytest.mark.parametrize("qtype", R8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [9, 40, 200])
@pytest.mark.parametrize("n,k", SHAPES)
def test_prompt_gemm_takes_r8_parts(r8_ext, qtype, m, n, k):
    raw, r8 = regrouped(r8_ext, qtype, n, k, seed=m + n)
    cols = torch.randperm(n, generator=torch.Generator().manual_seed(m)).to(torch.int32)
    w = np.empty((n, k))
    w[cols.numpy()] = dequant_ref(raw, qtype)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = r8_ext.gguf_linear_prompt(torch.from_numpy(x), [(r8, int(qtype) + R8, n, cols)], n).numpy()
    assert rel_err(y, emulate_int8_x(x) @ w.T) <= TOL_EMULATED


def test_bad_arguments_raise(r8_ext):
    raw = torch.from_numpy(make_weights(Q.Q5_0, 4, 256, seed=1))
    with pytest.raises(RuntimeError, match="no r8 kernels"):
        r8_ext.gguf_repack_r8(raw, int(Q.Q4_0), 4, 256)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        r8_ext.gguf_repack_r8(raw[:3].contiguous(), int(Q.Q5_0), 4, 256)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        r8_ext.gguf_repack_r8(raw, int(Q.Q5_0), 4, 250)


def q5_linear_parts(k: int):
    """A fused linear as the loader sees it: Q5_0 (12 rows), Q4_0 (8), Q5_1 (7), routed by a shuffled out_index."""
    from edgellm.quant.gguf_linear import GGUFPart

    raws = [make_weights(t, n, k, seed=i) for i, (t, n) in enumerate(((Q.Q5_0, 12), (Q.Q4_0, 8), (Q.Q5_1, 7)))]
    cols = torch.randperm(27, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    parts = [GGUFPart(torch.from_numpy(raws[0]), int(Q.Q5_0), 12, cols[:12].contiguous()),
             GGUFPart(torch.from_numpy(raws[1]), int(Q.Q4_0), 8, cols[12:20].contiguous()),
             GGUFPart(torch.from_numpy(raws[2]), int(Q.Q5_1), 7, cols[20:].contiguous())]
    w = np.empty((27, k))
    w[cols.numpy()] = np.concatenate([dequant_ref(r, t) for r, t in zip(raws, (Q.Q5_0, Q.Q4_0, Q.Q5_1))])
    return parts, w


def test_loader_regroups_q5_linears(r8_ext, monkeypatch):
    """repack_for_cpu with Q5_LAYOUT = "r8": Q5_0 / Q5_1 parts become r8 parts of the same rows and out_index, other
    types keep theirs, and the layer's product is unchanged bit for bit."""
    from edgellm.quant import gguf_linear
    from edgellm.quant.gguf_linear import GGUFLinear, repack_for_cpu

    monkeypatch.setattr(gguf_linear, "Q5_LAYOUT", "r8")
    k = 576
    parts, _ = q5_linear_parts(k)
    released = []
    repacked = repack_for_cpu(parts, k, released.append)
    assert [p.type for p in repacked] == [int(Q.Q5_0) + R8, int(Q.Q4_0), int(Q.Q5_1) + R8]
    assert [p.rows for p in repacked] == [12, 8, 7] and len(released) == 2
    assert all(torch.equal(a.out_index, b.out_index) for a, b in zip(parts, repacked))
    before, after = GGUFLinear(parts, k), GGUFLinear(repacked, k)
    assert after.type_names() == ["Q5_0", "Q4_0", "Q5_1"]
    x = torch.randn(1, 3, k, generator=torch.Generator().manual_seed(1))
    assert torch.equal(before(x), after(x))


@pytest.mark.parametrize("m", [3, 40])
def test_loader_interleaves_q5_linears(r8_ext, m, monkeypatch):
    """repack_for_cpu as loaded (Q5_LAYOUT = "x8" where the build has it): a Q5_0 part's first 8 rows in the x8
    layout and its last 4 in r8, Q5_1's 7 rows (no group of 8) in r8, Q4_0 as stored; every originally mapped
    part whose rows were all copied released; the product (row kernel at M = 3, prompt GEMM at 40) against the
    float64 reference."""
    from edgellm.kernels import gguf_ops
    from edgellm.quant import gguf_linear
    monkeypatch.setattr(gguf_ops, "AMX_GEMM", False)  # 40 rows: the prompt GEMM (AMX CPUs: the AMX kernel's tests)
    from edgellm.quant.gguf_linear import X8, GGUFLinear, repack_for_cpu

    require_layout(r8_ext, "x8", X8_TYPES)
    assert gguf_linear.Q5_LAYOUT == "x8"
    k = 896
    parts, w = q5_linear_parts(k)
    released = []
    repacked = repack_for_cpu(parts, k, released.append)
    assert [p.type for p in repacked] == [int(Q.Q5_0) + X8, int(Q.Q5_0) + R8, int(Q.Q4_0), int(Q.Q5_1) + R8]
    assert [p.rows for p in repacked] == [8, 4, 8, 7] and len(released) == 2
    index = torch.cat([p.out_index for p in repacked])
    assert torch.equal(index, torch.cat([p.out_index for p in parts]))
    layer = GGUFLinear(repacked, k)
    assert layer.type_names() == ["Q5_0", "Q5_0", "Q4_0", "Q5_1"]
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = layer(torch.from_numpy(x)).numpy()
    assert rel_err(y, emulate_int8_x(x) @ w.T) <= TOL_EMULATED
