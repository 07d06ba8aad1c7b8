"""The C++ converter of the GGUF types without a product kernel (kernels/cpu_gguf_grid.cpp via quant/gguf_grid.py:
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0) against gguf.quants: its fp32 values are
gguf.quants.dequantize's bit for bit, its Q8_0 blocks gguf.quants.quantize's of those values byte for byte."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from edgellm.quant import gguf_grid
from tests.test_cpu_kernels import ext  # noqa: F401  (the extension fixture, shared)
from tests.fixtures.tiny import random_blocks, set_iq1_m_d

T = gguf.GGMLQuantizationType


def grid_blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    return random_blocks(type_name, rows, k, np.random.default_rng(seed))


@pytest.mark.parametrize("type_id", sorted(gguf_grid.GRID_TYPES), ids=lambda t: gguf_grid.GRID_TYPES[t])
@pytest.mark.parametrize("rows,k", [(37, 512), (3, 2304)])
def test_values_and_q8_0_blocks_are_gguf_quants(ext, type_id, rows, k):
    name = gguf_grid.GRID_TYPES[type_id]
    raw = grid_blocks(name, rows, k, seed=type_id + k)
    want = gguf.quants.dequantize(raw, T(type_id)).reshape(rows, k)
    assert np.isfinite(want).all() and want.std() > 0
    values = gguf_grid.convert(raw, type_id, rows, k, q8_0=False)
    assert values.dtype == torch.float32 and values.shape == (rows, k)
    assert np.array_equal(values.numpy().view(np.uint32), want.view(np.uint32))  # bit for bit, signed zeros too
    blocks = gguf_grid.convert(raw, type_id, rows, k, q8_0=True)
    assert blocks.dtype == torch.uint8 and np.array_equal(blocks.numpy(), gguf.quants.quantize(want, T.Q8_0))


def test_what_it_does_not_convert(ext):
    raw = grid_blocks("IQ3_XXS", 2, 256, seed=0)
    assert gguf_grid.convert(raw, int(T.Q4_K), 2, 256, q8_0=True) is None  # a type with kernels: not its job
    assert gguf_grid.convert(raw[:, :49], int(T.IQ3_XXS), 2, 128, q8_0=True) is None  # rows of 128: not a type's
    grid, ksigns = gguf_grid._tables(int(T.IQ3_XXS))
    with pytest.raises(RuntimeError, match="expected a contiguous uint8 CPU tensor of 196 bytes"):
        ext.gguf_grid_convert(torch.from_numpy(raw[:1]), int(T.IQ3_XXS), 2, 256, grid, ksigns, True)
    with pytest.raises(RuntimeError, match=r"needs its grid as int8 \[256, 4\]"):
        ext.gguf_grid_convert(torch.from_numpy(raw), int(T.IQ3_XXS), 2, 256, grid[:128], ksigns, True)
    with pytest.raises(RuntimeError, match="needs the 128 sign bytes"):
        ext.gguf_grid_convert(torch.from_numpy(raw), int(T.IQ3_XXS), 2, 256, grid, ksigns[:64], True)


def test_the_kernels_codebooks_are_gguf_quants():
    """kernels/gguf_grids.h (the grids the native IQ2_XXS / IQ3_XXS / IQ3_S kernels read) is what
    scripts/gguf_grids_header.py writes from gguf.quants' tables today, entry for entry."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gguf_grids_header", root / "scripts" / "gguf_grids_header.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = (root / "kernels" / "gguf_grids.h").read_text()
    assert text == script.header()
    iq3 = gguf.quants.IQ3_XXS
    iq3.init_grid()
    first = int.from_bytes(iq3.grid.reshape(iq3.grid_shape)[0].astype(np.uint8).tobytes(), "little")
    assert f"GGUF_IQ3XXS_GRID[256] = {{\n    0x{first:08x}," in text  # (the header names the entries in order)


L4_BASES = [16, 18, 21, 19, 17, 22, 29]  # IQ2_XXS, IQ3_XXS, IQ3_S; IQ1_S, IQ2_XS, IQ2_S, IQ1_M (no kernel as stored)


@pytest.mark.parametrize("type_id", L4_BASES, ids=lambda t: gguf_grid.GRID_TYPES[t])
def test_l4_recoding_keeps_every_value(ext, type_id):
    """The CPU loader's recoding of the grid i-quants (ext.gguf_to_l4: IQ4_XS blocks over the type's levels; IQ2_XS /
    IQ2_S / IQ1_M: with a scale per 16 values) holds gguf.quants' values bit for bit: through the extension's dequantizer,
    and through an independent numpy reading of the layout (tests/test_gguf_kernels.l4_dequant)."""
    from tests.test_gguf_kernels import L4, l4_dequant

    rows, k = 29, 768
    raw = grid_blocks(gguf_grid.GRID_TYPES[type_id], rows, k, seed=type_id)
    if type_id == 29:  # subnormal d's (the 2^-p still exact); IQ1_M's lies in its scales' top nibbles
        set_iq1_m_d(raw[:3], 2.0 ** -16)
    else:
        raw[:3, 0:2] = np.frombuffer(np.float16(2.0 ** -16).tobytes(), np.uint8)
    want = gguf.quants.dequantize(raw, T(type_id)).reshape(rows, k)
    l4 = ext.gguf_to_l4(torch.from_numpy(raw), type_id, rows, k, **gguf_grid.l4_tables(type_id))
    assert l4.shape == (rows, k // 256 * (146 if type_id in (17, 22, 29) else 136))
    got = ext.gguf_dequantize(l4, type_id + 100, rows, k).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(l4_dequant(l4.numpy(), L4(T(type_id))).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("type_id", L4_BASES, ids=lambda t: gguf_grid.GRID_TYPES[t])
def test_l4_straight_into_x8_is_l4_then_repacked(ext, type_id):
    """gguf_to_l4(x8=True), which the loader uses so that no whole-tensor L4 copy is made on the way, writes what
    recoding and then repacking 8 rows at a time write, byte for byte."""
    if type_id + 100 not in ext.gguf_x8_types():
        pytest.skip("this build has no x8 kernels (they need AVX2)")
    rows, k = 24, 512
    raw = torch.from_numpy(grid_blocks(gguf_grid.GRID_TYPES[type_id], rows, k, seed=type_id + 1))
    tables = gguf_grid.l4_tables(type_id)
    direct = ext.gguf_to_l4(raw, type_id, rows, k, x8=True, **tables)
    two_steps = ext.gguf_repack(ext.gguf_to_l4(raw, type_id, rows, k, **tables), type_id + 100, rows, k)
    assert torch.equal(direct, two_steps)
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        ext.gguf_to_l4(raw[:12].contiguous(), type_id, 12, k, x8=True, **tables)


def test_l4_refusals(ext):
    raw = torch.from_numpy(grid_blocks("IQ1_S", 8, 256, seed=1))
    with pytest.raises(RuntimeError, match=r"type 19 needs its grid as int8 \[2048, 8\]"):
        ext.gguf_to_l4(raw, 19, 8, 256)  # (no grid)
    with pytest.raises(RuntimeError, match=r"type 19 needs its grid"):
        ext.gguf_to_l4(raw, 19, 8, 256, grid=gguf_grid.grid_of(19)[:1024])
    iq2_xs = torch.from_numpy(grid_blocks("IQ2_XS", 8, 256, seed=1))
    with pytest.raises(RuntimeError, match="type 17 needs the 128 sign bytes"):
        ext.gguf_to_l4(iq2_xs, 17, 8, 256, grid=gguf_grid.grid_of(17))  # (its grid, not its signs)
    with pytest.raises(RuntimeError, match="is not IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S or IQ1_M"):
        ext.gguf_to_l4(torch.from_numpy(grid_blocks("TQ1_0", 8, 256, seed=1)), 34, 8, 256)


@pytest.mark.parametrize("type_id", [34, 35], ids=["TQ1_0", "TQ2_0"])
def test_ternary_types_as_q2_k_keep_every_value(ext, type_id):
    """The loader's rewrite of TQ1_0 / TQ2_0 blocks as Q2_K blocks (numpy, every device): gguf.quants' Q2_K values of
    the result are its TQ values of the source bit for bit, TQ2_0's code 3 (digit 2, which its quantizer never
    writes) and subnormal d's included; and the codes are not all one value (a rewrite that drops them fails)."""
    rows, k = 13, 512
    raw = grid_blocks(gguf_grid.TERNARY_TYPES[type_id], rows, k, seed=type_id)
    d_at = 52 if type_id == 34 else 64
    raw.reshape(-1, d_at + 2)[:3, d_at:] = np.frombuffer(np.float16(2.0 ** -20).tobytes(), np.uint8)
    want = gguf.quants.dequantize(raw, T(type_id)).reshape(rows, k)
    assert len(np.unique(want[3:] / np.abs(want[3:]).max(axis=1, keepdims=True))) == (3 if type_id == 34 else 4)
    q2 = gguf_grid.ternary_as_q2_k(raw, type_id, rows, k)
    assert q2.shape == (rows, k // 256 * 84) and q2.dtype == np.uint8
    got = gguf.quants.dequantize(q2, T.Q2_K).reshape(rows, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(gguf_grid._ternary_as_q2_k_numpy(raw, type_id, rows, k), q2)  # no extension: the same
    assert hasattr(ext, "gguf_ternary_to_q2_k")  # (the first was the C++ converter's)


@pytest.mark.parametrize("type_id", [19, 29], ids=["IQ1_S", "IQ1_M"])
def test_iq1_types_as_q6_k_keep_every_value(ext, type_id):
    """The loader's rewrite of IQ1_S / IQ1_M blocks as Q6_K blocks (every device; the CPU recodes IQ1_S as L4 instead,
    but for a token embedding): gguf.quants' Q6_K values of the result are its IQ1 values of the source bit for bit,
    d's near fp16's subnormal range included; a d whose eighth is not an fp16 gives None (the Q8_0 route then)."""
    rows, k = 11, 512
    raw = grid_blocks(gguf_grid.IQ1_TYPES[type_id], rows, k, seed=type_id)
    tiny = np.float16(2.0 ** -11)  # d / 8 = 2^-14: still exact
    if type_id == 19:
        raw.reshape(-1, 50)[:2, 0:2] = np.frombuffer(tiny.tobytes(), np.uint8)
    else:
        set_iq1_m_d(raw.reshape(-1, 56)[:2], float(tiny))
    want = gguf.quants.dequantize(raw, T(type_id)).reshape(rows, k)
    q6 = gguf_grid.iq1_as_q6_k(raw, type_id, rows, k)
    assert q6.shape == (rows, k // 256 * 210) and q6.dtype == np.uint8
    got = gguf.quants.dequantize(q6, T.Q6_K).reshape(rows, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) and want.std() > 0
    odd = np.float16(2.0 ** -14 * (1 + 2.0 ** -10))  # its eighth needs bits below fp16's last subnormal one
    if type_id == 19:
        raw.reshape(-1, 50)[5, 0:2] = np.frombuffer(odd.tobytes(), np.uint8)
    else:
        set_iq1_m_d(raw.reshape(-1, 56)[5:6], float(odd))
    assert gguf_grid.iq1_as_q6_k(raw, type_id, rows, k) is None
