"""K-quant, Q5_0, Q5_1 and IQ4_NL rows repacked 8 at a time (kernels/cpu_gguf_x8.cpp) against gguf.quants.

- gguf_repack / gguf_unrepack: the x8 layout holds the stored blocks bit for bit (the round trip is the identity,
  and the repacked tensor dequantizes to gguf.quants.dequantize's floats exactly).
- gguf_linear on x8 parts: to 1e-5 of a float64 product of gguf.quants' weights with x rounded to int8 per 32
  values (numpy emulation, tests/test_gguf_kernels.py), with out_index, mixed with parts as stored, and each row
  bit-identical whatever M (speculative verification).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.test_cpu_kernels import ext  # noqa: F401  (the extension fixture, shared)
from tests.test_gguf_kernels import (L4_TYPES, TOL_EMULATED, TOL_EXACT, dequant_ref, emulate_int8_x, make_weights,
                                     rel_err, require_layout)

X8 = 1000
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS] + L4_TYPES  # (L4: the grid i-quants recoded)
BLOCK32 = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL]  # x8 per 32-value block: any K % 32 == 0
X8_TYPES = K_QUANTS + BLOCK32


@pytest.fixture
def x8_ext(ext):  # noqa: F811
    require_layout(ext, "x8", X8_TYPES)
    return ext


def k_for(qtype, k: int) -> int:
    """K-quants take k (a multiple of 256); the 32-value types k + 96 too (not a multiple of 256, as where files use them)."""
    return k + 96 if qtype in BLOCK32 else k


def repacked(ext, qtype, n, k, seed):
    raw = make_weights(qtype, n, k, seed)
    return raw, ext.gguf_repack(torch.from_numpy(raw), int(qtype), n, k)


def test_loader_knows_every_x8_layout(x8_ext):
    """The loader's table of x8 units (quant/gguf_linear.X8_UNITS: values and bytes per 8 rows) is the extension's:
    every type it repacks, at the size it writes."""
    from edgellm.quant.gguf_linear import X8_UNITS

    assert set(x8_ext.gguf_x8_types()) == set(X8_UNITS) == {int(t) for t in X8_TYPES}
    for t in X8_TYPES:
        values, unit_bytes = X8_UNITS[int(t)]
        k = k_for(t, 512) // values * values
        assert repacked(x8_ext, t, 8, k, seed=1)[1].numel() == k // values * unit_bytes, t.name


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_repack_round_trip_and_dequantize(x8_ext, qtype):
    n, k = 24, k_for(qtype, 768)
    raw, x8 = repacked(x8_ext, qtype, n, k, seed=int(qtype))
    assert x8.dtype == torch.uint8 and x8.shape[0] == n
    back = x8_ext.gguf_unrepack(x8, int(qtype), n, k).numpy()
    np.testing.assert_array_equal(back, raw)
    got = x8_ext.gguf_dequantize(x8.reshape(-1), int(qtype) + X8, n, k).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), dequant_ref(raw, qtype).view(np.uint32))
    bf16 = x8_ext.gguf_dequantize(x8.reshape(-1), int(qtype) + X8, n, k, torch.empty(n, k, dtype=torch.bfloat16))
    assert torch.equal(bf16, torch.from_numpy(dequant_ref(raw, qtype)).to(torch.bfloat16))  # the AMX prefill's


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (3, 16, 512), (5, 40, 2304), (16, 8, 1024)])
def test_linear_matches_reference(x8_ext, qtype, m, n, k):
    k = k_for(qtype, k)
    raw, x8 = repacked(x8_ext, qtype, n, k, seed=int(qtype) * 100 + m + n + k)
    w = dequant_ref(raw, qtype).astype(np.float64)
    x = np.random.default_rng(m + n).standard_normal((m, k)).astype(np.float32)
    y = x8_ext.gguf_linear(torch.from_numpy(x), [(x8, int(qtype) + X8, n, None)], n).numpy()
    assert rel_err(y, emulate_int8_x(x) @ w.T) <= TOL_EMULATED
    assert rel_err(y, x.astype(np.float64) @ w.T) <= TOL_EXACT


def test_parts_with_out_index_and_stored_tail(x8_ext):
    """A fused Q/K/V as the loader makes it: x8 parts routed by out_index, and a part's last N % 8 rows as stored."""
    k = 512
    raw_a, x8_a = repacked(x8_ext, Q.Q4_K, 16, k, seed=1)
    raw_b = make_weights(Q.Q6_K, 13, k, seed=2)
    x8_b = x8_ext.gguf_repack(torch.from_numpy(raw_b[:8].copy()), int(Q.Q6_K), 8, k)
    n = 29
    cols = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    parts = [(x8_a, int(Q.Q4_K) + X8, 16, cols[:16].contiguous()),
             (x8_b, int(Q.Q6_K) + X8, 8, cols[16:24].contiguous()),
             (torch.from_numpy(raw_b[8:].copy()), int(Q.Q6_K), 5, cols[24:].contiguous())]
    w_stored = np.concatenate([dequant_ref(raw_a, Q.Q4_K), dequant_ref(raw_b, Q.Q6_K)]).astype(np.float64)
    w = np.empty_like(w_stored)
    w[cols.numpy()] = w_stored
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    y = x8_ext.gguf_linear(torch.from_numpy(x), parts, n).numpy()
    assert rel_err(y, emulate_int8_x(x) @ w.T) <= TOL_EMULATED


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_rows_bit_identical_whatever_m(x8_ext, qtype):
    n, k = 40, k_for(qtype, 1536)
    _, x8 = repacked(x8_ext, qtype, n, k, seed=7)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(int(qtype)))
    parts = [(x8, int(qtype) + X8, n, None)]
    singles = torch.stack([x8_ext.gguf_linear(x[i:i + 1], parts, n)[0] for i in range(17)])
    for m in range(1, 18):
        assert torch.equal(x8_ext.gguf_linear(x[:m], parts, n), singles[:m]), (qtype.name, m)


def test_bad_arguments_raise(x8_ext):
    raw = torch.from_numpy(make_weights(Q.Q4_K, 12, 256, seed=3))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        x8_ext.gguf_repack(raw, int(Q.Q4_K), 12, 256)
    with pytest.raises(RuntimeError, match="no x8 kernels"):
        x8_ext.gguf_repack(raw, int(Q.Q8_0), 12, 256)
    with pytest.raises(RuntimeError, match="of 256"):  # a K-quant's rows are whole super-blocks
        x8_ext.gguf_repack(raw[:8].contiguous(), int(Q.Q4_K), 8, 320)
    x8 = x8_ext.gguf_repack(raw[:8].contiguous(), int(Q.Q4_K), 8, 256)
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        x8_ext.gguf_linear(torch.randn(1, 256), [(x8.reshape(-1)[:x8.numel() // 8 * 4], int(Q.Q4_K) + X8, 4, None)], 4)


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 9, 17, 64, 200])
def test_prompt_gemm_takes_x8_parts(x8_ext, qtype, m):
    """gguf_linear_prompt on x8 parts (the panel GEMM, its panels built from the x8 groups), with out_index, a
    partial last panel (N = 24: 1.5 panels of 16 rows on AVX-512), against the float64 reference."""
    n, k = 24, k_for(qtype, 512)
    raw, x8 = repacked(x8_ext, qtype, n, k, seed=m)
    cols = torch.randperm(n, generator=torch.Generator().manual_seed(m)).to(torch.int32)
    w = np.empty((n, k))
    w[cols.numpy()] = dequant_ref(raw, qtype)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = x8_ext.gguf_linear_prompt(torch.from_numpy(x), [(x8, int(qtype) + X8, n, cols)], n).numpy()
    assert rel_err(y, emulate_int8_x(x) @ w.T) <= TOL_EMULATED


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_prompt_gemm_x8_columns_permuted_within_a_panel(x8_ext, qtype):
    """An x8 part's output columns follow its stored rows: a panel whose columns are a run at both ends but not in
    between (0, 2, 1, 3, ...: the first and last as a run would have them) is written column by column, not as a
    run (it was, from a check of the ends alone: a random permutation found it)."""
    n, k, m = 32, 512, 24
    raw, x8 = repacked(x8_ext, qtype, n, k, seed=11)
    order = np.arange(n)
    order[1::8], order[2::8] = order[2::8].copy(), order[1::8].copy()  # per 8 rows (a panel: 8 or 16)
    cols = torch.from_numpy(order.astype(np.int32))
    w = np.empty((n, k))
    w[order] = dequant_ref(raw, qtype)
    x = np.random.default_rng(11).standard_normal((m, k)).astype(np.float32)
    y = x8_ext.gguf_linear_prompt(torch.from_numpy(x), [(x8, int(qtype) + X8, n, cols)], n).numpy()
    assert rel_err(y, emulate_int8_x(x) @ w.T) <= TOL_EMULATED


def test_loader_releases_only_the_copied_rows(x8_ext):
    """repack_for_cpu on a K-quant part of 13 rows: the first 8 in x8, the last 5 left as stored, in place; only the
    copied rows' blocks are handed to `release` (the loader drops their mapped pages), never the stored tail's."""
    from edgellm.quant.gguf_linear import GGUFPart, repack_for_cpu

    k = 512
    raw = torch.from_numpy(make_weights(Q.Q4_K, 13, k, seed=4))
    released = []
    parts = repack_for_cpu([GGUFPart(raw, int(Q.Q4_K), 13)], k, released.append)
    assert [(p.type, p.rows) for p in parts] == [(int(Q.Q4_K) + X8, 8), (int(Q.Q4_K), 5)]
    assert parts[1].raw.data_ptr() == raw[8:].data_ptr()  # the tail used where it lies
    assert len(released) == 1 and released[0].data_ptr() == raw.data_ptr() and released[0].shape[0] == 8
