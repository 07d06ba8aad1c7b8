"""GGUF blocks multiplied as stored by the Triton kernels (kernels/triton_gguf.py), what CUDA runs.

By default under TRITON_INTERPRET=1 on CPU tensors (CI, no GPU); on a CUDA machine `TRITON_INTERPRET=0 pytest
tests/test_triton_gguf.py` compiles them and runs the same cases on the GPU, plus the model-level ones (a GGUF model
on CUDA against the same file's float model, and in the CUDA-graph decode step). References: gguf.quants.dequantize
and float64 products.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.triton_mode import DEVICE, INTERPRET  # before triton is imported (sets TRITON_INTERPRET)
import gguf  # noqa: E402

from edgellm.kernels import triton_gguf as TG  # noqa: E402
from edgellm.quant import gguf_linear  # noqa: E402
from edgellm.quant.gguf_linear import GGUFLinear, GGUFPart  # noqa: E402
from tests.fixtures.tiny import random_blocks  # noqa: E402
NAMES = {t: gguf.GGMLQuantizationType(t).name for t in TG.TYPES}
SMALL = [t for t in TG.TYPES if TG.TYPES[t][1] == 32]  # the 32-value block types: rows need not be 256-multiples


def blocks(type_id: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks on DEVICE, their gguf.quants dequantization, float32 [n, k] on the CPU)."""
    raw = random_blocks(NAMES[type_id], n, k, np.random.default_rng(seed))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id)).reshape(n, k)
    return torch.from_numpy(raw).to(DEVICE), torch.from_numpy(np.ascontiguousarray(ref))


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 (w: gguf.quants' float32 values, as the kernel multiplies them)."""
    return x.cpu().double() @ w.double().T


@pytest.mark.parametrize("type_id", sorted(TG.TYPES), ids=NAMES.get)
def test_dequantize_bit_for_bit_gguf_quants(type_id):
    k = 512 if type_id not in SMALL else 96  # 3 blocks: a unit of 8 blocks partly past the row's end
    raw, ref = blocks(type_id, 21, k, seed=type_id)
    got = TG.gguf_dequantize([(raw, type_id, 21, None)], k, torch.float32).cpu()
    assert np.array_equal(got.numpy().view(np.uint32), ref.numpy().view(np.uint32))
    half = TG.gguf_dequantize([(raw, type_id, 21, None)], k, torch.bfloat16).cpu()
    assert torch.equal(half, ref.to(torch.bfloat16))


@pytest.mark.parametrize("type_id", sorted(TG.TYPES), ids=NAMES.get)
@pytest.mark.parametrize("m,k,launch", [(1, 512, None), (3, 1280, None), (16, 512, None), (2, 1280, (4, 2, 4)),
                                        (1, 768, (2, 8, 2))])
def test_rows_against_float64(type_id, m, k, launch):
    """Every launch of the sweep's kinds (rows per program, units per iteration, warps), with units past the row's
    end (1280 values: 5 of the 8 an iteration takes), and blocks past it (the small types at k - 224)."""
    k = k if type_id not in SMALL else k - 224  # e.g. 288 = 9 blocks: the second unit holds one
    n = 13  # not a multiple of the programs' rows
    raw, ref = blocks(type_id, n, k, seed=10 + type_id)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = TG.gguf_rows(x.to(DEVICE), [(raw, type_id, n, None)], n, launch=launch).cpu()
    want = reference(x, ref)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    xb = x.to(torch.bfloat16)
    got_b = TG.gguf_rows(xb.to(DEVICE), [(raw, type_id, n, None)], n, torch.float32, launch).cpu()
    want_b = reference(xb, ref)
    assert (got_b.double() - want_b).abs().max() <= 1e-5 * want_b.abs().max()


def test_a_rows_sums_do_not_depend_on_the_others():
    """A verification of 7 tokens gives each row the logits a one-token step gives it, bit for bit."""
    raw, _ = blocks(12, 24, 512, seed=3)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    many = TG.gguf_rows(x, [(raw, 12, 24, None)], 24)
    for r in (0, 4, 6):
        assert torch.equal(many[r], TG.gguf_rows(x[r:r + 1], [(raw, 12, 24, None)], 24)[0])


def test_parts_of_other_types_with_an_output_index():
    """A fused Q/K/V of three types, the second part's rows permuted (llama.cpp's RoPE order)."""
    k = 256
    specs = [(12, 16), (14, 8), (8, 8)]  # Q4_K, Q6_K, Q8_0
    parts, refs, start = [], [], 0
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    for i, (t, rows) in enumerate(specs):
        raw, ref = blocks(t, rows, k, seed=20 + i)
        index = (start + perm).to(DEVICE) if i == 1 else None
        parts.append((raw, t, rows, index))
        if i == 1:  # stored row j is output row perm[j]
            placed = torch.empty_like(ref)
            placed[perm.long()] = ref
            ref = placed
        refs.append(ref)
        start += rows
    w = torch.cat(refs)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    got = TG.gguf_rows(x.to(DEVICE), parts, start).cpu()
    want = reference(x, w)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(TG.gguf_dequantize(parts, k, torch.float32).cpu(), w)


def test_refusals():
    raw, _ = blocks(8, 4, 64, seed=0)
    with pytest.raises(ValueError, match="up to 16 rows"):
        TG.gguf_rows(torch.zeros(17, 64, device=DEVICE), [(raw, 8, 4, None)], 4)
    assert not TG.supports(12, 384)  # a K-quant along a row that is not whole super-blocks
    assert not TG.supports(18, 256)  # IQ3_XXS: dequantized by torch ops on CUDA (through its grid)
    assert TG.supports(2, 96)


@pytest.fixture
def triton_here(monkeypatch):
    """GGUFLinear dispatching to the Triton kernels for tensors on DEVICE (on the CPU: interpreted)."""
    monkeypatch.setattr(gguf_linear, "triton_gguf", lambda device: TG)


def test_gguf_linear_dispatch(triton_here, monkeypatch):
    """Up to 16 rows: the row kernel, its bias added; more: the layer dequantized by the kernel, then F.linear."""
    raw_a, ref_a = blocks(12, 16, 256, seed=5)
    raw_b, ref_b = blocks(6, 8, 256, seed=6)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(3))
    lin = GGUFLinear([GGUFPart(raw_a, 12, 16), GGUFPart(raw_b, 6, 8)], 256, bias.to(DEVICE))
    w = torch.cat([ref_a, ref_b])
    calls = []
    for name in ("gguf_rows", "gguf_dequantize"):
        real = getattr(TG, name)
        monkeypatch.setattr(TG, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    for m, how in ((1, "gguf_rows"), (16, "gguf_rows"), (17, "gguf_dequantize")):
        x = torch.randn(1, m, 256, generator=torch.Generator().manual_seed(m))
        calls.clear()
        assert lin.method(x.to(DEVICE)) == ("triton" if m <= 16 else "dequantize")
        got = lin(x.to(DEVICE)).cpu()
        assert calls == [how]
        want = F.linear(x.double(), w.double(), bias.double())
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.fixture(autouse=True)
def _fresh_failures(monkeypatch):
    """Each test starts with no type marked failed and every launch unchecked (TG.FAILED is process-wide)."""
    monkeypatch.setattr(TG, "FAILED", set())
    monkeypatch.setattr(TG, "_RAN", set())


def test_a_kernel_that_fails_here_falls_back_to_torch_ops(triton_here, monkeypatch):
    """A kernel Triton cannot build on this machine (another compiler version, say) is not fatal: the first launch's
    error marks its type failed, GGUFLinear warns and dequantizes that type by torch ops from then on."""
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PTXAS error: something this compiler refuses")
            return launch

    monkeypatch.setattr(TG, "_rows_kernel", Broken())
    monkeypatch.setattr(gguf_linear.K, "cpu_extension", lambda: None)  # (on a CPU: the torch ops, not the C++ rows)
    raw, ref = blocks(23, 8, 256, seed=4)  # IQ4_XS
    lin = GGUFLinear([GGUFPart(raw, 23, 8)], 256)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with pytest.raises(TG.KernelFailed, match="GGUF type 23 failed here: RuntimeError: PTXAS error"):
        TG.gguf_rows(x, [(raw, 23, 8, None)], 8)
    TG.FAILED.clear()
    with pytest.warns(RuntimeWarning, match="dequantized by torch ops instead"):
        got = lin(x).cpu()
    assert TG.FAILED == {23} and lin.method(x) == "dequantize"
    want = reference(x.cpu(), ref)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_switch_off_keeps_torch_ops(monkeypatch):
    monkeypatch.setattr(gguf_linear, "TRITON_GGUF", False)
    assert gguf_linear.triton_gguf(torch.device("cuda")) is None
    assert gguf_linear.triton_gguf(torch.device("cpu")) is None  # the CPU has its C++ kernels


# ------------------------------------------------------------------------------------ a model on CUDA
cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="a GGUF model on CUDA needs a GPU")


@pytest.fixture(scope="module")
def mix_files(tmp_path_factory):
    from tests.fixtures.tiny import make_gguf, make_hf_model
    from tests.test_gguf_as_stored import IQ4_MIX, K_MIX, LEGACY_MIX, LOW_MIX, SHAPE

    root = tmp_path_factory.mktemp("triton-gguf")
    tied = {k: v for k, v in K_MIX.items() if k != "output.weight"}  # the head multiplies the embedding's blocks
    return {name: make_gguf(make_hf_model(root / name, variant, seed=3, **SHAPE), root / f"{name}.gguf",
                            quant_types=types, seed=7)
            for name, variant, types in (("kmix", "llama_gqa", K_MIX), ("legacy", "llama_gqa", LEGACY_MIX),
                                         ("lowmix", "llama_gqa", LOW_MIX), ("iq4mix", "llama_gqa", IQ4_MIX),
                                         ("tied", "llama_tied", tied), ("qwen2", "qwen2_bias", K_MIX))}


def test_loader_keeps_exact_types_as_blocks_where_triton_takes_them(mix_files, triton_here):
    """Where the Triton kernels serve (CUDA), a Q8_0 / Q4_0 / Q4_1 matrix stays GGUF blocks instead of our packed
    int8 / int4 (whose CUDA kernels would round its fp16 scales to bf16 in a second copy, or dequantize per call)."""
    from edgellm.loading import load_model
    from edgellm.quant.linear import QuantLinear

    model = load_model(mix_files["legacy"], weights="auto").model
    wo = model.layers[0].attention.wo  # Q8_0 alone: the exact route on a CPU
    assert isinstance(wo, GGUFLinear) and wo.type_names() == ["Q8_0"]
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize("name", ["kmix", "legacy", "lowmix", "iq4mix", "tied", "qwen2"])
def test_model_through_the_kernels_against_float(mix_files, triton_here, monkeypatch, name):
    """What a CUDA model runs, on this device (interpreted on a CPU): every linear of a GGUF model multiplies its
    stored blocks with the Triton kernels (a 20-token prompt through the dequantization kernel, then one token
    through the row kernel, fused parts, permuted Q/K rows, a head tied to the embedding, Qwen2's biases); its logits
    are the float model's (the same file with `--weights fp`) to float32 rounding."""
    from edgellm.cache import KVCache
    from edgellm.loading import load_model

    monkeypatch.setattr(gguf_linear, "repack_for_cpu", lambda parts, k, release=None: parts)  # CUDA keeps them
    if INTERPRET:  # 16 rows a program: a sixteenth of the interpreted programs (the launches' sweep is tested above)
        launch = TG._launch
        monkeypatch.setattr(TG, "_launch", lambda n, k: (16,) + launch(n, k)[1:])
    auto = load_model(mix_files[name], weights="auto").model
    fp = load_model(mix_files[name], weights="fp").model
    assert all(m.method(torch.zeros(1, m.in_features)) == "triton" for m in auto.modules() if isinstance(m, GGUFLinear))
    ids = torch.randint(0, auto.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (auto, fp):
        cache = KVCache(model.config, 64, model.dtype, "cpu")
        with torch.no_grad():
            outs.append((model(ids[:, :-1], cache, 0), model(ids[:, -1:], cache, 20)))
    for got, want in zip(outs[0], outs[1]):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert not TG.FAILED  # every product ran the kernels (none fell back)


@cuda
@pytest.mark.parametrize("name", ["kmix", "legacy", "lowmix", "iq4mix"])
def test_cuda_model_as_stored_against_float(mix_files, name):
    """`--weights auto` on CUDA: every layer linear multiplies its blocks with the Triton kernel at decode; the
    logits are the float model's (the same file with `--weights fp`, dequantized by gguf.quants at load) to bf16
    rounding; no float copy of the weights is held."""
    from edgellm.cache import KVCache
    from edgellm.loading import load_model

    auto = load_model(mix_files[name], weights="auto", device="cuda", dtype=torch.bfloat16).model
    fp = load_model(mix_files[name], weights="fp", device="cuda", dtype=torch.bfloat16).model
    from edgellm.quant.linear import QuantLinear

    assert not any(isinstance(m, QuantLinear) for m in auto.modules())  # Q8_0 / Q4_0 too stay blocks on CUDA
    linears = [m for m in auto.layers.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.method(torch.zeros(1, m.in_features, device="cuda")) == "triton" for m in linears)
    assert not any(p.is_floating_point() and p.numel() >= 256 * 256 for p in auto.parameters())
    ids = torch.randint(0, auto.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)).cuda()
    outs = []
    for model in (auto, fp):
        cache = KVCache(model.config, 64, model.dtype, "cuda")
        with torch.no_grad():
            pre = model(ids[:, :-1], cache, 0, all_logits=True).float()
            step = model(ids[:, -1:], cache, ids.shape[1] - 1).float()
        outs.append((pre, step))
    (pre_a, step_a), (pre_f, step_f) = outs
    # prefill: the same bf16 weights (dequantized bit for bit), the same GEMMs (up to cuBLAS's choice of kernel)
    assert (pre_a - pre_f).abs().max() <= 1e-3 * pre_f.abs().max()
    scale = step_f.abs().max()
    assert (step_a - step_f).abs().max() <= 0.03 * scale  # decode: other summation order, bf16 activations
    assert not TG.FAILED  # every type's kernels built on this GPU (none fell back to torch ops)


@cuda
def test_cuda_graph_decode_step_runs_the_blocks(mix_files):
    """The CUDA-graph decode step captures the Triton products: greedy tokens as the eager model's."""
    from edgellm.decode_step import CudaGraphDecodeStep
    from edgellm.generate import Done, Engine, GenerationSettings
    from edgellm.loading import load_model
    from edgellm.options import DecodeOptions, Options

    loaded = load_model(mix_files["kmix"], weights="auto", device="cuda", dtype=torch.bfloat16, max_seq_len=256)
    answers = []
    for mode in ("auto", "off"):
        engine = Engine(loaded.model, loaded.tokenizer, options=Options(decode=DecodeOptions(compile=mode)))
        events = list(engine.generate(list(range(5, 25)), GenerationSettings(max_tokens=24, ignore_eos=True)))
        if mode == "auto":
            assert isinstance(engine.compiled_step(), CudaGraphDecodeStep)
        done = events[-1]
        assert isinstance(done, Done) and len(done.tokens) == 24
        answers.append(done.tokens)
    assert answers[0] == answers[1]
