"""The C++ GGUF kernels (kernels/cpu_gguf.cpp) against gguf.quants, the GGUF reference in numpy.

- gguf_dequantize must equal gguf.quants.dequantize bit for bit.
- gguf_linear rounds each 32 values of x to int8 (one fp32 scale, as the int4/int8 kernels do), so it is
  checked twice: to 1e-5 against a float64 product of the dequantized weights with x rounded that way
  (emulated here in numpy: only fp32 summation order separates the two), and to 1e-2 against the exact fp32 x
  (the int8 rounding's own error, ~0.5% on Gaussian x).
Weights: the 32-block types quantized from random floats by gguf.quants.quantize; the K-quants (which this gguf
version cannot quantize) as random valid blocks: random bytes with small positive fp16 d / dmin.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants

from edgellm.kernels import cpu_ext
from tests.test_cpu_kernels import VNNI_MISSING, ext, start_builds, stop_builds  # noqa: F401  (ext: the extension fixture, shared)

class L4:
    """A grid i-quant's blocks recoded as IQ4_XS blocks over its levels (kernels/cpu_gguf.h GGUF_L4, type id + 100;
    IQ2_XS / IQ2_S / IQ1_M: the L4-per-16 blocks, a scale per 16 values), as the loader runs them on the CPU: made from random
    blocks of the base type by the extension's converter, and dequantized for the references by l4_dequant below
    (numpy, from the documented layout)."""

    def __init__(self, base: Q):
        self.base, self.name = base, base.name + "_L4"

    def __int__(self) -> int:
        return 100 + int(self.base)


GRID_IQUANTS = {Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ3_S}  # codebook types (kernels/gguf_grids.h), stored layout only
L4_TYPES = [L4(t) for t in (Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M)]
L4_PER16 = {Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M}  # (their L4 form's base types)
GGUF_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS,
              Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ3_S]
TYPES = GGUF_TYPES + L4_TYPES
# the types of 256-value super-blocks
K_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS} | GRID_IQUANTS | set(L4_TYPES)
# the 256-value types with an x8 layout (cpu_gguf_x8.cpp)
X8_K_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS} | set(L4_TYPES)
# every type with an x8 layout (cpu_gguf_x8.cpp) in the AVX2 / AVX-512 VNNI builds, and in no other
X8_ANY = X8_K_QUANTS | {Q.Q5_0, Q.Q5_1, Q.IQ4_NL}
X8_BUILDS = ("avx2", "avx2vnni", "avx512vnni")  # the builds with the x8 layout (cpu_gguf_x8.cpp)
TOL_EMULATED = 1e-5
TOL_EXACT = 1e-2


# ------------------------------------------------------------------------------------------------ weights
def _f16_bytes(rng, n, lo, hi) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def make_weights(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes]: n rows of k values as GGUF blocks of type qtype."""
    if isinstance(qtype, L4):
        from edgellm.kernels import matmul

        ext = matmul.cpu_extension()
        if ext is None:
            pytest.skip("the L4 blocks are made by the C++ extension, not built here")
        from edgellm.quant import gguf_grid

        raw = make_weights(qtype.base, n, k, seed)
        # (IQ1_S, IQ1_M, IQ2_XS, IQ2_S: gguf.quants' tables; the other types' codebooks are the extension's own)
        return ext.gguf_to_l4(torch.from_numpy(raw), int(qtype.base), n, k, **gguf_grid.l4_tables(int(qtype.base))).numpy()
    rng = np.random.default_rng(seed)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if qtype not in K_QUANTS | {Q.IQ4_NL, Q.IQ1_S} | L4_PER16:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return quants.quantize(w, qtype)
    nb = n * k // block_values
    raw = rng.integers(0, 256, (nb, block_bytes), dtype=np.uint8)
    if qtype == Q.IQ1_M:  # its fp16 d lies in its scales' top nibbles
        from tests.fixtures.tiny import set_iq1_m_d

        set_iq1_m_d(raw, float(rng.uniform(1e-4, 2e-3)))
    elif qtype == Q.Q6_K:
        raw[:, 208:210] = _f16_bytes(rng, nb, 1e-4, 2e-3)  # d; scales int8 random (signed)
    elif qtype == Q.Q3_K:
        raw[:, 108:110] = _f16_bytes(rng, nb, 1e-3, 2e-2)  # d; 6-bit scales (minus 32) and codes random
    elif qtype in (Q.IQ4_NL, Q.IQ4_XS, Q.IQ1_S) or qtype in GRID_IQUANTS | L4_PER16:
        # d; IQ4_XS's 6-bit scales (minus 32), the grid types' scales, grid indices and sign bits, all codes random
        raw[:, 0:2] = _f16_bytes(rng, nb, 1e-4, 2e-3)
    elif qtype == Q.Q2_K:
        raw[:, 80:82] = _f16_bytes(rng, nb, 1e-3, 2e-2)  # d
        raw[:, 82:84] = _f16_bytes(rng, nb, 1e-4, 2e-3)  # dmin; 4-bit scales and mins, codes random
    else:
        raw[:, 0:2] = _f16_bytes(rng, nb, 1e-4, 2e-3)  # d
        raw[:, 2:4] = _f16_bytes(rng, nb, 1e-4, 2e-3)  # dmin
    return raw.reshape(n, k // block_values * block_bytes)


def l4_dequant(raw: np.ndarray, qtype: L4) -> np.ndarray:
    """L4 blocks (IQ4_XS's layout: d fp16, the 6-bit scales' high bits u16 and low nibbles, 128 bytes of codes, low
    nibble value l, high l + 16 of each 32) -> fp32 as gguf.quants computes the base type: ((d m) 2^-p) level.
    L4 per 16 (IQ2_XS, IQ2_S, IQ1_M): d fp16, 16 int8 multipliers m (one per 16 values), then the same 128 bytes of
    codes."""
    levels = {"IQ2_XXS": (8, 25, 43), "IQ3_XXS": (4, 12, 20, 28, 36, 44, 52, 62),
              "IQ3_S": (1, 3, 5, 7, 9, 11, 13, 15), "IQ1_S": (1, 7, 9), "IQ2_XS": (8, 25, 43),
              "IQ2_S": (8, 25, 43), "IQ1_M": (1, 7, 9)}[qtype.base.name]  # IQ1_S / IQ1_M: 8 (g +- 1/8)
    table = np.array(list(levels) + [0] * (8 - len(levels)) + [-v for v in levels] + [0] * (8 - len(levels)),
                     dtype=np.float32)
    if qtype.base in L4_PER16:
        blk = np.asarray(raw).reshape(-1, 146)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
        m = blk[:, 2:18].copy().view(np.int8).astype(np.float32)  # [nb, 16]
        qs = blk[:, 18:].reshape(-1, 8, 16)
        codes = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(-1, 16, 16)  # [nb, 16 values' group, 16]
        return (((d * m) * np.float32(0.125))[:, :, None] * table[codes]).reshape(raw.shape[0], -1)
    blk = np.asarray(raw).reshape(-1, 136)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    high = blk[:, 2:4].copy().view(np.uint16).astype(np.int32)
    low = np.stack((blk[:, 4:8] & 15, blk[:, 4:8] >> 4), axis=-1).reshape(-1, 8).astype(np.int32)
    m = (low | (((high >> (2 * np.arange(8))) & 3) << 4)) - 32  # [nb, 8]
    p = {"IQ2_XXS": np.float32(0.125), "IQ3_XXS": np.float32(0.25), "IQ3_S": np.float32(1.0),
         "IQ1_S": np.float32(0.125)}[qtype.base.name]
    scale = (d * m.astype(np.float32)) * p
    qs = blk[:, 8:].reshape(-1, 8, 16)
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1)  # [nb, 8, 32]
    return (scale[:, :, None] * table[codes]).reshape(raw.shape[0], -1)


def dequant_ref(raw: np.ndarray, qtype: Q) -> np.ndarray:
    if isinstance(qtype, L4):
        return l4_dequant(raw, qtype)
    return quants.dequantize(raw, qtype)


def emulate_int8_x(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: per 32 values, q = round_half_even(x * (127 / amax)), times amax / 127, fp32."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def rel_err(y, ref) -> float:
    y = np.asarray(y, dtype=np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def require_layout(ext, layout: str, types) -> None:
    """Skip where this build has no kernels for a repacked layout ("x8", "r8": AVX2 only); where it has them, they
    must cover exactly `types`."""
    listed = getattr(ext, f"gguf_{layout}_types", lambda: [])()
    if not listed:
        pytest.skip(f"this build has no {layout} kernels (they need AVX2)")
    assert sorted(listed) == sorted(int(t) for t in types)


def check_linear(ext, qtype, m, n, k, seed):
    raw = make_weights(qtype, n, k, seed)
    w = dequant_ref(raw, qtype).astype(np.float64)
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
    y = ext.gguf_linear(torch.from_numpy(x), [(torch.from_numpy(raw), int(qtype), n, None)], n).numpy()
    assert y.shape == (m, n)
    e_q = rel_err(y, emulate_int8_x(x) @ w.T)
    e_x = rel_err(y, x.astype(np.float64) @ w.T)
    assert e_q <= TOL_EMULATED, (qtype.name, m, n, k, e_q)
    assert e_x <= TOL_EXACT, (qtype.name, m, n, k, e_x)
    return raw, x, y


# ------------------------------------------------------------------------------------------------ tests
def test_types_listed(ext):
    assert sorted(ext.gguf_types()) == sorted(int(t) for t in GGUF_TYPES)
    assert sorted(ext.gguf_l4_types()) == sorted(int(t.base) for t in L4_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 768], ids=lambda k: f"K{k}")
def test_dequantize_bit_identical_to_gguf(ext, qtype, k):
    raw = make_weights(qtype, 37, k, seed=int(qtype) * 7 + k)
    got = ext.gguf_dequantize(torch.from_numpy(raw), int(qtype), 37, k).numpy()
    want = dequant_ref(raw, qtype)
    assert got.dtype == np.float32 and want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_to_bf16_rounds_as_torch(ext, qtype):
    """bf16 out (the AMX prefill's weights): gguf.quants' values rounded as torch rounds them, bit for bit; rows
    written in place into a slice of a larger buffer."""
    k = 768
    raw = make_weights(qtype, 21, k, seed=int(qtype) * 11 + 1)
    big = torch.full((30, k), float("nan"), dtype=torch.bfloat16)
    got = ext.gguf_dequantize(torch.from_numpy(raw), int(qtype), 21, k, big[5:26])
    want = torch.from_numpy(dequant_ref(raw, qtype)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.data_ptr() == big[5:26].data_ptr()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert big[:5].isnan().all() and big[26:].isnan().all()


def test_bf16_rounding_ties_and_specials(ext):
    """Q8_0 blocks whose values land on bf16 ties (both directions), near the fp16 limit, and with a NaN / inf
    scale: rounded to nearest even, NaN a NaN."""
    import struct

    def block(d_bits: int, codes: list[int]) -> bytes:
        return struct.pack("<H", d_bits) + bytes((c & 0xff) for c in codes)

    one = 0x3c00  # fp16 1.0
    rows = [block(one, [1, -1, 127, -128] + [0] * 28),
            block(0x3c01, list(range(-16, 16))),  # d = 1 + 2^-10: products with bits below bf16's mantissa
            block(0x7bff, [127, -127, 1] + [0] * 29),  # d = 65504
            block(0x7c00, [1, 0, -1] + [0] * 29),  # d = inf: inf, nan (0 * inf), -inf
            block(0x7e00, [1] * 32)]  # d = nan
    raw = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(5, 34).copy()
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    got = ext.gguf_dequantize(torch.from_numpy(raw), int(Q.Q8_0), 5, 32, out)
    with np.errstate(invalid="ignore"):
        want = torch.from_numpy(dequant_ref(raw, Q.Q8_0)).to(torch.bfloat16)
    nan = want.isnan()  # (torch's own NaN bits depend on its path: c10's 0x7fc0, the vectorized 0xffff)
    assert nan.sum() == 30 + 32 and torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert got[3, 0] == float("inf") and got[3, 2] == float("-inf") and got[2, 0] == 65504 * 127


def test_dequantize_into_out_buffer(ext):
    raw = make_weights(Q.Q4_K, 8, 512, seed=3)
    out = torch.full((8 * 512,), float("nan"))
    got = ext.gguf_dequantize(torch.from_numpy(raw), int(Q.Q4_K), 8, 512, out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (8, 512)
    np.testing.assert_array_equal(got.numpy(), dequant_ref(raw, Q.Q4_K))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", [(1, 67, 256), (3, 33, 512), (5, 40, 2304), (16, 19, 1024)])
def test_linear_matches_reference(ext, qtype, m, n, k):
    check_linear(ext, qtype, m, n, k, seed=int(qtype) * 100 + m + n + k)


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in K_QUANTS], ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", [(1, 33, 32), (2, 17, 96), (4, 9, 288), (7, 35, 576), (17, 5, 1120)])
def test_linear_k_not_a_multiple_of_256(ext, qtype, m, n, k):
    """32-block types: the blocks after the last full 8-block chunk take the tail path."""
    check_linear(ext, qtype, m, n, k, seed=int(qtype) * 10 + m + k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_bit_identical_whatever_m(ext, qtype):
    """Speculative verification relies on it: each row of an M-row product equals the 1-row product."""
    n, k = 45, 1280 if qtype not in K_QUANTS else 1536
    raw = torch.from_numpy(make_weights(qtype, n, k, seed=int(qtype)))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(int(qtype)))
    parts = [(raw, int(qtype), n, None)]
    singles = torch.stack([ext.gguf_linear(x[i:i + 1], parts, n)[0] for i in range(17)])
    for m in range(1, 18):
        y = ext.gguf_linear(x[:m], parts, n)
        assert torch.equal(y, singles[:m]), (qtype.name, m)


def test_multi_part_with_out_index(ext):
    """A fused linear of a Q4_K part and a Q6_K part (Q4_K_M's mix), rows interleaved by out_index, and a part
    without out_index placed at the running offset: activations quantized once, each row where it belongs."""
    k, gen = 512, torch.Generator().manual_seed(5)
    a = make_weights(Q.Q4_K, 24, k, seed=1)
    b = make_weights(Q.Q6_K, 16, k, seed=2)
    c = make_weights(Q.Q8_0, 8, k, seed=3)
    x = torch.randn(3, k, generator=gen)
    perm = torch.randperm(40, generator=gen).to(torch.int32)
    parts = [(torch.from_numpy(a), int(Q.Q4_K), 24, perm[:24].clone()),
             (torch.from_numpy(b), int(Q.Q6_K), 16, perm[24:].clone()),
             (torch.from_numpy(c), int(Q.Q8_0), 8, None)]
    # the third part (no out_index) sits at the running offset 40 = 24 + 16
    y = ext.gguf_linear(x, parts, 48).numpy()
    w = np.zeros((48, k))
    w[perm[:24].numpy()] = dequant_ref(a, Q.Q4_K)
    w[perm[24:].numpy()] = dequant_ref(b, Q.Q6_K)
    w[40:] = dequant_ref(c, Q.Q8_0)
    assert rel_err(y, emulate_int8_x(x.numpy()) @ w.T) <= TOL_EMULATED
    # each part alone gives the same bits as inside the fused call
    ya = ext.gguf_linear(x, [(torch.from_numpy(a), int(Q.Q4_K), 24, None)], 24)
    assert torch.equal(torch.from_numpy(y)[:, perm[:24].long()], ya)


def test_read_only_memory_mapped_and_non_contiguous_inputs(ext, tmp_path):
    """Raw blocks from a read-only memory map (as the loader hands them over) are read in place; x may be
    non-contiguous or another dtype."""
    raw = make_weights(Q.Q5_K, 12, 512, seed=9)
    path = tmp_path / "w.bin"
    path.write_bytes(raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    with pytest.warns(UserWarning, match="not writable"):
        t = torch.frombuffer(mm, dtype=torch.uint8)
    xt = torch.randn(512, 4, generator=torch.Generator().manual_seed(1)).T  # non-contiguous [4, 512]
    y = ext.gguf_linear(xt, [(t, int(Q.Q5_K), 12, None)], 12)
    y2 = ext.gguf_linear(xt.contiguous().double(), [(torch.from_numpy(raw.copy()), int(Q.Q5_K), 12, None)], 12)
    assert torch.equal(y, y2)
    assert np.array_equal(np.asarray(mm), raw.reshape(-1))  # untouched
    w = dequant_ref(raw, Q.Q5_K).astype(np.float64)
    assert rel_err(y.numpy(), emulate_int8_x(xt.numpy()) @ w.T) <= TOL_EMULATED
    d = ext.gguf_dequantize(t, int(Q.Q5_K), 12, 512)
    np.testing.assert_array_equal(d.numpy(), dequant_ref(raw, Q.Q5_K))


def test_thread_count_does_not_change_results(ext):
    raw = torch.from_numpy(make_weights(Q.Q4_K, 300, 1024, seed=4))
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(2))
    parts = [(raw, int(Q.Q4_K), 300, None)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.gguf_linear(x, parts, 300)
        torch.set_num_threads(max(2, old))
        many = ext.gguf_linear(x, parts, 300)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)


def _bad_calls(ext):
    raw = torch.from_numpy(make_weights(Q.Q4_K, 4, 256, seed=0))
    x = torch.randn(2, 256)
    return {
        "type": lambda: ext.gguf_linear(x, [(raw, 10, 4, None)], 4),  # Q2_K: not native
        "k": lambda: ext.gguf_linear(torch.randn(2, 288), [(raw, int(Q.Q4_K), 4, None)], 4),
        "bytes": lambda: ext.gguf_linear(x, [(raw[:, :100], int(Q.Q4_K), 4, None)], 4),
        "rows": lambda: ext.gguf_linear(x, [(raw, int(Q.Q4_K), 4, None)], 5),
        "index_range": lambda: ext.gguf_linear(x, [(raw, int(Q.Q4_K), 4, torch.tensor([0, 1, 2, 9], dtype=torch.int32))], 4),
        "index_twice": lambda: ext.gguf_linear(x, [(raw, int(Q.Q4_K), 4, torch.tensor([0, 1, 1, 2], dtype=torch.int32))], 4),
        "index_dtype": lambda: ext.gguf_linear(x, [(raw, int(Q.Q4_K), 4, torch.arange(4))], 4),
        "raw_dtype": lambda: ext.gguf_linear(x, [(raw.to(torch.int8), int(Q.Q4_K), 4, None)], 4),
        "dequant_out": lambda: ext.gguf_dequantize(raw, int(Q.Q4_K), 4, 256, torch.empty(10)),
    }


@pytest.mark.parametrize("bad", ["type", "k", "bytes", "rows", "index_range", "index_twice", "index_dtype",
                                 "raw_dtype", "dequant_out"])
def test_bad_arguments_raise(ext, bad):
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        _bad_calls(ext)[bad]()


# ------------------------------------------------------------------------------------------------ other ISAs
# cpu_gguf.cpp also builds without torch (-DEDGELLM_STANDALONE, with cpu_kernels.cpp for its thread helper), so
# the paths this machine's extension does not take are checked too: the portable C++ path (EDGELLM_FORCE_SCALAR,
# what EDGELLM_EXT_ISA=scalar builds), AVX2 (what EDGELLM_EXT_ISA=avx2 builds on an AVX-512 machine), AVX-512
# VNNI where the CPU has it, and arm64 NEON with and without the dot-product extension under qemu when a cross
# compiler and qemu-user are installed (Debian: g++-aarch64-linux-gnu qemu-user-static). The harness reads cases
# written here, writes its dequantized rows and products, and the checks are the ones above.
KERNELS = Path(cpu_ext.__file__).resolve().parent
HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "cpu_gguf.h"
namespace edgellm { const char* isa_name(); }
template <class T> static bool rd(FILE* f, T* p, size_t n) { return std::fread(p, sizeof(T), n, f) == n; }
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 2;
  std::printf("isa %s\n", edgellm::isa_name());
  int64_t hdr[4];  // type, M, N, K
  while (rd(in, hdr, 4)) {
    const int type = (int)hdr[0];
    const int64_t M = hdr[1], N = hdr[2], K = hdr[3], rb = edgellm::gguf_row_bytes(type, K);
    std::vector<uint8_t> raw(N * rb);
    std::vector<float> x(M * K), w(N * K), y(M * N), y1(M * N);
    if (!rd(in, raw.data(), raw.size()) || !rd(in, x.data(), x.size())) return 3;
    edgellm::gguf_dequantize_rows(raw.data(), type, N, K, w.data());
    const edgellm::GgufActs a = edgellm::gguf_quantize_acts(x.data(), M, K);
    edgellm::gguf_gemm(a, raw.data(), type, N, K, y.data(), N, nullptr);
    for (int64_t m = 0; m < M; ++m) {  // each row alone (M = 1), for the bit-identity check
      const edgellm::GgufActs a1 = edgellm::gguf_quantize_acts(x.data() + m * K, 1, K);
      edgellm::gguf_gemm(a1, raw.data(), type, N, K, y1.data() + m * N, N, nullptr);
    }
    std::fwrite(w.data(), 4, w.size(), out);
    std::fwrite(y.data(), 4, y.size(), out);
    std::fwrite(y1.data(), 4, y1.size(), out);
    // the first N / 8 * 8 rows repacked (x8) where this build multiplies that layout: n8 (as a float), y8 [M, n8]
    const int64_t n8 = edgellm::gguf_x8_supported(type) ? N / 8 * 8 : 0;
    std::vector<uint8_t> x8(n8 ? n8 * edgellm::gguf_row_bytes(type + edgellm::GGUF_X8, K) : 0);
    std::vector<float> y8(M * n8);
    if (n8) {
      edgellm::gguf_repack_x8(raw.data(), type, n8, K, x8.data());
      const edgellm::GgufActs a8 = edgellm::gguf_quantize_acts(x.data(), M, K);  // (a was overwritten above)
      edgellm::gguf_gemm(a8, x8.data(), type + edgellm::GGUF_X8, n8, K, y8.data(), n8, nullptr);
    }
    const float n8f = (float)n8;
    std::fwrite(&n8f, 4, 1, out);
    std::fwrite(y8.data(), 4, y8.size(), out);
  }
  std::fclose(out);
  std::printf("done\n");
  return 0;
}
"""
# (type, M, N, K): every type, a K-quant K of 2 super-blocks, 32-block K with a tail, M across the tile sizes
# (the grid i-quants and their L4 forms, which share the IQ4 / signed-code paths: one shape each, the builds being
# slow to run: the scalar and SIMDe-emulated ones take most of this test's time)
ISA_CASES = [(t, m, n, k) for t in TYPES for (m, n, k) in ((1, 19, 512), (6, 9, 768))
             if t not in GRID_IQUANTS | set(L4_TYPES) or m == 6] + \
    [(t, 5, 7, 288) for t in TYPES if t not in K_QUANTS]


@pytest.fixture(scope="module")
def isa_builds(tmp_path_factory):
    """Start the standalone compiles at once, in the background."""
    folder = tmp_path_factory.mktemp("gguf_isa")
    src = folder / "harness.cpp"
    src.write_text(HARNESS)
    jobs = start_builds(folder, "gguf", lambda cxx, flags, exe: [
        cxx, "-O2", "-std=c++17", "-DEDGELLM_STANDALONE", f"-I{KERNELS}", *flags, str(src),
        str(KERNELS / "cpu_gguf.cpp"), str(KERNELS / "cpu_gguf_x8.cpp"), str(KERNELS / "cpu_kernels.cpp"), "-o",
        str(exe)])
    yield folder, jobs
    stop_builds(jobs)


def run_isa(folder, jobs, name: str) -> dict:
    """Run one build on ISA_CASES; returns {case: (dequantized, y, y of each row alone)}."""
    import subprocess

    proc, exe, runner = jobs[name]
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    cases, blob = {}, bytearray()
    for i, (t, m, n, k) in enumerate(ISA_CASES):
        raw = make_weights(t, n, k, seed=50 + i)
        x = np.random.default_rng(i).standard_normal((m, k)).astype(np.float32)
        cases[(t, m, n, k)] = (raw, x)
        blob += np.array([int(t), m, n, k], dtype=np.int64).tobytes() + raw.tobytes() + x.tobytes()
    (folder / "cases.bin").write_bytes(bytes(blob))
    res = folder / f"out-{name}.bin"
    run = subprocess.run([*runner, str(exe), str(folder / "cases.bin"), str(res)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.splitlines()[0] == f"isa {name}", run.stdout[-2000:] + run.stderr[-2000:]
    data, pos, got = np.fromfile(res, dtype=np.float32), 0, {}
    for key, (raw, x) in cases.items():
        _, m, n, k = key
        w, pos = data[pos:pos + n * k].reshape(n, k), pos + n * k
        y, pos = data[pos:pos + m * n].reshape(m, n), pos + m * n
        y1, pos = data[pos:pos + m * n].reshape(m, n), pos + m * n
        n8, pos = int(data[pos]), pos + 1
        y8, pos = data[pos:pos + m * n8].reshape(m, n8), pos + m * n8
        got[key] = (raw, x, w, y, y1, y8)
    assert pos == data.size
    return got


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx2vnni", "avx512vnni", "neon", "neon-dotprod"])
def test_isa_builds_match_reference(isa_builds, isa):
    folder, jobs = isa_builds
    if isa not in jobs:
        pytest.skip(f"no {isa} build here (AVX2, AVX-VNNI: the CPU; AVX-512 VNNI: the CPU or SIMDe; NEON: "
                    "aarch64-linux-gnu-g++ and qemu-aarch64)")
    for (t, m, n, k), result in run_isa(folder, jobs, isa).items():
        raw, x, w, y, y1, y8 = result
        want = dequant_ref(raw, t)
        np.testing.assert_array_equal(w.view(np.uint32), want.view(np.uint32), err_msg=f"{isa} {t.name}")
        ref = emulate_int8_x(x) @ want.astype(np.float64).T
        e_q = rel_err(y, ref)
        assert e_q <= TOL_EMULATED, (isa, t.name, m, n, k, e_q)
        assert np.array_equal(y.view(np.uint32), y1.view(np.uint32)), (isa, t.name, m, "rows differ from M = 1")
        assert y8.shape[1] == (n // 8 * 8 if isa in X8_BUILDS and t in X8_ANY else 0), (isa, t.name)
        if y8.shape[1]:
            assert rel_err(y8, ref[:, :y8.shape[1]]) <= TOL_EMULATED, (isa, t.name, m, n, k, "x8")


@pytest.mark.slow
@pytest.mark.parametrize("vnni", ["avx512vnni", "avx2vnni"])
def test_vnni_build_bit_identical_to_avx2(isa_builds, vnni):
    """vpdpbusd's int32 sums are maddubs + madd's where nothing saturates: the same integers, the same bits."""
    folder, jobs = isa_builds
    if vnni not in jobs:
        pytest.skip(VNNI_MISSING if vnni == "avx512vnni" else "no AVX-VNNI on this CPU (Intel since Alder Lake)")
    a, v = run_isa(folder, jobs, "avx2"), run_isa(folder, jobs, vnni)
    for key in a:
        assert np.array_equal(a[key][3].view(np.uint32), v[key][3].view(np.uint32)), key
        assert np.array_equal(a[key][5].view(np.uint32), v[key][5].view(np.uint32)), (key, "x8")


# ------------------------------------------------------------------------------------------------ fused step
# The fused C++ decode step (kernels/cpu_decode.py) on a tiny model whose every linear, its embedding and its output
# are GGUF modules (duck-typed as the loader's: `gguf_parts` of raw / type / rows / out_index), against the eager
# model whose fake modules compute an independent reference: gguf.quants' dequantized weights in float64 against x
# rounded to int8 per 32 values (emulated in numpy), so only fp32 rounding (and a rare flip of an activation's
# int8 rounding by it) separates the two.
class _Part:
    def __init__(self, raw: np.ndarray, qtype: Q, out_index: torch.Tensor | None):
        self.raw = torch.from_numpy(raw)
        self.type = int(qtype)
        self.rows = raw.shape[0]
        self.out_index = out_index


class FakeGGUFLinear(torch.nn.Module):
    def __init__(self, parts: list[_Part], in_features: int, out_features: int, bias=None, embedding=False):
        super().__init__()
        self.gguf_parts, self.in_features, self.out_features = parts, in_features, out_features
        self.bias = bias
        w = np.zeros((out_features, in_features), dtype=np.float32)
        offset = 0
        for p in parts:
            rows = dequant_ref(p.raw.numpy(), Q(p.type))
            if p.out_index is None:
                w[offset:offset + p.rows] = rows
            else:
                w[p.out_index.long().numpy()] = rows
            offset += p.rows
        self.w = torch.from_numpy(w)
        self.embedding = embedding

    def forward(self, x):
        if self.embedding:
            return self.w[x]
        shape = x.shape
        xq = emulate_int8_x(x.reshape(-1, shape[-1]).detach().float().numpy())
        y = torch.from_numpy(xq @ self.w.double().numpy().T).float().reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _gguf_module(n: int, k: int, recipe: list[Q], seed: int, bias=None, permute=False, embedding=False):
    """n rows split evenly over the recipe's types; with `permute`, every part but the last scatters its rows over
    [0, n - last part's rows) by out_index, and the last one (no out_index) takes the rows after them."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [n // len(recipe)] * (len(recipe) - 1)
    sizes.append(n - sum(sizes))
    perm = torch.randperm(n - sizes[-1], generator=gen).to(torch.int32)
    parts, start = [], 0
    for i, (t, rows) in enumerate(zip(recipe, sizes)):
        idx = perm[start:start + rows].clone() if permute and i < len(recipe) - 1 else None
        parts.append(_Part(make_weights(t, rows, k, seed=seed * 10 + i), t, idx))
        start += rows
    return FakeGGUFLinear(parts, k, n, bias, embedding)


RECIPES = {  # Q4_K_M's mix, and the legacy 32-block types
    "kquants": dict(qkv=[Q.Q4_K, Q.Q6_K], o=[Q.Q4_K], w13=[Q.Q5_K, Q.Q4_K], w2=[Q.Q6_K], emb=[Q.Q4_K], out=[Q.Q6_K]),
    "legacy": dict(qkv=[Q.Q4_0, Q.Q5_1], o=[Q.Q5_0], w13=[Q.Q4_1, Q.Q8_0], w2=[Q.Q4_0], emb=[Q.Q8_0, Q.Q5_0],
                   out=[Q.Q4_1]),
}


def _gguf_model(tmp_path, variant: str, recipe: dict):
    from edgellm.loading import load_model
    from tests.fixtures.tiny import make_hf_model

    folder = make_hf_model(tmp_path / variant, variant, seed=2, hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)
    loaded = load_model(folder, max_seq_len=64)
    model, cfg = loaded.model, loaded.model.config
    with torch.no_grad():
        for i, blk in enumerate(model.layers):
            a, f = blk.attention, blk.feed_forward
            a.wqkv = _gguf_module(a.wqkv.out_features, cfg.dim, recipe["qkv"], 100 + i, a.wqkv.bias, permute=True)
            a.wo = _gguf_module(cfg.dim, a.wo.in_features, recipe["o"], 200 + i)
            f.w13 = _gguf_module(f.w13.out_features, cfg.dim, recipe["w13"], 300 + i, permute=True)
            f.w2 = _gguf_module(cfg.dim, f.w2.in_features, recipe["w2"], 400 + i)
        model.tok_embeddings = _gguf_module(cfg.vocab_size, cfg.dim, recipe["emb"], 7, embedding=True)
        model.output = _gguf_module(cfg.vocab_size, cfg.dim, recipe["out"], 8)
    return loaded


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_fused_step_runs_gguf_model(ext, tmp_path, variant, recipe):
    from edgellm.generate import Engine
    from tests.test_decode_step import PROMPT, STEPS, eager_logits, step_logits

    loaded = _gguf_model(tmp_path, variant, RECIPES[recipe])
    engine = Engine(loaded.model, loaded.tokenizer)
    assert engine.compiled_step() is not None, "the fused step should take a model of GGUF modules"
    want = eager_logits(loaded.model)
    got = step_logits(engine)
    for g, w in zip(got, want):
        assert rel_err(g.numpy(), w.double().numpy()) <= 1e-5  # measured ~2e-7


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fused_gguf_many_rows_equal_one_token_steps(ext, tmp_path, recipe):
    """Speculative verification through the fused step: each row of a T-token call bit for bit the one-token
    step at its position."""
    from edgellm.generate import Engine
    from tests.test_decode_step import PROMPT, STEPS, step_logits

    loaded = _gguf_model(tmp_path, "qwen2_bias", RECIPES[recipe])
    a, b = (Engine(loaded.model, loaded.tokenizer) for _ in range(2))
    one = step_logits(a)
    b.reset()
    b.prefill(PROMPT)
    step = b.compiled_step()
    rows = list(step.many(torch.tensor(STEPS[:5]), len(PROMPT)).clone())
    rows += list(step.many(torch.tensor(STEPS[5:]), len(PROMPT) + 5))
    for got, want in zip(rows, one):
        assert torch.equal(got, want)


def test_kernel_row_thresholds():
    """kernels/gguf_ops.py: the K-quants take the kernel up to their measured row counts, the rest up to 16."""
    from edgellm.kernels.gguf_ops import GGUF_KERNEL_MAX_ROWS, GGUF_NATIVE_TYPES, use_kernel

    assert GGUF_NATIVE_TYPES == {t.name: int(t) for t in GGUF_TYPES}
    for name, rows in GGUF_KERNEL_MAX_ROWS.items():
        assert use_kernel(GGUF_NATIVE_TYPES[name], rows) and not use_kernel(GGUF_NATIVE_TYPES[name], rows + 1)
    assert use_kernel(int(Q.Q4_0), 16) and not use_kernel(int(Q.Q4_0), 17)
    assert all(use_kernel(int(t) + 1000, 4096) for t in X8_K_QUANTS)  # the x8 layout: the kernel at every M
