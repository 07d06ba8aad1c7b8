"""The decode step as one unit (edgellm/decode_step.py) against independent references.

CPU: the fused C++ step against transformers' logits (fp32 weights) and against the eager model on the
same int8/int4 weights (whose kernels tests/test_quant_linear.py checks against float math).
The graph-capturable forward (position on the device, Triton attention reading it): on CPU under
TRITON_INTERPRET=1, against the eager model; on CUDA, the captured graph replayed across context
buckets, against the eager model.
"""
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere (as test_triton_attention)

from edgellm.cache import DevicePosition, KVCache
from edgellm.decode_step import CudaGraphDecodeStep, DecodePath, compiled_decode_step
from edgellm.options import DecodeOptions, DecodeTuning, Options
from edgellm.generate import Engine
from edgellm.kernels.matmul import has_cpu_kernel
from edgellm.loading import load_model
from tests.fixtures.tiny import FAMILIES, VARIANTS, make_hf_model

PROMPT = [5, 17, 42, 99, 3, 250, 7]
STEPS = [81, 120, 64, 33, 11, 200, 9, 140]


def hf_logits(folder, ids):
    import transformers

    # eager: transformers' SDPA path has no soft-capping (Gemma 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def step_logits(engine: Engine) -> list[torch.Tensor]:
    """Prefill PROMPT, then feed STEPS one at a time through engine.step; the logits of every step."""
    engine.reset()
    engine.prefill(PROMPT)
    out = []
    for t in STEPS:
        out.append(engine.step(torch.tensor([[t]], device=engine.device)).float().cpu().clone())
    assert engine.cache.length == len(PROMPT) + len(STEPS)
    return out


def eager_logits(model, kv: str = "auto") -> list[torch.Tensor]:
    """The eager model's logits over PROMPT then STEPS, on a cache of format `kv` (default: Engine's)."""
    cache = KVCache(model.config, 64, model.dtype, model.device, kv_format=kv)
    model(torch.tensor([PROMPT], device=model.device), cache, 0)
    return [model(torch.tensor([[t]], device=model.device), cache, len(PROMPT) + i)[0, -1].float().cpu()
            for i, t in enumerate(STEPS)]


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Tiny variants with a 64-wide head (the tiny ones have 16): the Triton kernel's int4 path needs
    ≥ 32, as real models have."""
    root = tmp_path_factory.mktemp("wide")
    return {v: make_hf_model(root / v, v, seed=3, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=1024)
            for v in ("llama_gqa", "qwen2_bias")}


needs_ext = pytest.mark.skipif(not has_cpu_kernel(),
                               reason="the C++ extension is disabled or could not be built (see test_cpu_kernels)")


def fp_cache(model) -> KVCache:
    """The fp32 cache (Engine's default on the CPU is float16): for comparisons at fp32's precision."""
    return KVCache(model.config, model.rope_len, model.dtype, model.device, kv_format="fp")


@needs_ext
@pytest.mark.parametrize("kv", ["fp", "default"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_cpu_step_matches_transformers(tiny_models, variant, kv):
    """The fused step's logits against transformers': with the fp32 cache to fp32's precision; with Engine's
    default cache (float16 on the CPU) to what rounding K/V to float16 moves them (measured <= 8e-3 here; that the f16 cache is exactly attention over
    the rounded values: tests/test_kv_cache_classes.py)."""
    folder, _ = tiny_models[variant]
    loaded = load_model(folder, max_seq_len=64)
    engine = Engine(loaded.model, loaded.tokenizer, cache=fp_cache(loaded.model) if kv == "fp" else None)
    assert engine.cache.kv_format == ("fp" if kv == "fp" else "f16")
    assert engine.compiled_step() is not None, "the fused step should serve an fp32 CPU model"
    ref = hf_logits(folder, PROMPT + STEPS)
    tol = 1e-4 if kv == "fp" else 2e-2
    for i, got in enumerate(step_logits(engine)):
        torch.testing.assert_close(got, ref[len(PROMPT) + i], atol=tol, rtol=tol)


@needs_ext
@pytest.mark.parametrize("weights,symmetric", [("int8", True), ("int4", True), ("int4", False)])
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_fused_cpu_step_matches_eager_quantized(tiny_models, variant, weights, symmetric, exact_matmul):
    folder, _ = tiny_models[variant]
    loaded = load_model(folder, max_seq_len=64, weights=weights, symmetric=symmetric, embeddings=weights,
                        options=exact_matmul)
    engine = Engine(loaded.model, loaded.tokenizer, cache=fp_cache(loaded.model), options=exact_matmul)
    assert engine.compiled_step() is not None
    ref = eager_logits(loaded.model, "fp")
    for got, want in zip(step_logits(engine), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_ext
@pytest.mark.parametrize("weights", ["fp", "int8", "int4"])
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_fused_many_rows_equal_one_token_steps(tiny_models, variant, weights):
    """Speculative verification's multi-token call: every row bit for bit the one-token step at its
    position (what keeps greedy speculation identical to plain decoding), K/V included."""
    loaded = load_model(tiny_models[variant][0], max_seq_len=64, weights=weights)
    a, b = (Engine(loaded.model, loaded.tokenizer) for _ in range(2))
    one = step_logits(a)
    b.reset()
    b.prefill(PROMPT)
    step = b.compiled_step()
    rows = step.many(torch.tensor(STEPS[:5]), len(PROMPT)).clone()
    rows2 = step.many(torch.tensor(STEPS[5:]), len(PROMPT) + 5)
    assert b.cache.length == len(PROMPT) + len(STEPS)
    for got, want in zip(list(rows) + list(rows2), one):
        assert torch.equal(got, want)
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.k[:, :b.cache.length], lb.k[:, :b.cache.length])
        assert torch.equal(la.v[:, :b.cache.length], lb.v[:, :b.cache.length])
    with pytest.raises(RuntimeError, match="tokens per call"):
        step.many(torch.zeros(step.max_rows + 1, dtype=torch.long), 0)


@needs_ext
@pytest.mark.parametrize("kv", ["fp", "f16", "int8"])
@pytest.mark.parametrize("weights", ["fp", "int4"])
def test_short_prefill_runs_the_fused_step(tmp_path, kv, weights, monkeypatch):
    """A prompt part of up to max_rows tokens (a chat turn after its cached prefix, or a short first prompt) is
    prefilled by the fused step with the LM head over its last row alone: logits bit for bit those of feeding its
    tokens one step at a time (and `many`'s last row), the same K/V; one token more takes the eager model."""
    folder = make_hf_model(tmp_path / "m", "llama_gqa", seed=11, hidden_size=192, num_attention_heads=3,
                           num_key_value_heads=1, max_position_embeddings=1024)
    loaded = load_model(folder, max_seq_len=1024, weights=weights)
    model = loaded.model
    prompt = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b, c = (Engine(model, loaded.tokenizer, cache=KVCache(model.config, 1024, torch.float32, "cpu", kv_format=kv))
               for _ in range(3))
    for e in (a, b, c):
        e.prefill(prompt[:280])
    step = a.compiled_step()
    n = step.max_rows
    calls = []
    real = type(step).prefill
    monkeypatch.setattr(type(step), "prefill", lambda self, *x: (calls.append(x[0].numel()), real(self, *x))[1])
    got = a.prefill(prompt[:280 + n]).clone()  # the turn: n new tokens after 280 cached
    assert calls == [n] and a.cache.length == 280 + n and a.cached_ids == prompt[:280 + n]
    for t in prompt[280:280 + n]:
        want = b.step(torch.tensor([[t]]))
    assert torch.equal(got, want)
    assert torch.equal(got, c.compiled_step().many(torch.tensor(prompt[280:280 + n]), 280)[-1])
    for la, lb in zip(a.cache.layers, b.cache.layers):
        for x, y in zip(la, lb):
            if isinstance(x, torch.Tensor):  # (a quantized store also holds its group size)
                assert torch.equal(x[:, :280 + n], y[:, :280 + n])
    calls.clear()
    a.prefill(prompt[:280 + n] + prompt[:n + 1])  # n + 1 new tokens: the eager model's chunk
    assert calls == [] and a.cache.length == 280 + 2 * n + 1


@needs_ext
def test_short_prefill_of_gguf_blocks_takes_the_prompt_gemm(tmp_path):
    """GGUF blocks as stored: a prompt part of fewer than 8 tokens is still bit for bit the one-token steps; from 8
    on (cpu_decode.cpp kPrefillGemmRows) the layers' linears take the prompt GEMM, equal to them to fp32 rounding."""
    from edgellm.kernels.matmul import cpu_extension
    from tests.fixtures.tiny import make_gguf
    from tests.test_gguf_as_stored import K_MIX, SHAPE

    folder = make_hf_model(tmp_path / "hf", "llama_gqa", seed=3, **SHAPE)
    loaded = load_model(make_gguf(folder, tmp_path / "kmix.gguf", quant_types=K_MIX, seed=7), max_seq_len=256)
    prompt = torch.randint(0, loaded.model.config.vocab_size, (140,), generator=torch.Generator().manual_seed(3)).tolist()
    for n in (7, 16):
        a, b = (Engine(loaded.model, loaded.tokenizer) for _ in range(2))
        a.prefill(prompt[:100])
        b.prefill(prompt[:100])
        a.compiled_step()  # built (as by the first answer's decode steps)
        got = a.prefill(prompt[:100 + n]).clone()
        for t in prompt[100:100 + n]:
            want = b.step(torch.tensor([[t]]))
        if n < 8 or not cpu_extension().gguf_prompt_gemm_fast():  # (no vectorized prompt GEMM: the row kernel)
            assert torch.equal(got, want)
        else:
            assert not torch.equal(got, want)  # (another order of the same sums)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_ext
@pytest.mark.parametrize("kv", ["fp", "f16", "int8", "int4"])
@pytest.mark.parametrize("weights", ["fp", "int4"])
def test_fused_many_rows_equal_one_token_steps_long_context(tmp_path, kv, weights):
    """The same at 600 cached keys on two threads, where every token's attention splits into key tiles (how
    many depends on its position): still each row bit for bit the one-token step, for fp32 and quantized
    caches."""
    folder = make_hf_model(tmp_path / "m", "llama_gqa", seed=11, hidden_size=192, num_attention_heads=3,
                           num_key_value_heads=1, max_position_embeddings=1024)
    loaded = load_model(folder, max_seq_len=1024, weights=weights)
    model = loaded.model
    prompt = torch.randint(0, model.config.vocab_size, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = [5, 17, 3, 29, 11, 8, 2]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = (Engine(model, loaded.tokenizer, cache=KVCache(model.config, 1024, torch.float32, "cpu", kv_format=kv))
                for _ in range(2))
        a.prefill(prompt)
        one = [a.step(torch.tensor([[t]])).clone() for t in tokens]
        b.prefill(prompt)
        rows = b.compiled_step().many(torch.tensor(tokens), len(prompt))
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(rows, one):
        assert torch.equal(got, want)


def test_compile_modes_from_the_command_line(tiny_models):
    """--compile off / --no-compile run the eager model (same logits as transformers); inductor on the
    CPU is the fused step, as auto."""
    from edgellm.args import engine_from_args
    from edgellm.cli import build_parser

    folder = str(tiny_models["llama_gqa"][0])
    loaded = load_model(folder, max_seq_len=64)
    for argv, fused in ((["--no-compile"], False), (["--compile", "off"], False), (["--compile", "inductor"], True),
                        ([], True)):
        args = build_parser().parse_args(["run", "hi", "-m", folder, *argv])
        step = engine_from_args(args, loaded).compiled_step()
        assert (step is not None) == (fused and has_cpu_kernel()), argv
    engine = Engine(loaded.model, loaded.tokenizer, cache=fp_cache(loaded.model),
                    options=Options(decode=DecodeOptions(compile="off")))
    assert engine.compiled_step() is None and engine.decode_path == DecodePath("eager", "--compile off")
    ref = hf_logits(tiny_models["llama_gqa"][0], PROMPT + STEPS)
    for i, got in enumerate(step_logits(engine)):
        torch.testing.assert_close(got, ref[len(PROMPT) + i], atol=1e-4, rtol=1e-4)


@needs_ext
@pytest.mark.parametrize("kv", ["int8", "int8:32", "int4", "int4:16"])
@pytest.mark.parametrize("weights", ["fp", "int4"])
def test_fused_cpu_step_with_quantized_kv_matches_eager(wide_models, kv, weights, exact_matmul):
    """An int8 / int4 KV cache read in the fused step (quantize-on-write, rotation, dequantize per row inside
    attention) against the eager model on the same cache format; and the codes it writes equal torch's."""
    loaded = load_model(wide_models["llama_gqa"], max_seq_len=64, weights=weights, options=exact_matmul)
    cache = KVCache(loaded.model.config, 64, torch.float32, "cpu", kv_format=kv)
    engine = Engine(loaded.model, loaded.tokenizer, cache=cache, options=exact_matmul)
    assert engine.compiled_step() is not None
    got = step_logits(engine)
    ref_cache = KVCache(loaded.model.config, 64, torch.float32, "cpu", kv_format=kv)
    model = loaded.model
    model(torch.tensor([PROMPT]), ref_cache, 0)
    for i, t in enumerate(STEPS):
        want = model(torch.tensor([[t]]), ref_cache, len(PROMPT) + i)[0, -1]
        # rotation and quantization round in another order than torch's: now and then one code lands one
        # step away at a rounding tie (counted below), which moves later logits of this spread-out tiny
        # model by up to ~1e-2; the next check reads identical cache contents and is tight
        torch.testing.assert_close(got[i], want, atol=3e-2, rtol=1e-2)
    # the fused attention against the eager one over the same cache contents (a copy of the fused cache)
    import copy

    twin = copy.deepcopy(cache)
    n = cache.length
    extra = torch.tensor([[42]])
    fused = engine.step(extra).clone()
    eager = model(extra, twin, n)[0, -1]
    torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)
    n = ref_cache.length
    for a, b in zip(cache.layers, ref_cache.layers):
        for x, y in zip(a, b):  # the same quantization: a rare ±1 code, a 1-ulp fp16 scale, at a tie
            if not isinstance(x, torch.Tensor):
                assert x == y
                continue
            if x.shape[1] != a.k.shape[1]:  # the exact sink rows (the last row is a spare slot)
                torch.testing.assert_close(x[:, :-1], y[:, :-1], atol=1e-5, rtol=1e-5)
                continue
            x, y = x[:, :n].float(), y[:, :n].float()
            if a.k.dtype == torch.uint8 and x.shape[-1] == a.k.shape[-1]:  # int4: compare codes, not bytes
                x, y = torch.cat((x % 16, x // 16), -1), torch.cat((y % 16, y // 16), -1)
            diff = (x - y).abs()
            if x.shape[-1] == a.k.shape[-1] * (2 if a.k.dtype == torch.uint8 else 1):  # codes
                assert (diff > 0).float().mean() < 0.01 and diff.max() <= 1
            else:  # scales / mins
                assert (diff <= y.abs() * 2 ** -10 + 1e-7).all()


@needs_ext
@pytest.mark.parametrize("int_attention", [True, False], ids=["int-path", "avx2-tiles"])
@pytest.mark.parametrize("kv", ["fp", "f16", "int8", "int8:32", "int4", "int4:64"])
@pytest.mark.parametrize("head_dim,heads", [(64, 3), (128, 2)])
def test_fused_quantized_attention_long_context(tmp_path, kv, head_dim, heads, int_attention):
    """The fused step's attention tiles against the eager model over the same cache contents, at lengths
    that are not multiples of 8, 16 or 32, for head dims 64 and 128, GQA ratios 3 and 2. Both paths of an
    int8/int4 cache: on an AVX-512 VNNI build, scores from VPDPBUSD on the codes (q in three int8 digits) and
    values dequantized in registers; and the AVX2 tiles every other x86 build runs (keys dequantized 32 at a
    time, 8 scores per horizontal sum), selected here with DecodeTuning(int_attention=False). The fp32 cache reads
    its rows in place either way."""
    import copy

    options = Options(decode=DecodeOptions(tuning=DecodeTuning(int_attention=int_attention)))

    folder = make_hf_model(tmp_path / "m", "llama_gqa", seed=5, hidden_size=head_dim * heads,
                           num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=1024)
    loaded = load_model(folder, max_seq_len=512)
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (5, 37, 300):  # 5: one quantized row past the 4 exact sink rows
            cache = KVCache(model.config, 512, torch.float32, "cpu", kv_format=kv)
            model(torch.randint(0, model.config.vocab_size, (1, n), generator=g), cache, 0)
            engine = Engine(model, loaded.tokenizer, cache=cache, options=options)
            assert engine.compiled_step() is not None and engine.compiled_step().plan.int_attention == int_attention
            twin = copy.deepcopy(cache)
            extra = torch.tensor([[7]])
            fused = engine.step(extra).clone()
            eager = model(extra, twin, n)[0, -1]
            torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


# The families beside Llama's graph with 64-wide heads (what the AVX2 attention tiles take) and a 560-token window
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
WIDE_FAMILIES = {
    "qwen3": dict(head_dim=64),
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=560),
    "gemma3": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=560),
    "phi4_partial": dict(sliding_window=560, original_max_position_embeddings=2048,
                         rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(16)],
                                       "long_factor": [1.0 + 0.5 * i for i in range(16)]}),
}


@needs_ext
@pytest.mark.parametrize("kv", ["fp", "f16", "int8", "int4"])
@pytest.mark.parametrize("family", list(WIDE_FAMILIES))
def test_fused_family_step_long_context(tmp_path, family, kv):
    """Each family's fused step past 700 cached positions on two threads (keys split into tiles; the sliding
    layers read only their last 560, tiles starting mid-cache): equal to the eager model over the same cache
    contents; and on the float cache a 7-token verification pass bit for bit seven one-token steps."""
    import copy

    folder = make_hf_model(tmp_path / family, family, seed=7, **WIDE, **WIDE_FAMILIES[family])
    loaded = load_model(folder, max_seq_len=1024)
    model = loaded.model
    prompt = torch.randint(0, model.config.vocab_size, (700,), generator=torch.Generator().manual_seed(2)).tolist()
    tokens = [5, 17, 3, 29, 11, 8, 2]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cache = KVCache(model.config, 1024, torch.float32, "cpu", kv_format=kv)
        model(torch.tensor([prompt]), cache, 0)
        engine = Engine(model, loaded.tokenizer, cache=cache)
        assert engine.compiled_step() is not None
        twin = copy.deepcopy(cache)
        for i, t in enumerate(tokens[:3]):
            fused = engine.step(torch.tensor([[t]])).clone()
            eager = model(torch.tensor([[t]]), twin, len(prompt) + i)[0, -1]
            # fp32 sums in another order (C++ tiles vs torch's kernels, which differ between AVX2 and AVX-512
            # builds): 1e-4 held on AVX2, phi4_partial-int8 reached 2.4e-4 on AVX-512
            torch.testing.assert_close(fused, eager, atol=5e-4, rtol=1e-4)
            twin = copy.deepcopy(cache)  # the next step reads identical contents again
        if kv == "fp":
            a, b = (Engine(model, loaded.tokenizer, cache=KVCache(model.config, 1024, torch.float32, "cpu"))
                    for _ in range(2))
            a.prefill(prompt)
            one = [a.step(torch.tensor([[t]])).clone() for t in tokens]
            b.prefill(prompt)
            rows = b.compiled_step().many(torch.tensor(tokens), len(prompt))
            for got, want in zip(rows, one):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


@needs_ext
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_family_greedy_identical_to_eager(tiny_models, family):
    """Greedy generation through the fused step gives the eager model's tokens (and both transformers' logits:
    test_fused_cpu_step_matches_transformers)."""
    from edgellm.generate import Done, GenerationSettings

    loaded = load_model(tiny_models[family][0], max_seq_len=64)
    out = []
    for mode in ("auto", "off"):
        engine = Engine(loaded.model, loaded.tokenizer, options=Options(decode=DecodeOptions(compile=mode)))
        assert (engine.compiled_step() is not None) == (mode == "auto")
        events = list(engine.generate(PROMPT, GenerationSettings(max_tokens=24, ignore_eos=True)))
        assert isinstance(events[-1], Done)
        out.append(events[-1].tokens)
    assert out[0] == out[1] and len(out[0]) == 24


def test_decode_path_names_each_fallback_and_its_reason(tiny_models, capsys, monkeypatch):
    """The decode path is a value: the fused step where it applies, else "eager" and why (the extension off,
    the fused step off, --compile off, a bf16 model); `edgellm info` shows it and `run --debug` prints it."""
    from edgellm import cli
    from edgellm.kernels import matmul

    folder = tiny_models["llama_gqa"][0]
    loaded = load_model(folder, max_seq_len=64)
    model = loaded.model

    def path(options=Options(), m=model):
        return compiled_decode_step(m, KVCache(m.config, 16, m.dtype, "cpu"), options.decode.compile, options)[1]

    if has_cpu_kernel():
        assert path() == DecodePath("fused-cpu")
    assert path(Options(decode=DecodeOptions(fused=False))) == DecodePath("eager", "the fused CPU step is off")
    assert path(Options(decode=DecodeOptions(compile="off"))) == DecodePath("eager", "--compile off")
    bf16 = load_model(folder, max_seq_len=64, dtype=torch.bfloat16).model
    assert path(m=bf16).name == "eager" and "bfloat16" in path(m=bf16).reason
    saved = matmul.cpu_extension()
    matmul.set_cpu_extension(None)
    try:
        no_ext = path()
    finally:
        matmul.set_cpu_extension(saved)
    assert no_ext == DecodePath("eager", "the C++ CPU extension is off or did not build")
    assert str(no_ext) == "eager (the C++ CPU extension is off or did not build)"

    monkeypatch.setattr(cli, "EXTENSIONS", [])
    assert cli.main(["info", "-m", str(folder), "--no-fused", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode path"] == "eager (the fused CPU step is off)"
    monkeypatch.setattr(cli, "EXTENSIONS", [])  # main() appends the subcommands' parsers on every call
    assert cli.main(["run", "hi", "-m", str(folder), "-n", "2", "--compile", "off", "--debug"]) == 0
    assert "edgellm: decode path: eager (--compile off)" in capsys.readouterr().err


def test_unsupported_cache_falls_back_to_eager(tiny_models):
    """A KV cache with fp32 scales is not what the fused CPU step reads: the engine uses the model, same answer."""
    from edgellm.kernels.attention import Int8KV

    loaded = load_model(tiny_models["llama_gqa"][0], max_seq_len=64)
    cache = KVCache(loaded.model.config, 64, torch.float32, "cpu", kv_format="int8")
    cache.layers = [Int8KV(s.k, s.k_scale.float(), s.v, s.v_scale.float(), s.group) for s in cache.layers]
    engine = Engine(loaded.model, loaded.tokenizer, cache=cache)
    step, path = compiled_decode_step(loaded.model, cache)
    assert step is None and path.name == "eager" and "KV cache" in path.reason
    assert engine.decode_path == path
    ref = KVCache(loaded.model.config, 64, torch.float32, "cpu", kv_format="int8")
    ref.layers = [Int8KV(s.k, s.k_scale.float(), s.v, s.v_scale.float(), s.group) for s in ref.layers]
    model = loaded.model
    model(torch.tensor([PROMPT]), ref, 0)
    for i, got in enumerate(step_logits(engine)):
        assert torch.equal(got, model(torch.tensor([[STEPS[i]]]), ref, len(PROMPT) + i)[0, -1])


# ------------------------------------------------------------------------------------------------
# The graph-capturable forward: the position on the device
# ------------------------------------------------------------------------------------------------
def device_pos_logits(model, kv: str, bound: int) -> list[torch.Tensor]:
    cache = KVCache(model.config, 64, model.dtype, model.device, kv_format=kv)
    model(torch.tensor([PROMPT], device=model.device), cache, 0)
    pos = torch.zeros(1, dtype=torch.long, device=model.device)
    at = DevicePosition(pos, bound)
    out = []
    for i, t in enumerate(STEPS):
        pos.fill_(len(PROMPT) + i)
        out.append(model(torch.tensor([[t]], device=model.device), cache, at)[0, -1].float().cpu())
    return out


@pytest.mark.parametrize("kv", ["fp", "int8", "int4"])
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_device_position_forward_matches_eager(wide_models, variant, kv):
    """What a CUDA graph captures (on the CPU: with the Triton kernel interpreted) equals the eager model."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")
    if os.environ.get("TRITON_INTERPRET", "0") in ("0", "") and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 was asked for and there is no GPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(wide_models[variant], max_seq_len=64, device=device)
    ref = eager_logits(loaded.model, kv)
    for got, want in zip(device_pos_logits(loaded.model, kv, bound=64), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", ["fp", "int8"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi4_partial"])
def test_device_position_forward_matches_eager_families(tiny_models, family, kv):
    """The same for the families' windowed / soft-capped layers, which attend through masked_attention with the
    positions read on the device (the other layers through the Triton kernel), local RoPE tables included."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")
    if os.environ.get("TRITON_INTERPRET", "0") in ("0", "") and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 was asked for and there is no GPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(tiny_models[family][0], max_seq_len=64, device=device)
    ref = eager_logits(loaded.model, kv)
    for got, want in zip(device_pos_logits(loaded.model, kv, bound=32), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_graph_needs_a_head_dim_the_kernel_takes(tiny_models):
    """An int4 cache with 16-wide heads is not for the Triton kernel: no graph, and on CUDA the eager
    path's attention falls back to torch instead of failing to compile."""
    from edgellm.decode_step import cuda_graph_supported
    from edgellm.kernels.attention import Int4KV, triton_supports

    loaded = load_model(tiny_models["llama_gqa"][0], max_seq_len=64)
    assert loaded.model.config.head_dim == 16
    cache = KVCache(loaded.model.config, 64, torch.float32, "cpu", kv_format="int4")
    assert isinstance(cache.layers[0], Int4KV) and not triton_supports(cache.layers[0], 16)
    assert not cuda_graph_supported(loaded.model, cache)
    assert triton_supports(KVCache(loaded.model.config, 64, torch.float32, "cpu").layers[0], 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the device machine)")
@pytest.mark.parametrize("weights,kv,mode", [("fp", "fp", "auto"), ("int8", "fp", "auto"), ("int4", "fp", "auto"),
                                             ("fp", "int4", "auto"), ("int4", "int4", "auto"), ("int8", "int8", "auto"),
                                             ("fp", "fp", "inductor")])
def test_cuda_graph_step_across_buckets(wide_models, weights, kv, mode):
    """Replays across the 256 → 512 bucket boundary: bit for bit the forward they captured (run op by op
    with the position on the device), and close to the eager model's logits (which attend with SDPA or
    the kernel's host-side lengths: other rounding, larger with bf16 tinygemm activations for int4)."""
    loaded = load_model(wide_models["llama_gqa"], max_seq_len=600, device="cuda", dtype=torch.float32,
                        weights=weights)
    model = loaded.model
    cache = KVCache(model.config, 600, model.dtype, "cuda", kv_format=kv)
    engine = Engine(model, loaded.tokenizer, cache=cache, options=Options(decode=DecodeOptions(compile=mode)))
    step = engine.compiled_step()
    assert isinstance(step, CudaGraphDecodeStep)
    ref_cache = KVCache(model.config, 600, model.dtype, "cuda", kv_format=kv)
    dev_cache = KVCache(model.config, 600, model.dtype, "cuda", kv_format=kv)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=gen).tolist()
    engine.prefill(ids[:250])
    for c in (ref_cache, dev_cache):
        model(torch.tensor([ids[:250]], device="cuda"), c, 0)
    pos_t = torch.zeros(1, dtype=torch.long, device="cuda")
    tol = 5e-2 if weights == "int4" else 2e-3
    for pos in range(250, 300):  # crosses the 256 bucket
        tok = torch.tensor([[ids[pos]]], device="cuda")
        got = engine.step(tok).clone()
        pos_t.fill_(pos)
        same_graph = model(tok, dev_cache, DevicePosition(pos_t, step.bucket(pos)))[0, -1]
        if mode == "auto":
            assert torch.equal(got, same_graph), pos
        else:  # inductor fuses (and so rounds) differently
            torch.testing.assert_close(got, same_graph, atol=tol, rtol=tol)
        torch.testing.assert_close(got, model(tok, ref_cache, pos)[0, -1], atol=tol, rtol=tol)
    assert sorted(step.graphs) == [256, 512]
    assert cache.length == 300
