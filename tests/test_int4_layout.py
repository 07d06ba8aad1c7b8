"""The two int4 nibble layouts (kernels/int4_layout.py), each against a plain byte-by-byte reference written
from its definition, and the modules that use each one."""
import numpy as np
import torch

from edgellm.kernels.int4_layout import pack_halves, pack_q4_blocks, unpack_halves, unpack_q4_blocks


def pack_halves_reference(codes: np.ndarray) -> np.ndarray:
    """Split halves: byte j of a row of D codes = code j (low nibble) | code j + D/2 (high nibble)."""
    *lead, d = codes.shape
    rows = codes.reshape(-1, d)
    out = np.zeros((rows.shape[0], d // 2), dtype=np.uint8)
    for r in range(rows.shape[0]):
        for j in range(d // 2):
            out[r, j] = int(rows[r, j]) | (int(rows[r, j + d // 2]) << 4)
    return out.reshape(*lead, d // 2)


def pack_q4_reference(codes: np.ndarray) -> np.ndarray:
    """GGUF Q4_0 / Q4_1 (ggml-quants.c quantize_row_q4_0_ref): per block of 32, byte j = code j | code j + 16 << 4."""
    n, k = codes.shape
    out = np.zeros((n, k // 2), dtype=np.uint8)
    for r in range(n):
        for b in range(k // 32):
            for j in range(16):
                out[r, b * 16 + j] = int(codes[r, b * 32 + j]) | (int(codes[r, b * 32 + j + 16]) << 4)
    return out


def random_codes(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_split_halves_against_the_reference():
    for shape in [(1, 1, 32), (3, 5, 64), (2, 128), (7, 16)]:
        codes = random_codes(*shape)
        packed = pack_halves(codes)
        assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
        np.testing.assert_array_equal(packed.numpy(), pack_halves_reference(codes.numpy()))
        assert torch.equal(unpack_halves(packed), codes)
    # any integer dtype of codes packs the same
    codes = random_codes(4, 64, seed=1)
    assert torch.equal(pack_halves(codes.to(torch.int64)), pack_halves(codes))


def test_q4_blocks_against_the_reference():
    for shape in [(1, 32), (5, 128), (3, 96)]:
        codes = random_codes(*shape, seed=2)
        packed = pack_q4_blocks(codes)
        assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
        np.testing.assert_array_equal(packed.numpy(), pack_q4_reference(codes.numpy()))
        assert torch.equal(unpack_q4_blocks(packed), codes)
    # one code pair placed by hand: block 1, position 3 → byte 16 + 3
    c = torch.zeros(1, 64, dtype=torch.uint8)
    c[0, 32 + 3], c[0, 32 + 3 + 16] = 0x5, 0xA
    assert pack_q4_blocks(c)[0, 16 + 3] == 0xA5 and int(pack_q4_blocks(c).sum()) == 0xA5


def test_the_layouts_differ_past_one_block():
    """Within one block of 32 they coincide; over a longer row they must not (the KV cache and the weights
    would read each other's codes wrongly if one were used for the other)."""
    one = random_codes(2, 32, seed=3)
    assert torch.equal(pack_halves(one), pack_q4_blocks(one))
    row = random_codes(2, 64, seed=4)
    assert not torch.equal(pack_halves(row), pack_q4_blocks(row))


def test_each_module_uses_its_layout():
    """The KV cache's int4 rows are split halves; quantized int4 weights are GGUF Q4 blocks, byte for byte the
    Q4_1 blocks gguf-py writes."""
    import gguf

    from edgellm.kernels.kv_quant import quantize_int4
    from edgellm.quant.groups import quantize, to_gguf

    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    packed, scale, lo = quantize_int4(x, 64)
    codes = torch.round((x - lo) / scale).clamp(0, 15).to(torch.uint8)
    np.testing.assert_array_equal(packed.numpy(), pack_halves_reference(codes.numpy()))

    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    qt = quantize(w, 4, 32, symmetric=False, search=False)
    raw, ggml_type = to_gguf(qt)
    assert ggml_type == gguf.GGMLQuantizationType.Q4_1
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1).reshape(4, 2, 20)
    ours = raw.reshape(4, 2, 20)
    # the nibbles of a block follow its 4-byte header (fp16 scale, fp16 min): ours decode to the same codes
    ref_codes = np.concatenate([ref[..., 4:] & 0xF, ref[..., 4:] >> 4], axis=-1).reshape(4, 64)
    our_codes = unpack_q4_blocks(torch.from_numpy(np.ascontiguousarray(ours[..., 4:])).reshape(4, 32)).numpy()
    np.testing.assert_array_equal(our_codes, unpack_q4_blocks(qt.codes).numpy())
    assert (our_codes == ref_codes).mean() > 0.9  # same layout; RTN may differ by rounding on a few codes
