"""`--weights auto`: a quantized GGUF runs as stored (blocks kept bit for bit, used in place from the mmap).

References: gguf.quants.dequantize for the blocks, and the same file loaded with `--weights fp` (every tensor
dequantized by gguf.quants, the float model that tests/test_model_reference.py checks against transformers).
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch

from edgellm.cache import KVCache
from edgellm.kernels import matmul
from edgellm.kernels.matmul import KernelOptions
from edgellm.loading import load_model
from edgellm.options import Options
from edgellm.quant.gguf_linear import L4, R8, X8, GGUFEmbedding, GGUFLinear, stored_type
from edgellm.gguf_file import GGUF_TYPES
from edgellm.quant.gguf_tensor import dequantize_blocks
from edgellm.quant.linear import QuantLinear
from tests.fixtures.tiny import make_gguf, make_hf_model, random_blocks

# A Q4_K_M-like mix (Q/K/gate Q4_K, V and down Q6_K, the head Q6_K) and one of the 32-value block types;
# the fused Q/K/V and gate/up hold parts of different types.
K_MIX = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q5_K",
         "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K",
         "token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
LEGACY_MIX = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_1", "attn_v.weight": "Q4_0", "attn_output.weight": "Q8_0",
              "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q5_1",
              "token_embd.weight": "Q5_0", "output.weight": "Q8_0"}
# A Q3_K_M / Q2_K-like mix (llama.cpp's: Q3_K / Q2_K for most matrices, V and the output projection Q4_K-Q5_K, the
# head Q6_K), fused Q/K/V and gate/up of the two low types
LOW_MIX = {"attn_q.weight": "Q3_K", "attn_k.weight": "Q2_K", "attn_v.weight": "Q5_K", "attn_output.weight": "Q4_K",
           "ffn_gate.weight": "Q2_K", "ffn_up.weight": "Q3_K", "ffn_down.weight": "Q3_K",
           "token_embd.weight": "Q2_K", "output.weight": "Q6_K"}
# An IQ4_XS file's mix (llama.cpp's: IQ4_XS for most matrices, the head Q6_K) with IQ4_NL parts fused beside IQ4_XS
# ones (Q/K/V, gate/up) and in the embeddings
IQ4_MIX = {"attn_q.weight": "IQ4_XS", "attn_k.weight": "IQ4_NL", "attn_v.weight": "IQ4_XS", "attn_output.weight": "IQ4_NL",
           "ffn_gate.weight": "IQ4_NL", "ffn_up.weight": "IQ4_XS", "ffn_down.weight": "IQ4_XS",
           "token_embd.weight": "IQ4_NL", "output.weight": "Q6_K"}
# An i-quant file's mix (IQ3_XXS / IQ3_S / IQ2_XXS files: the grid types for most matrices, the head Q6_K), the
# three grid types fused beside each other (Q/K/V, gate/up) and in the embeddings
IQ3_MIX = {"attn_q.weight": "IQ3_XXS", "attn_k.weight": "IQ3_S", "attn_v.weight": "IQ2_XXS", "attn_output.weight": "IQ3_S",
           "ffn_gate.weight": "IQ3_XXS", "ffn_up.weight": "IQ2_XXS", "ffn_down.weight": "IQ3_S",
           "token_embd.weight": "IQ3_XXS", "output.weight": "Q6_K"}
# The types with no kernel as stored that the loader rewrites: IQ1_S / IQ1_M (recoded as L4 on the CPU, as Q6_K blocks
# elsewhere)
# and the ternary TQ1_0 / TQ2_0 (as Q2_K blocks), fused beside each other (Q/K/V, gate/up); the embeddings of a type
# with kernels, as IQ1 files' are. TQ_MIX: a ternary (BitNet-style) file, its embeddings ternary too.
IQ1_MIX = {"attn_q.weight": "IQ1_S", "attn_k.weight": "TQ1_0", "attn_v.weight": "TQ2_0", "attn_output.weight": "IQ1_M",
           "ffn_gate.weight": "TQ2_0", "ffn_up.weight": "IQ1_S", "ffn_down.weight": "TQ1_0",
           "token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
# IQ2_XS / IQ2_S files' mix (llama.cpp's: the two types for most matrices, attn_v and the head bumped), recoded on
# the CPU as L4 blocks with a scale per 16 values, fused beside each other and a K-quant (Q/K/V, gate/up)
IQ2_MIX = {"attn_q.weight": "IQ2_XS", "attn_k.weight": "IQ2_S", "attn_v.weight": "Q4_K", "attn_output.weight": "IQ2_S",
           "ffn_gate.weight": "IQ2_XS", "ffn_up.weight": "IQ2_S", "ffn_down.weight": "IQ2_XS",
           "token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
TQ_MIX = {"attn_q.weight": "TQ1_0", "attn_k.weight": "TQ2_0", "attn_v.weight": "TQ1_0", "attn_output.weight": "TQ2_0",
          "ffn_gate.weight": "TQ2_0", "ffn_up.weight": "TQ1_0", "ffn_down.weight": "TQ2_0",
          "token_embd.weight": "TQ2_0", "output.weight": "TQ1_0"}
SHAPE = dict(hidden_size=256, intermediate_size=512)  # K-quants need rows of 256
# what the loader runs the types without a kernel as stored (but IQ1_S / IQ1_M on the CPU: L4) as, their values
# unchanged
REWRITTEN = {"TQ1_0": "Q2_K", "TQ2_0": "Q2_K"}


def type_name(type_id: int) -> str:
    return gguf.GGMLQuantizationType(type_id).name


@pytest.fixture(scope="module")
def quant_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-mix")
    out = {}
    for name, variant, types in (("kmix", "llama_gqa", K_MIX), ("legacy", "llama_gqa", LEGACY_MIX),
                                 ("tied", "llama_tied", {k: v for k, v in K_MIX.items() if k != "output.weight"}),
                                 ("qwen2", "qwen2_bias", K_MIX), ("lowmix", "llama_gqa", LOW_MIX),
                                 ("iq4mix", "llama_gqa", IQ4_MIX), ("iq3mix", "llama_gqa", IQ3_MIX),
                                 ("iq1mix", "llama_gqa", IQ1_MIX), ("tqmix", "llama_gqa", TQ_MIX),
                                 ("iq2mix", "llama_gqa", IQ2_MIX)):
        folder = make_hf_model(root / name, variant, seed=3, **SHAPE)
        out[name] = make_gguf(folder, root / f"{name}.gguf", quant_types=types, seed=7)
    return out


@pytest.fixture
def no_kernels():
    """The torch path: blocks dequantized on the device per call (what CUDA / MPS run)."""
    saved = matmul.cpu_extension()
    matmul.set_cpu_extension(None)
    yield
    matmul.set_cpu_extension(saved)


def _logits(loaded, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(all prefill logits, then one cached decode step's logits)."""
    model = loaded.model
    cache = KVCache(model.config, model.rope_len, model.dtype, model.device)
    with torch.no_grad():
        pre = model(torch.tensor([ids[:-1]]), cache, 0, all_logits=True)
        step = model(torch.tensor([ids[-1:]]), cache, len(ids) - 1)
    return pre, step


@pytest.mark.parametrize("type_id", sorted(GGUF_TYPES))
def test_torch_dequantize_is_gguf_quants_bit_for_bit(type_id):
    name = GGUF_TYPES[type_id].name
    raw = random_blocks(name, 6, 512, np.random.default_rng(type_id))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id)).reshape(6, 512)
    got = dequantize_blocks(torch.from_numpy(raw), type_id, (6, 512)).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("name", ["kmix", "legacy", "tied", "qwen2", "lowmix", "iq4mix", "iq3mix", "iq1mix",
                                  "iq2mix"])
def test_auto_keeps_every_block_in_place(quant_files, name):
    loaded = load_model(quant_files[name], weights="auto")
    model = loaded.model
    reader = gguf.GGUFReader(str(quant_files[name]))
    # (the ternary types run as Q2_K blocks of their values)
    stored = {t.name: REWRITTEN.get(t.tensor_type.name, t.tensor_type.name) for t in reader.tensors}
    a = model.layers[0].attention
    assert isinstance(a.wqkv, GGUFLinear)
    assert a.wqkv.type_names() == [stored["blk.0.attn_q.weight"], stored["blk.0.attn_k.weight"],
                                   stored["blk.0.attn_v.weight"]]
    assert isinstance(model.tok_embeddings, GGUFEmbedding)
    emb = model.tok_embeddings.gguf_parts[0]
    assert mapped_file(emb.raw.data_ptr()) == str(quant_files[name].resolve())  # lookups read the file in place
    if name == "tied":  # the head multiplies the same blocks: the table itself, or its x8 repacking
        assert_same_blocks(model.output.gguf_parts, emb.raw.numpy(), emb.type, model.config.dim, quant_files[name])
    # the blocks are the stored tensor byte for byte: views of the memory-mapped file, or (K-quants, on a CPU with
    # the x8 kernels) its rows 8 at a time in the x8 layout and the last rows % 8 in place
    t = next(t for t in loaded_tensors(quant_files[name]) if t.name == "blk.1.ffn_down.weight")
    w2 = model.layers[1].feed_forward.w2
    assert_same_blocks(w2.gguf_parts, np.asarray(t.data), int(t.tensor_type), w2.in_features, quant_files[name])
    assert loaded.runs_as[stored["blk.0.attn_v.weight"]] >= 1


def assert_same_blocks(parts, stored: np.ndarray, type_id: int, k: int, path) -> None:
    """The parts hold `stored` (a GGUF tensor's rows) bit for bit: x8 / r8 parts through gguf_unrepack(_r8), the
    rest as views of the file at `path`; l4 parts (a grid i-quant recoded) and the Q2_K / Q6_K ones of a type
    rewritten (REWRITTEN) hold its values bit for bit."""
    ext = matmul.cpu_extension()
    stored = stored.reshape(sum(p.rows for p in parts), -1)
    start = 0
    for p in parts:
        rows = stored[start:start + p.rows]
        recoded = stored_type(p.type) != p.type % X8  # a grid i-quant recoded (l4, or l4 then x8)
        name = type_name(type_id)
        rewritten = gguf.GGMLQuantizationType[REWRITTEN[name]] if name in REWRITTEN else None
        if recoded or rewritten:  # or a type rewritten as Q2_K / Q6_K blocks (x8 or not): its values
            assert p.type % X8 == (type_id + L4 if recoded else int(rewritten))
            assert not recoded or type_id in ext.gguf_l4_types()
            got = ext.gguf_dequantize(p.raw, p.type, p.rows, k).numpy()
            want = gguf.quants.dequantize(np.ascontiguousarray(rows), type_id).reshape(p.rows, k)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
            start += p.rows
            continue
        if p.type >= R8:
            assert p.type == type_id + R8 and type_id in ext.gguf_r8_types()
            back = ext.gguf_unrepack_r8(p.raw, type_id, p.rows, k).numpy()
        elif p.type >= X8:
            assert p.type == type_id + X8 and type_id in ext.gguf_x8_types()
            back = ext.gguf_unrepack(p.raw, type_id, p.rows, k).numpy()
        else:
            assert p.type == type_id
            assert mapped_file(p.raw.data_ptr()) == str(path.resolve())  # used in place, not copied
            back = p.raw.numpy()
        assert np.array_equal(back.reshape(-1), rows.reshape(-1))
        start += p.rows
    assert start == stored.shape[0]


def mapped_file(address: int) -> str | None:
    """The file memory-mapped at `address` in this process (Linux /proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def loaded_tensors(path):
    return gguf.GGUFReader(str(path)).tensors


@pytest.mark.parametrize("name", ["kmix", "legacy", "tied", "qwen2", "lowmix", "iq4mix", "iq3mix", "tqmix",
                                  "iq2mix"])
def test_auto_equals_fp_exactly_on_the_torch_path(quant_files, name, no_kernels):
    """Dequantized per layer on the device, the as-stored model computes exactly what the fp model computes
    from gguf.quants' dequantization: same floats, same GEMMs (Q/K rows routed, not moved)."""
    ids = list(range(3, 40))
    fp = _logits(load_model(quant_files[name], weights="fp"), ids)
    auto = _logits(load_model(quant_files[name], weights="auto"), ids)
    for a, b in zip(auto, fp):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["kmix", "legacy", "qwen2", "lowmix", "iq4mix", "iq3mix", "iq1mix", "tqmix",
                                  "iq2mix"])
def test_auto_with_the_cpu_kernels_tracks_fp(quant_files, name):
    if matmul.cpu_extension() is None or not hasattr(matmul.cpu_extension(), "gguf_linear"):
        pytest.fail("the C++ GGUF kernels did not build")
    ids = list(range(3, 40))
    fp = _logits(load_model(quant_files[name], weights="fp"), ids)
    auto = _logits(load_model(quant_files[name], weights="auto"), ids)
    # int8-rounded activations (llama.cpp's numerics), the prompt's rows included: close, not equal. These tiny
    # random models magnify the rounding (a 16-token prompt on the row kernel alone: KL 0.015 kmix, 0.006 legacy,
    # 0.007 qwen2; SmolLM2-135M Q4_K_M on GPL-3: mean 0.0013, top-1 97.6%, `edgellm perplexity --reference fp`),
    # the ternary one most: where the prompt's rows go through the int8 panel GEMM (no AMX: an AVX2 build here)
    # its prompt's worst row is at KL 0.118 (0.029 through AMX's bf16), every part within 0.2-0.6% of the float64
    # product as in the other mixes; the others at most 0.024 (lowmix). A wrong part or order is far above either
    # bound: tqmix with one part's outputs rolled by 8 gave KL 4.5-6.2 (layers.0 wqkv, wo, w13; layers.1 w2).
    bound = 0.25 if name == "tqmix" else 0.05
    for a, b in zip(auto, fp):
        p, q = torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1)
        kl = (p.exp() * (p - q)).sum(-1).max().item()
        assert kl < bound, kl
    # top-1 agreement over the 37 positions together (the decode step's one row alone is a coin toss where its top
    # two logits lie closer than the rounding moves them: iq1mix's 7.02 / 6.78, KL 0.007)
    a, b = (torch.cat([x.reshape(-1, x.shape[-1]) for x in logits]) for logits in (auto, fp))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_q4_1_files_keep_the_packed_int4_path(bundled_path):
    loaded = load_model(bundled_path, weights="auto", max_seq_len=64)
    assert isinstance(loaded.model.layers[0].feed_forward.w13, QuantLinear)
    assert loaded.runs_as.get("Q4_1", 0) > 100
    assert "f32" not in loaded.runs_as


def test_the_cyclic_collector_is_paused_during_a_load_and_put_back(quant_files):
    """load_model runs with the cyclic collector off (its passes over torch's objects cost half a GGUF tokenizer's
    build) and leaves it as it found it, after a failed load too."""
    import gc

    seen = []
    assert gc.isenabled()
    load_model(quant_files["kmix"], weights="auto", max_seq_len=32, on_tensor=lambda name: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(Exception):
        load_model(quant_files["kmix"].with_name("missing.gguf"))
    assert gc.isenabled()
    gc.disable()
    try:
        load_model(quant_files["kmix"], weights="auto", max_seq_len=32)
        assert not gc.isenabled()  # a caller's choice kept
    finally:
        gc.enable()
    # loads in two threads, the first to start ending first: on until the last ends, then back on
    from edgellm.loading import _CollectorPause

    first, second = _CollectorPause(), _CollectorPause()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()


@pytest.mark.parametrize("converter", ["c++", "numpy"])
def test_requantization_in_chunks_of_rows_equals_the_whole_tensors(monkeypatch, converter):
    """_as_q8_0 requantizes an IQ3_XXS part with the C++ converter where the extension is built, else with
    gguf.quants' numpy in chunks of rows on several threads: either way block for block what gguf.quants gives for
    the whole tensor; a type gguf.quants cannot dequantize is a clear error."""
    from edgellm import loading
    from edgellm.quant import gguf_grid

    if converter == "numpy":
        monkeypatch.setattr(gguf_grid, "convert", lambda *args, **kwargs: None)
    elif matmul.cpu_extension() is None:
        pytest.skip("the C++ extension is not built here (no compiler)")
    converted = []
    if converter == "c++":
        real = gguf_grid.convert
        monkeypatch.setattr(gguf_grid, "convert", lambda *args, **kwargs: converted.append(real(*args, **kwargs))
                            or converted[-1])

    class Source:
        path = "model.gguf"

        def __init__(self, raw, qtype, shape):
            self.data, self.qtype, self.shape, self.released = raw, qtype, shape, []
            self.file = self

        def raw(self, name):
            return self.data, int(self.qtype), self.shape

        def release(self, name):
            self.released.append(name)

    rows, k = 37, 512
    qv, qb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ3_XXS]
    raw = np.random.default_rng(3).integers(0, 256, size=(rows, k // qv * qb), dtype=np.uint8)
    raw.reshape(rows, -1, qb)[:, :, :2] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    want = gguf.quants.quantize(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ3_XXS),
                                gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(loading, "REQUANTIZE_ROWS", 5)  # 8 chunks, 7 of them on the threads
    src = Source(raw, gguf.GGMLQuantizationType.IQ3_XXS, (rows, k))
    got, type_id, shape = loading._as_q8_0(src, "blk.0.ffn_down.weight")
    assert type_id == 8 and shape == (rows, k) and src.released == ["blk.0.ffn_down.weight"]
    assert got.shape == want.shape and np.array_equal(got, want)
    assert (converter == "c++") == (len(converted) == 1 and converted[0] is not None)
    with pytest.raises(loading.UnsupportedModelError, match="model.gguf: tensor t has type"):
        loading._as_q8_0(Source(raw, gguf.GGMLQuantizationType.Q8_1, (rows, k)), "t")


def test_types_without_a_kernel_run_as_q8_0_with_a_warning(tmp_path, no_kernels):
    """A matrix part of a GGUF type that nothing here takes as stored or rewrites exactly (IQ1_M, IQ1_S without the
    extension, as here, whose converter makes their Q6_K form) runs requantized to Q8_0, not as a float copy: each
    weight within half an int8 step of gguf.quants' dequantized value. A matrix of such parts alone takes the packed
    int8 path; one fused with native parts (Q/K/V: IQ1_S, Q4_K, Q4_K) keeps those as stored, in one GGUF linear. The
    logits stay close to the float model's; `--weights fp` keeps the exact float values."""
    folder = make_hf_model(tmp_path / "m", "llama_gqa", seed=1, **SHAPE)
    path = make_gguf(folder, tmp_path / "q1.gguf", quant_types={"ffn_down.weight": "IQ1_M", "attn_q.weight": "IQ1_S",
                                                                 "attn_k.weight": "Q4_K", "attn_v.weight": "Q4_K"})
    with pytest.warns(UserWarning, match="IQ1_M, IQ1_S tensors have no kernel here; they were requantized to Q8_0"):
        loaded = load_model(path, weights="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = load_model(path, weights="fp")
    reader = gguf.GGUFReader(path)

    def exact(name: str) -> torch.Tensor:
        t = next(t for t in reader.tensors if t.name == name)
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()

    def assert_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
        g, w = got.reshape(got.shape[0], -1, 32), want.reshape(want.shape[0], -1, 32)
        step = w.abs().amax(-1, keepdim=True) / 127
        err = (g - w).abs()
        # half a step, plus the fp16 rounding of the step (2^-11 relative) times codes up to 127
        assert (err <= step * (0.5 + 127 / 2048) + 1e-7).all() and err.max() > 0  # rounded, not a float copy

    w2 = loaded.model.layers[0].feed_forward.w2
    assert isinstance(w2, QuantLinear) and w2.bits == 8
    assert_rounded(w2.dequantized_weight(torch.float32), exact("blk.0.ffn_down.weight"))
    assert torch.equal(ref.model.layers[0].feed_forward.w2.weight, exact("blk.0.ffn_down.weight"))
    wqkv = loaded.model.layers[0].attention.wqkv
    assert isinstance(wqkv, GGUFLinear) and wqkv.type_names() == ["Q8_0", "Q4_K", "Q4_K"]
    q_rows = loaded.config.q_size
    ours, stored = wqkv.dequantized_weight(torch.float32), ref.model.layers[0].attention.wqkv.weight
    assert torch.equal(ours[q_rows:], stored[q_rows:])  # the Q4_K parts as stored
    assert_rounded(ours[:q_rows], stored[:q_rows])  # (Q's rows in our order on both sides)
    assert loaded.runs_as.get("Q8_0", 0) >= len(loaded.model.layers) + 1
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 81]])
    a = loaded.model(ids, KVCache(loaded.config, 16, torch.float32, "cpu"), 0, all_logits=True)[0]
    b = ref.model(ids, KVCache(ref.config, 16, torch.float32, "cpu"), 0, all_logits=True)[0]
    # the weights' rounding is checked above; here the wiring (a part in the wrong place gives KL > 0.5). The
    # kernels also round the activations per 32 values, which tiny random models magnify (see above): measured max
    # KL 0.039 over the 8 positions, 0.006 on average
    p, q = torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max().item() < 0.1 and kl.mean().item() < 0.02
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def _embedding_of(tmp_path, type_name: str):
    """(the model, its file) of a GGUF whose token embedding and Q projection are `type_name` (K / V Q4_K), loaded
    `--weights auto` with any warning an error."""
    import warnings as w

    folder = make_hf_model(tmp_path / "m", "llama_gqa", seed=1, **SHAPE)
    path = make_gguf(folder, tmp_path / "e.gguf", quant_types={"token_embd.weight": type_name, "attn_q.weight": type_name,
                                                                "attn_k.weight": "Q4_K", "attn_v.weight": "Q4_K"})
    with w.catch_warnings():
        w.simplefilter("error")
        return load_model(path, weights="auto"), path


def test_iq1_and_ternary_types_run_without_q8_0(quant_files, tmp_path):
    """IQ1_S / IQ1_M / TQ1_0 / TQ2_0 have no kernel as stored. On the CPU with the extension, IQ1_S runs recoded as L4
    (4.25 bits a weight), IQ1_M as L4 per 16 (4.56) and the ternary types as Q2_K blocks (2.625): no warning, their
    values gguf.quants' bit for bit. Without the extension (no converter) the IQ1 types take the Q8_0 route with the
    warning naming them, the ternary types stay Q2_K (numpy); a token embedding of IQ1_S runs as Q6_K (its lookups
    dequantize rows, which L4 blocks would not give)."""
    import warnings as w

    with w.catch_warnings():
        w.simplefilter("error")  # no "requantized" warning
        loaded = load_model(quant_files["iq1mix"], weights="auto")
    assert {"IQ1_S", "Q2_K", "Q6_K"} <= set(loaded.runs_as) and "Q8_0" not in loaded.runs_as
    wo = loaded.model.layers[0].attention.wo
    assert wo.type_names() == ["IQ1_M"] and L4 < wo.part_types[0] % X8 < X8  # recoded, 146 bytes a 256 values
    assert wo.gguf_parts[0].raw.numel() == wo.out_features * wo.in_features // 256 * 146
    wqkv = loaded.model.layers[0].attention.wqkv
    assert wqkv.type_names() == ["IQ1_S", "Q2_K", "Q2_K"] and L4 < wqkv.part_types[0] % X8 < X8
    q_units = loaded.config.q_size * wqkv.in_features // 256  # 136 bytes each (138 in the x8 layout): not Q8_0's 272
    assert q_units * 136 <= wqkv.gguf_parts[0].raw.numel() <= q_units * 138
    with w.catch_warnings():
        w.simplefilter("ignore")
        fp = load_model(quant_files["iq1mix"], weights="fp")
    assert torch.equal(wqkv.dequantized_weight(torch.float32), fp.model.layers[0].attention.wqkv.weight)
    saved = matmul.cpu_extension()
    matmul.set_cpu_extension(None)
    try:
        with pytest.warns(UserWarning, match=r"\.gguf: IQ1_M, IQ1_S tensors have no kernel here; they were requan"):
            off = load_model(quant_files["iq1mix"], weights="auto")
    finally:
        matmul.set_cpu_extension(saved)
    assert "IQ1_S" not in off.runs_as and off.runs_as.get("Q8_0", 0) > 0 and off.runs_as.get("Q2_K", 0) > 0
    emb, path = _embedding_of(tmp_path, "IQ1_S")
    assert emb.model.layers[0].attention.wqkv.type_names()[0] == "IQ1_S"  # the matrix recoded as L4
    assert emb.model.tok_embeddings.type_names() == ["Q6_K"] and "Q8_0" not in emb.runs_as
    reader = gguf.GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ids = torch.tensor([[0, 5, 17, 250]])
    want = torch.from_numpy(gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type)[[0, 5, 17, 250]])
    assert torch.equal(emb.model.tok_embeddings(ids)[0], want.float())


def test_iq2_xs_and_iq2_s_run_recoded_on_the_cpu(quant_files, tmp_path):
    """IQ2_XS / IQ2_S (scales per 16 values) run on the CPU as L4-per-16 blocks: no warning, no Q8_0, 146 bytes a
    256 values (the x8 layout's too) where Q8_0 takes 272, the values gguf.quants' bit for bit. A token embedding of
    IQ2_XS stays as stored (its lookups dequantize the rows they read, gguf.quants' values)."""
    import warnings as w

    with w.catch_warnings():
        w.simplefilter("error")  # no "requantized" warning
        loaded = load_model(quant_files["iq2mix"], weights="auto")
        fp = load_model(quant_files["iq2mix"], weights="fp")
    assert {"IQ2_XS", "IQ2_S", "Q4_K"} <= set(loaded.runs_as) and "Q8_0" not in loaded.runs_as
    wqkv = loaded.model.layers[0].attention.wqkv
    assert wqkv.type_names() == ["IQ2_XS", "IQ2_S", "Q4_K"]
    for part in wqkv.gguf_parts[:2]:
        assert L4 < part.type % X8 < X8 and part.raw.numel() == part.rows * wqkv.in_features // 256 * 146
    assert torch.equal(wqkv.dequantized_weight(torch.float32), fp.model.layers[0].attention.wqkv.weight)
    emb, path = _embedding_of(tmp_path, "IQ2_XS")
    assert emb.model.layers[0].attention.wqkv.type_names()[0] == "IQ2_XS"  # the matrix recoded
    table = emb.model.tok_embeddings
    assert isinstance(table, GGUFEmbedding) and table.type_names() == ["IQ2_XS"] and "Q8_0" not in emb.runs_as
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type)[[0, 5, 17, 250]]
    assert torch.equal(table(torch.tensor([[0, 5, 17, 250]]))[0], torch.from_numpy(want).float())


def test_blocks_made_at_load_are_freed_once_repacked(quant_files):
    """A type rewritten at load (TQ1_0 as Q2_K blocks, in memory) and then repacked for the CPU kernels (x8) is not
    held to the end of the load: install_gguf takes each entry out of the loader's dict as it installs it, so the
    rewritten copy goes once its repacked one exists (it was held: the 1B IQ1_M file, then rewritten as Q6_K, peaked
    0.3 GB higher)."""
    import gc
    import weakref

    from edgellm.loading import build_state_dict, open_source
    from edgellm.model import Transformer
    from edgellm.quant.gguf_linear import install_gguf

    if 10 not in matmul.cpu_extension().gguf_x8_types():
        pytest.skip("this build has no x8 kernels (they need AVX2): nothing is repacked")
    src, cfg, fmt = open_source(quant_files["iq1mix"])
    state, _, parts = build_state_dict(src, cfg, fmt, torch.float32, torch.device("cpu"), as_stored=True)
    (w2,) = parts["layers.0.feed_forward.w2.weight"]  # TQ1_0: Q2_K blocks the loader made
    assert w2.type == 10 and w2.rows % 8 == 0
    made = weakref.ref(w2.raw)
    del w2
    with torch.device("meta"):
        model = Transformer(cfg)
    install_gguf(model, parts, state, torch.float32, torch.device("cpu"))
    gc.collect()
    assert not parts and made() is None
    assert model.layers[0].feed_forward.w2.part_types == [10 + X8]


def test_info_says_what_each_tensor_runs_as(quant_files):
    out = subprocess.run([sys.executable, "-m", "edgellm.cli", "info", "-m", str(quant_files["kmix"]), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    import json

    info = json.loads(out.stdout)
    row = info["weights run as"]
    assert "Q4_K×" in row and "Q6_K×" in row and "Q5_K×" in row and "--weights auto" in row
    # the blocks' bytes (a float32 copy would be ~7x the file), and apart from them the dtype activations compute in
    mib = float(info["weights in memory"].removesuffix(" MiB"))
    assert mib * 2**20 < 2 * quant_files["kmix"].stat().st_size and info["compute dtype"] == "float32"


@pytest.mark.parametrize("name", ["kmix", "legacy", "tied", "qwen2", "lowmix", "iq4mix", "iq3mix", "iq1mix",
                                  "tqmix", "iq2mix"])
def test_fused_cpu_step_runs_gguf_models(quant_files, name):
    """The one-call-per-token C++ step takes a model of GGUF parts (mixed with repacked Q4_x/Q8_0 linears)
    and gives the eager model's logits."""
    from edgellm.kernels.cpu_decode import fused_decode_step

    model = load_model(quant_files[name]).model
    fused_cache = KVCache(model.config, model.rope_len, model.dtype, model.device)
    eager_cache = KVCache(model.config, model.rope_len, model.dtype, model.device)
    step = fused_decode_step(model, fused_cache)  # raises NotFused (with the reason) where it does not apply
    close = []
    with torch.no_grad():
        for pos, tok in enumerate([5, 17, 33, 101, 7, 250, 42, 40, 21, 17, 6, 18]):
            fused = step(torch.tensor([[tok]]), pos)
            eager = model(torch.tensor([[tok]]), eager_cache, pos)[0, -1]
            # Both round each linear's input to int8 per 32 values; their last-bit differences (C++ vs torch
            # norms) flip a rounding now and then, and this tiny random model moves its logits by up to ~2% for
            # one flip. Wiring errors (a part, its order, a bias) move every step by far more.
            assert (fused - eager).abs().max() <= 0.05 * eager.abs().max(), pos
            close.append(torch.allclose(fused, eager, rtol=1e-4, atol=1e-4))
            for f, e in zip(fused_cache.layers, eager_cache.layers):  # the next step from the same cache, so that a
                # flip's K / V do not move every later step (iq1mix: a flip at step 6 held the next five apart)
                for tf, te in zip(f, e):
                    if isinstance(tf, torch.Tensor):
                        tf.copy_(te)
    # most steps equal to rounding (a flip moves one step by up to ~1% here: iq1mix, 3 of the 12); a wrong part or
    # order moves every step past the 5% above
    assert sum(close) >= 2 * len(close) // 3, close


FAMILY_MIX = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_1", "attn_v.weight": "Q8_0", "attn_qkv.weight": "Q5_0",
              "attn_output.weight": "Q4_1", "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_1",
              "ffn_down.weight": "Q4_0", "token_embd.weight": "Q5_0", "output.weight": "Q8_0"}


@pytest.mark.parametrize("variant", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_every_family_runs_its_gguf_blocks_as_stored(tmp_path, variant):
    """Each family's GGUF with quantized blocks: as stored on the torch path equals the dequantized float model
    exactly; the CPU kernels and the fused step serve it."""
    from edgellm.kernels.cpu_decode import fused_decode_step

    folder = make_hf_model(tmp_path / variant, variant, seed=5)  # the tiny shapes are multiples of 32
    path = make_gguf(folder, tmp_path / f"{variant}.gguf", quant_types=FAMILY_MIX, seed=9)
    ids = list(range(3, 30))
    saved = matmul.cpu_extension()
    matmul.set_cpu_extension(None)
    try:
        # both on the torch path (the extension would also take the float model's attention, norms and MLP
        # activation); the exact comparison keeps the int4/int8 linears' prompt GEMM in fp32 (by default it is bf16
        # on CPUs with native bf16, AVX-512 BF16 among them)
        fp = _logits(load_model(path, weights="fp"), ids)
        auto = load_model(path, weights="auto", options=Options(kernel=KernelOptions(prefill_bf16=False)))
        assert any(isinstance(m, GGUFLinear) for m in auto.model.modules())
        for a, b in zip(_logits(auto, ids), fp):
            assert torch.equal(a, b)
    finally:
        matmul.set_cpu_extension(saved)
    model = load_model(path, weights="auto").model
    cache = KVCache(model.config, model.rope_len, model.dtype, model.device)
    step = fused_decode_step(model, cache)
    eager_cache = KVCache(model.config, model.rope_len, model.dtype, model.device)
    with torch.no_grad():
        for pos, tok in enumerate(ids[:5]):
            torch.testing.assert_close(step(torch.tensor([[tok]]), pos),
                                       model(torch.tensor([[tok]]), eager_cache, pos)[0, -1], rtol=1e-4, atol=1e-4)
