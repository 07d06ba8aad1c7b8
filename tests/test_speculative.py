"""Speculative decoding (edgellm/speculative.py, Engine.generate with a proposer) is exact.

Greedy: every proposer gives plain decoding's tokens, token for token, across γ boundaries, max-token
limits, stops and the end of the context, and leaves the cache plain decoding leaves. Sampling: the
joint distribution of the first tokens equals the target's exact distribution (chi-square), and the
same test rejects a wrong residual; filters (temperature, top-k/p, min-p, repetition penalty) are
applied identically to draft and target (a draft equal to the target is always accepted).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import threading

import pytest
import torch

from edgellm import speculative
from edgellm.cache import KVCache
from edgellm.errors import EdgeLLMError
from edgellm.generate import Done, Engine, GenerationSettings, Token
from edgellm.loading import load_model
from edgellm.model import Transformer
from edgellm.sampling import SamplingSettings, probabilities
from edgellm.speculative import (GAMMA_MAX, DraftModelProposer, GammaController, PromptLookupProposer, VerifyCosts,
                                 SelfDraftProposer, check_tokenizers, make_proposer, max_draft_tokens)

PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 33, 8],
           [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],  # repetitive: lookup proposes runs
           [40, 41, 42]]
LENGTHS = (1, 2, 5, 6, 19)  # around γ = 4 boundaries (1 + 4 per fully accepted round) and beyond


# ------------------------------------------------------------------------------------------------
# Models and helpers
# ------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def threads(request):
    """One thread for the tiny models: their ops are microseconds, and a second OpenMP thread only adds
    hand-offs (60x slower per token on a busy 2-core machine). The bundled-model tests keep two."""
    saved = torch.get_num_threads()
    torch.set_num_threads(saved if "bundled" in request.fixturenames or "bundled_path" in request.fixturenames
                          else 1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models["llama_gqa"][0])


@pytest.fixture(scope="module")
def other(tiny_models):
    """Another tiny model with the same tokenizer (different random weights): a draft that is mostly wrong."""
    return load_model(tiny_models["llama_tied"][0])


def run(engine: Engine, prompt: list[int], settings: GenerationSettings, stop=None) -> tuple[Done, list[Token]]:
    events = list(engine.generate(prompt, settings, stop))
    done = events[-1]
    assert isinstance(done, Done)
    return done, [e for e in events if isinstance(e, Token)]


_plain_memo: dict = {}


def plain(target, prompt: list[int], n: int, ctx: int = 96, sampling: SamplingSettings | None = None) -> Done:
    """Plain greedy decoding (memoised: the same call is asked by many tests)."""
    key = (id(target), tuple(prompt), n, ctx, repr(sampling))
    if key not in _plain_memo:
        s = GenerationSettings(max_tokens=n, ignore_eos=True, sampling=sampling or SamplingSettings())
        _plain_memo[key] = run(Engine(target.model, target.tokenizer, ctx), prompt, s)[0]
    return _plain_memo[key]


def proposer(name: str, target, other):
    """A fresh proposer by name (through make_proposer, as --draft builds it)."""
    if name == "model":
        return make_proposer(str(other.path), target)
    return make_proposer(name, target)


def assert_caches_equal(a: KVCache, b: KVCache, n: int | None = None) -> None:
    """K/V of the first n positions agree (verification runs γ+1 rows through the GEMM and the masked
    SDPA where plain decoding runs one: the same values up to float summation order, which in a float16 cache can
    round a value to the neighbouring half: one ulp, 2^-10 relative)."""
    n = a.length if n is None else n
    assert b.length == a.length
    for la, lb in zip(a.layers, b.layers):
        rtol = 1e-3 if lb.k.dtype == torch.float16 else 1e-5
        torch.testing.assert_close(lb.k[:, :n], la.k[:, :n], atol=2e-5, rtol=rtol)
        torch.testing.assert_close(lb.v[:, :n], la.v[:, :n], atol=2e-5, rtol=rtol)


# ------------------------------------------------------------------------------------------------
# Greedy: identical to plain decoding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [None, 1, 4])
@pytest.mark.parametrize("name", ["lookup", "self", "self:int4:L1", "model"])
def test_greedy_identical_to_plain(target, other, name, gamma):
    for prompt in PROMPTS:
        ref = plain(target, prompt, max(LENGTHS))
        for n in LENGTHS:
            engine = Engine(target.model, target.tokenizer, 96, draft=proposer(name, target, other),
                            draft_tokens=gamma)
            done, toks = run(engine, prompt, GenerationSettings(max_tokens=n, ignore_eos=True))
            assert done.tokens == ref.tokens[:n], (name, gamma, prompt, n)
            assert [t.id for t in toks if t.id >= 0] == done.tokens
            assert done.stats.finish_reason == "length" and done.stats.generated_tokens == n
            # the cache plain decoding leaves: every emitted token but the last
            assert engine.cache.length == len(prompt) + n - 1
            assert engine.cached_ids == (prompt + done.tokens)[:engine.cache.length]
            # (adaptive lookup may verify nothing in a round, a plain step, where a guess does not pay)
            lo = 0 if name == "lookup" and gamma is None else 1
            assert all(lo <= g <= GAMMA_MAX for g in done.stats.draft_gamma_history[:-1] or [1])
            if gamma is not None:  # a fixed γ is only shortened by max_tokens
                assert all(g == min(gamma, n - 1 - i) for g, i in
                           zip(done.stats.draft_gamma_history, _emitted_before_rounds(toks)))


def _emitted_before_rounds(toks: list[Token]) -> list[int]:
    """How many tokens had been emitted when each verification round started (tokens of one round
    share a time stamp; the first token comes from the prefill)."""
    out, seen, last_t = [], 0, None
    for t in toks:
        if t.id < 0:
            continue
        if last_t is not None and t.t != last_t:
            out.append(seen)
        seen += 1
        last_t = t.t
    return out + [seen]


def test_greedy_identical_with_repeat_penalty_and_chat_turns(target, other):
    """The penalty shifts the argmax by the accepted prefix; a second turn reuses both caches."""
    s = SamplingSettings(repeat_penalty=1.5, repeat_last_n=8)
    for name in ("lookup", "self", "model"):
        engine = Engine(target.model, target.tokenizer, 96, draft=proposer(name, target, other), draft_tokens=3)
        prompt = PROMPTS[1]
        for turn in range(2):
            ref = plain(target, prompt, 14, sampling=s)
            done, _ = run(engine, prompt, GenerationSettings(max_tokens=14, ignore_eos=True, sampling=s))
            assert done.tokens == ref.tokens, (name, turn)
            assert turn == 0 or done.stats.reused_tokens > 0
            prompt = prompt + done.tokens + [40, 41]


def test_drafts_marked_and_stats(target):
    """A good draft (the target's int4 copy) gets accepted; events say which tokens came from drafts."""
    prompt = PROMPTS[1] * 3
    ref = plain(target, prompt, 30)
    done, toks = run(Engine(target.model, target.tokenizer, 96, draft=SelfDraftProposer(target.model, search=False)),
                     prompt, GenerationSettings(max_tokens=30, ignore_eos=True))
    st = done.stats
    assert done.tokens == ref.tokens
    assert st.draft == "self:int4" and st.draft_proposed > 0 and st.draft_accepted > 0
    assert sum(t.from_draft for t in toks) == st.draft_accepted
    assert not toks[0].from_draft  # the first token comes from the prefill
    assert st.acceptance_rate == pytest.approx(st.draft_accepted / st.draft_proposed)
    assert st.mean_accepted_length == pytest.approx(st.draft_accepted / st.draft_rounds)
    assert 1 <= st.draft_gamma <= GAMMA_MAX and st.speedup_estimate > 0
    assert len(st.token_latencies_s) == 29 and st.decode_tok_s > 0
    assert st.draft_s > 0 and st.verify_s > 0


def test_self_draft_formats(target):
    """`self` is an int4 asymmetric g32 copy with an int8 LM head; `:sym` asks for symmetric int4; the
    embedding and norms are the target's own tensors. The draft's weights dequantize to within one
    quantization step of the target's."""
    from edgellm.quant.linear import QuantLinear

    for spec, asym in (("self", True), ("self:asym", True), ("self:int4:sym", False), ("self:sym:L1", False)):
        draft = make_proposer(spec, target).model
        for name, mod in draft.named_modules():
            if isinstance(mod, QuantLinear):
                bits = 8 if name == "output" else 4
                assert mod.bits == bits and mod.group_size == 32, (spec, name)
                assert (mod.mins is not None) == (asym and bits == 4), (spec, name)
        assert draft.tok_embeddings is target.model.tok_embeddings and draft.norm is target.model.norm
        w = target.model.layers[0].attention.wqkv.weight
        dq = draft.layers[0].attention.wqkv.dequantized_weight(torch.float32)
        step = (w.reshape(w.shape[0], -1, 32).amax(-1) - w.reshape(w.shape[0], -1, 32).amin(-1)) / 15
        assert ((dq - w).abs().reshape(w.shape[0], -1, 32).amax(-1) <= step * (0.5 if asym else 1.1) + 1e-4).all()
    assert make_proposer("self:int4:L1", target).model.config.n_layers == 1


# ------------------------------------------------------------------------------------------------
# The bundled model (real weights, real tokenizer)
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bundled_greedy_identical(bundled):
    tok = bundled.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content":
                               "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."}])
    s = GenerationSettings(max_tokens=24)
    ref, _ = run(Engine(bundled.model, tok, 512), prompt, s)
    for spec in ("lookup", "self"):
        done, toks = run(Engine(bundled.model, tok, 512, draft=make_proposer(spec, bundled)), prompt, s)
        assert done.tokens == ref.tokens and done.text == ref.text, spec
        assert done.stats.finish_reason == ref.stats.finish_reason
        assert done.stats.draft_accepted > 0, spec  # the answer repeats the prompt: drafts get accepted
        # the stats count what verification accepted; an accepted EOS (and drafts past it) is not emitted
        emitted = sum(t.from_draft for t in toks)
        assert 0 < emitted <= done.stats.draft_accepted <= emitted + done.stats.draft_gamma_history[-1]


# ------------------------------------------------------------------------------------------------
# Sampling: exactly the target's distribution
# ------------------------------------------------------------------------------------------------
VOCAB = 8  # a small vocabulary: the joint of 4 tokens under top-k 3 has 81 cells


def _small_vocab_models(cfg):
    """A target with an 8-token vocabulary and a draft that is a noisy copy of it: their top-3 sets
    overlap but their distributions differ, so drafts are often rejected and the residual matters."""
    cfg = dataclasses.replace(cfg, vocab_size=VOCAB, tie_embeddings=False)
    torch.manual_seed(1)
    t = Transformer(cfg)
    with torch.no_grad():
        for name, p in t.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    t.setup_rope(64)
    d = copy.deepcopy(t)
    with torch.no_grad():
        d.output.weight.add_(0.5 * torch.randn_like(d.output.weight))
    return t.eval().requires_grad_(False), d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def small_vocab(target):
    return _small_vocab_models(target.config)


def exact_joint(model, prompt: list[int], s: SamplingSettings, k: int) -> dict[tuple, float]:
    """P(t1..tk) computed from the target's logits alone (fresh prefill per prefix, float64)."""
    def dist(ids):
        cache = KVCache(model.config, 64, model.dtype, model.device)
        with torch.no_grad():
            return probabilities(model(torch.tensor([ids]), cache, 0)[0, -1:], s)[0].double()

    joint = {(): 1.0}
    for _ in range(k):
        nxt = {}
        for prefix, pr in joint.items():
            p = dist(prompt + list(prefix))
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        joint = nxt
    return joint


def chi_square_pvalue(counts: dict, joint: dict, n: int) -> float:
    """Pearson's chi-square of observed counts against n · joint; cells expecting < 5 pooled."""
    assert sum(counts.get(key, 0) for key in joint) == n, "a sample outside the target's support"
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for key, p in joint.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
        else:
            stat += (o - e) ** 2 / e
            cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(engine: Engine, prompt: list[int], s: SamplingSettings, k: int, n: int) -> dict:
    counts: dict = {}
    for i in range(n):
        settings = GenerationSettings(max_tokens=k, ignore_eos=True, sampling=dataclasses.replace(s, seed=7919 + i))
        done = list(engine.generate(prompt, settings))[-1]
        key = tuple(done.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _sampling_exactness(model, tokenizer, make_draft, prompt, s, k, n, monkeypatch, gamma=2):
    """p-values of the speculative samples against the exact joint: as built, and with a wrong residual."""
    joint = exact_joint(model, prompt, s, k)
    engine = Engine(model, tokenizer, 64, draft=make_draft(), draft_tokens=gamma)
    p_ok = chi_square_pvalue(sample_counts(engine, prompt, s, k, n), joint, n)
    # the same test must catch a wrong residual: after a rejection, redraw from p itself
    with monkeypatch.context() as m:
        m.setattr(speculative, "residual", lambda p, q: p)
        engine = Engine(model, tokenizer, 64, draft=make_draft(), draft_tokens=gamma)
        p_bad = chi_square_pvalue(sample_counts(engine, prompt, s, k, n), joint, n)
    return p_ok, p_bad


@pytest.mark.slow
def test_sampling_matches_target_distribution(target, small_vocab, monkeypatch):
    """t1 from the prefill, t2 and t3 drafted (γ = 2), t4 the bonus token or a later round's: the joint
    of all four against the exact distribution, with a draft model that is often rejected."""
    t, d = small_vocab
    s = SamplingSettings(temperature=1.0, top_k=3)
    p_ok, p_bad = _sampling_exactness(t, target.tokenizer, lambda: DraftModelProposer(d), [3, 5, 1], s, 4, 800,
                                      monkeypatch)
    assert p_ok > 1e-3, f"speculative sampling differs from the target's distribution (p = {p_ok:.2e})"
    assert p_bad < 1e-6, f"the chi-square test did not notice a wrong residual (p = {p_bad:.2e})"


@pytest.mark.slow
def test_sampling_with_lookup_matches_target_distribution(target, small_vocab, monkeypatch):
    """Prompt lookup's one-hot drafts: accepted with probability p(d), else drawn from p without d."""
    t, _ = small_vocab
    s = SamplingSettings(temperature=0.8, top_p=0.9)
    prompt = [3, 5, 6, 3, 5, 7, 3, 5, 4, 3, 5]  # lookup always has a guess after "3 5"
    p_ok, p_bad = _sampling_exactness(t, target.tokenizer, PromptLookupProposer, prompt, s, 3, 600, monkeypatch)
    assert p_ok > 1e-3, f"lookup sampling differs from the target's distribution (p = {p_ok:.2e})"
    assert p_bad < 1e-6, f"the chi-square test did not notice a wrong residual (p = {p_bad:.2e})"


@pytest.mark.parametrize("s", [SamplingSettings(temperature=0.7, top_k=5),
                               SamplingSettings(temperature=1.3, top_p=0.8),
                               SamplingSettings(temperature=1.0, min_p=0.2),
                               SamplingSettings(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05,
                                                repeat_penalty=1.3, repeat_last_n=16)],
                         ids=["top-k", "top-p", "min-p", "all+penalty"])
def test_filters_applied_identically(target, s):
    """A draft that is the target itself (own cache) has q == p exactly when both get the same filters,
    so every draft is accepted; a filter applied to one side only would cause rejections."""
    draft = DraftModelProposer(target.model, target.tokenizer, target.tokenizer)
    engine = Engine(target.model, target.tokenizer, 96, draft=draft, draft_tokens=4)
    done, _ = run(engine, PROMPTS[0], GenerationSettings(max_tokens=31, ignore_eos=True,
                                                         sampling=dataclasses.replace(s, seed=3)))
    assert done.stats.draft_proposed >= 24
    assert done.stats.draft_accepted == done.stats.draft_proposed


def test_filter_mismatch_would_be_noticed(target):
    """The test above has teeth: give the draft the settings without top-k and drafts get rejected."""
    s = SamplingSettings(temperature=0.7, top_k=2, seed=3)

    class Unfiltered(DraftModelProposer):
        def begin(self, prompt, settings, sampler):
            super().begin(prompt, dataclasses.replace(settings, top_k=0), sampler)

    engine = Engine(target.model, target.tokenizer, 96, draft=Unfiltered(target.model), draft_tokens=4)
    done, _ = run(engine, PROMPTS[0], GenerationSettings(max_tokens=31, ignore_eos=True, sampling=s))
    assert done.stats.draft_accepted < done.stats.draft_proposed


# ------------------------------------------------------------------------------------------------
# Cache rollback
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model", "self", "lookup"])
def test_cache_after_rejections_equals_plain(target, other, name):
    """After rounds with rejections the target cache holds exactly the K/V plain decoding computes,
    and the next turn (reusing it) continues exactly as plain decoding's."""
    s = GenerationSettings(max_tokens=20, ignore_eos=True)
    prompt = PROMPTS[0] + PROMPTS[1]
    ref_engine = Engine(target.model, target.tokenizer, 96)
    ref, _ = run(ref_engine, prompt, s)
    engine = Engine(target.model, target.tokenizer, 96, draft=proposer(name, target, other), draft_tokens=4)
    done, _ = run(engine, prompt, s)
    assert done.tokens == ref.tokens
    assert done.stats.draft_accepted < done.stats.draft_proposed  # rejections happened
    assert_caches_equal(ref_engine.cache, engine.cache)
    assert engine.cached_ids == ref_engine.cached_ids
    nxt = prompt + ref.tokens + [40, 41]
    assert run(engine, nxt, s)[0].tokens == run(ref_engine, nxt, s)[0].tokens
    assert_caches_equal(ref_engine.cache, engine.cache)


def test_cache_rollback_sampled(target, other):
    """Sampling: whatever was emitted, the cache matches a plain prefill of exactly those tokens."""
    engine = Engine(target.model, target.tokenizer, 96, draft=DraftModelProposer(other.model), draft_tokens=3)
    s = GenerationSettings(max_tokens=17, ignore_eos=True, sampling=SamplingSettings(temperature=1.0, seed=11))
    done, _ = run(engine, PROMPTS[0], s)
    assert done.stats.draft_accepted < done.stats.draft_proposed
    ids = PROMPTS[0] + done.tokens[:-1]
    ref = KVCache(target.config, 96, target.model.dtype, target.model.device, kv_format="auto")  # the engine's
    with torch.no_grad():
        target.model(torch.tensor([ids]), ref, 0)
    assert engine.cached_ids == ids
    assert_caches_equal(ref, engine.cache)


# ------------------------------------------------------------------------------------------------
# Refusals and edges
# ------------------------------------------------------------------------------------------------
def _write_mismatched(src, dst):
    """A copy of the tiny model folder whose tokenizer swaps the ids of two tokens (same vocabulary)."""
    import shutil

    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[200], by_id[201]
    vocab[a], vocab[b] = 201, 200
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_tokenizer_mismatch_is_refused(target, tiny_models, tmp_path):
    folder = _write_mismatched(tiny_models["llama_tied"][0], tmp_path / "mismatched")
    with pytest.raises(EdgeLLMError, match=r"tokenizer does not match.*first id 200") as e:
        make_proposer(str(folder), target)
    assert str(folder) in str(e.value)
    draft = load_model(folder)
    with pytest.raises(EdgeLLMError, match="must share the target's tokenizer"):
        Engine(target.model, target.tokenizer, 64, draft=DraftModelProposer(draft.model, draft.tokenizer,
                                                                             target.tokenizer))
    # a self-draft belongs to the model it was built from
    with pytest.raises(EdgeLLMError, match="model it was built from"):
        Engine(draft.model, draft.tokenizer, 64, draft=SelfDraftProposer(target.model, search=False))
    with pytest.raises(EdgeLLMError, match="L1..L2"):
        make_proposer("self:int4:L3", target)
    with pytest.raises(EdgeLLMError, match="expected self"):
        make_proposer("self:int3", target)
    with pytest.raises(EdgeLLMError, match="at least 1"):
        Engine(target.model, target.tokenizer, 64, draft=PromptLookupProposer(), draft_tokens=0)


def test_cli_refuses_mismatched_draft(target, tiny_models, tmp_path):
    folder = _write_mismatched(tiny_models["llama_tied"][0], tmp_path / "mismatched")
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "run", "hi", "-m", str(tiny_models["llama_gqa"][0]),
                           "--draft", str(folder), "-n", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tokenizer does not match" in lines[0] and "Traceback" not in proc.stderr


class _PaddedVocab(torch.nn.Module):
    """A model whose embedding table / LM head is padded by `pad` rows that always win the argmax."""

    def __init__(self, model, pad: int):
        super().__init__()
        self.inner, self.pad = model, pad
        self.config = dataclasses.replace(model.config, vocab_size=model.config.vocab_size + pad)
        self.rope_len, self.dtype, self.device = model.rope_len, model.dtype, model.device

    def forward(self, tokens, cache, start_pos, all_logits=False, logits=True):
        logits = self.inner(tokens, cache, start_pos, all_logits, logits)
        return None if logits is None else torch.cat([logits, torch.full((*logits.shape[:-1], self.pad), 1e4)], -1)


def test_padded_draft_vocab_uses_common_prefix(target, other):
    """A draft whose embedding table is padded further than the target's: the common prefix is
    compared and drafted from (padding rows, here with huge logits, are never proposed)."""
    padded = _PaddedVocab(other.model, 24)
    assert check_tokenizers(other.tokenizer, target.tokenizer, padded.config.vocab_size,
                            target.config.vocab_size) == target.config.vocab_size
    for s in (SamplingSettings(), SamplingSettings(temperature=1.0, seed=5)):
        engine = Engine(target.model, target.tokenizer, 96,
                        draft=DraftModelProposer(padded, other.tokenizer, target.tokenizer), draft_tokens=3)
        done, _ = run(engine, PROMPTS[0], GenerationSettings(max_tokens=12, ignore_eos=True, sampling=s))
        assert done.stats.draft_proposed > 0
        assert max(done.tokens) < target.config.vocab_size
        if s.greedy:
            assert done.tokens == plain(target, PROMPTS[0], 12).tokens


@pytest.mark.parametrize("name", ["self", "lookup", "model"])
def test_draft_longer_than_remaining_context(target, other, name):
    """γ = 16 with 0..6 positions left: drafts are cut to what fits; the end of the context stops
    generation exactly where plain decoding stops."""
    prompt = PROMPTS[1] * 2
    for room in (1, 2, 6):
        ctx = len(prompt) + room
        ref, _ = run(Engine(target.model, target.tokenizer, ctx), prompt, GenerationSettings(max_tokens=40, ignore_eos=True))
        engine = Engine(target.model, target.tokenizer, ctx, draft=proposer(name, target, other), draft_tokens=16)
        done, _ = run(engine, prompt, GenerationSettings(max_tokens=40, ignore_eos=True))
        assert done.tokens == ref.tokens and done.stats.finish_reason == ref.stats.finish_reason == "context"
        assert engine.cache.length == ctx
    # a draft model whose own cache is shorter than the target's
    engine = Engine(target.model, target.tokenizer, 96,
                    draft=DraftModelProposer(other.model, max_seq_len=len(prompt) + 3), draft_tokens=8)
    done, _ = run(engine, prompt, GenerationSettings(max_tokens=20, ignore_eos=True))
    assert done.tokens == plain(target, prompt, 20).tokens


def _perfect_draft(target):
    """The target itself as a draft model (own cache): every greedy draft is accepted."""
    return DraftModelProposer(target.model, target.tokenizer, target.tokenizer)


@pytest.mark.parametrize("at", [0, 1, 3, 5])
def test_eos_inside_an_accepted_run(target, at):
    """EOS as the first generated token (at=0), as the first draft token of a round (1), inside a run
    (3) and as the bonus token (5, with γ = 4): the same tokens, finish reason and cache as plain."""
    prompt = PROMPTS[0]
    ref_tokens = plain(target, prompt, 12).tokens
    tok = target.tokenizer
    saved = set(tok.eos_ids)
    tok.eos_ids = {ref_tokens[at]}
    proposed = []
    try:
        s = GenerationSettings(max_tokens=12)
        ref_engine = Engine(target.model, tok, 96)
        ref, _ = run(ref_engine, prompt, s)
        for make in (lambda: _perfect_draft(target), PromptLookupProposer):
            engine = Engine(target.model, tok, 96, draft=make(), draft_tokens=4)
            done, toks = run(engine, prompt, s)
            assert done.tokens == ref.tokens == ref_tokens[:ref_tokens.index(ref_tokens[at])]
            assert done.stats.finish_reason == ref.stats.finish_reason == "eos"
            assert engine.cache.length == ref_engine.cache.length == len(prompt) + len(ref.tokens)
            assert engine.cached_ids == ref_engine.cached_ids
            proposed.append(done.stats.draft_proposed)
    finally:
        tok.eos_ids = saved
    # the perfect draft did propose the EOS token: it sits inside (or right after) an accepted run
    assert at == 0 or proposed[0] >= min(at, 4)


def test_stop_strings_and_max_tokens_inside_an_accepted_run(target):
    prompt = PROMPTS[0]
    ref_all = plain(target, prompt, 16)
    text = target.tokenizer.decode(ref_all.tokens)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    reasons = []
    for settings in (GenerationSettings(max_tokens=16, ignore_eos=True, stop_strings=[stop]),
                     GenerationSettings(max_tokens=3, ignore_eos=True),
                     GenerationSettings(max_tokens=7, ignore_eos=True)):
        ref_engine = Engine(target.model, target.tokenizer, 96)
        ref, ref_toks = run(ref_engine, prompt, settings)
        engine = Engine(target.model, target.tokenizer, 96, draft=_perfect_draft(target), draft_tokens=8)
        done, toks = run(engine, prompt, settings)
        assert done.stats.draft_accepted == done.stats.draft_proposed > 0  # all inside one accepted run
        assert (done.tokens, done.text, done.stats.finish_reason) == (ref.tokens, ref.text, ref.stats.finish_reason)
        assert [(t.id, t.text) for t in toks] == [(t.id, t.text) for t in ref_toks]
        assert engine.cached_ids == ref_engine.cached_ids
        assert_caches_equal(ref_engine.cache, engine.cache)
        reasons.append(done.stats.finish_reason)
    assert reasons == ["stop", "length", "length"]


@pytest.mark.parametrize("name", ["self", "model"])
def test_stop_event_mid_generation_leaves_a_valid_cache(target, other, name):
    """A stop Event set while a round's accepted tokens stream out ends generation there, with the
    cache plain decoding would have; the next turn continues exactly."""
    prompt = PROMPTS[1] * 2
    engine = Engine(target.model, target.tokenizer, 96, draft=proposer(name, target, other), draft_tokens=4)
    stop = threading.Event()
    out = []
    for ev in engine.generate(prompt, GenerationSettings(max_tokens=40, ignore_eos=True), stop):
        if isinstance(ev, Token) and ev.id >= 0:
            out.append(ev.id)
            if len(out) == 7:
                stop.set()
        elif isinstance(ev, Done):
            done = ev
    assert done.stats.finish_reason == "stopped" and done.tokens == out == plain(target, prompt, 40).tokens[:7]
    assert engine.cache.length == len(prompt) + 6
    ref = KVCache(target.config, 96, target.model.dtype, target.model.device, kv_format="auto")  # the engine's
    with torch.no_grad():
        target.model(torch.tensor([prompt + out[:-1]]), ref, 0)
    assert_caches_equal(ref, engine.cache)
    nxt = prompt + out + [40]
    s = GenerationSettings(max_tokens=9, ignore_eos=True)
    assert run(engine, nxt, s)[0].tokens == plain(target, nxt, 9).tokens


@pytest.mark.parametrize("where", ["draft", "verify"])
def test_interrupt_inside_a_forward_pass_leaves_a_valid_cache(target, where, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) inside the shared-cache self-draft's pass or the verification pass:
    the cache keeps only verified tokens (cache.length == len(cached_ids)) and the next call works."""
    prompt = PROMPTS[1] * 2
    draft = SelfDraftProposer(target.model, search=False)
    engine = Engine(target.model, target.tokenizer, 96, draft=draft, draft_tokens=4)
    # the draft's one-token steps (the fused C++ step where it applies), or the target's verification pass
    # (the fused step's multi-token call where it applies)
    owner, attr = (draft, "decoder") if where == "draft" else (engine, "verify_logits")
    forward = getattr(owner, attr)
    calls = {"n": 0}

    def interrupting(*a, **k):
        calls["n"] += 1
        out = forward(*a, **k)  # K/V written, cache.length advanced, then the interrupt
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(owner, attr, interrupting)
    out = []
    with pytest.raises(KeyboardInterrupt):
        for ev in engine.generate(prompt, GenerationSettings(max_tokens=40, ignore_eos=True)):
            if isinstance(ev, Token) and ev.id >= 0:
                out.append(ev.id)
    monkeypatch.undo()
    assert engine.cache.length == len(engine.cached_ids)
    assert engine.cached_ids == (prompt + out)[:len(engine.cached_ids)]
    ref = KVCache(target.config, 96, target.model.dtype, target.model.device, kv_format="auto")  # the engine's
    with torch.no_grad():
        target.model(torch.tensor([engine.cached_ids]), ref, 0)
    assert_caches_equal(ref, engine.cache)
    nxt = prompt + out
    s = GenerationSettings(max_tokens=9, ignore_eos=True)
    assert run(engine, nxt, s)[0].tokens == plain(target, nxt, 9).tokens


def test_closing_the_stream_early_leaves_a_valid_cache(target):
    prompt = PROMPTS[1] * 2
    engine = Engine(target.model, target.tokenizer, 96, draft=_perfect_draft(target), draft_tokens=6)
    gen = engine.generate(prompt, GenerationSettings(max_tokens=40, ignore_eos=True))
    out = [next(gen).id for _ in range(4)]  # the consumer stops reading in the middle of a run
    gen.close()
    assert engine.cache.length == len(engine.cached_ids)
    assert engine.cached_ids == (prompt + plain(target, prompt, 40).tokens)[:len(engine.cached_ids)]
    assert out == plain(target, prompt, 40).tokens[:4]
    nxt = prompt + out
    assert run(engine, nxt, GenerationSettings(max_tokens=5, ignore_eos=True))[0].tokens == plain(target, nxt, 5).tokens


# ------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------
def test_prompt_lookup_proposals():
    p = PromptLookupProposer(max_ngram=3)
    p.device = "cpu"
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert p.propose(ctx, 4)[0].tolist() == [4, 5, 9, 1]  # the 3-gram "1 2 3" matched
    assert p.propose(ctx + [7], 4)[0].tolist() == []  # nothing ever followed 7
    assert p.propose(ctx + [7, 2], 2)[0].tolist() == [3, 7]  # the 1-gram "2": its latest occurrence
    assert p.propose([6, 6], 3)[0].tolist() == [6]  # stops at the end of the context
    assert p.kind == 1
    q = PromptLookupProposer(max_ngram=3)  # (a proposer's context only grows between begin calls)
    q.device = "cpu"
    q.propose(ctx, 4)
    assert q.kind == 3 and q.free_proposals  # the kind of guess: the matched n-gram's length
    q.propose(ctx + [7], 4)
    assert q.kind is None
    # of two occurrences of the last 3-gram, the one whose agreement with the context goes further back wins
    # over the latest; the kind of guess is that agreement's length, bucketed (MATCH_KINDS)
    r = PromptLookupProposer(max_ngram=3)
    r.device = "cpu"
    ctx2 = [5, 1, 2, 3, 8, 9, 7, 1, 2, 3, 4, 6, 5, 1, 2, 3]
    assert r.propose(ctx2, 3)[0].tolist() == [8, 9, 7] and r.kind == 4  # "5 1 2 3" agrees for 4 tokens
    assert r.propose(ctx2 + [8, 9, 7, 1, 2, 3], 2)[0].tolist() == [4, 6] and r.kind == 7  # the 2nd: 10 tokens
    assert [max(b for b in r.MATCH_KINDS if b <= n) for n in (1, 2, 3, 5, 6, 9, 40)] == [1, 2, 3, 4, 4, 7, 7]



class _Texts:
    """A stand-in tokenizer for the lookup's token texts: ids 50-59 are punctuation, the rest words."""
    eos_ids = {2}

    def decode(self, ids: list[int]) -> str:
        return "," if 50 <= ids[0] < 60 else f" w{ids[0]}"


def _lookup_with_texts() -> PromptLookupProposer:
    p = PromptLookupProposer(max_ngram=3)
    p.device = "cpu"
    p._tokenizer, p._stops = _Texts(), frozenset(_Texts.eos_ids)
    return p


def test_prompt_lookup_follows_an_edited_source():
    """After the answer leaves the source it was copying (a substituted or inserted token), the guesses
    resume the source where the answer left it, not at the latest occurrence of a short match."""
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 14, 30, 31]  # "14" also occurs later
    prompt = source + [2, 7]  # end of turn, then the answer begins
    p = _lookup_with_texts()
    ctx = prompt + [10, 11, 12]
    assert p.propose(ctx, 3)[0].tolist() == [13, 14, 15] and p.kind == 3
    ctx += [13, 14, 99]  # the answer followed the guess for 2 tokens, then wrote 99 for the source's 15
    assert p.propose(ctx, 3)[0].tolist() == [16, 17, 18] and p.kind == "resync"  # 15 substituted: skip it
    ctx += [16, 17, 18, 19, 55]  # followed again, then an inserted comma before the source's 20
    assert p.propose(ctx, 2)[0].tolist() == [20, 21] and p.kind == "resync"  # punctuation: resume at 20
    ctx += [20, 21, 98, 14]  # left the source at its 14 (position 12); "14" also occurs at 4 and in the answer
    assert p.propose(ctx, 2)[0].tolist() == [30, 31] and p.kind == "near"  # the occurrence at the cursor
    # without a followed guess there is no cursor: the latest occurrence, as before
    q = _lookup_with_texts()
    assert q.propose(prompt + [97, 14], 2)[0].tolist() == [30, 31] and q.kind == 1
    assert q.propose(prompt + [97, 14, 96, 95], 2)[0].tolist() == []  # and no resync


def test_prompt_lookup_keeps_the_cursor_along_one_run():
    """A guess that only goes on the run the answer is already following (followed for one token before the
    answer leaves the source) does not replace that run's longer agreement: the cursor stays trusted."""
    source = list(range(10, 30))
    p = _lookup_with_texts()
    ctx = source + [2, 7, 10, 11, 12]
    assert p.propose(ctx, 4)[0].tolist() == [13, 14, 15, 16]
    ctx += [13, 14, 15, 16]
    assert p.propose(ctx, 4)[0].tolist() == [17, 18, 19, 20] and p.kind == 7
    ctx += [17, 99]  # one more token of the same run, then a substitution for 18
    assert p.propose(ctx, 3)[0].tolist() == [19, 20, 21] and p.kind == "resync"


def test_prompt_lookup_resumes_once_and_stops_at_end_of_turn():
    source = [10, 11, 12, 13, 14, 15, 16]
    p = _lookup_with_texts()
    ctx = source + [2, 7, 10, 11, 12]
    p.propose(ctx, 3)
    ctx += [13, 14, 99]
    assert p.propose(ctx, 8)[0].tolist() == [16, 2]  # resumed past 15; the guess ends at the end of turn
    ctx += [98]  # that guess was wrong: the same resume position is not guessed again
    assert p.propose(ctx, 8)[0].tolist() == [] and p.kind is None

def test_gamma_controller():
    g = GammaController()
    assert g.gamma == 4
    for _ in range(30):  # drafts nearly free and always right: draft more
        g.update(g.gamma, g.gamma, draft_s=0.001 * g.gamma, verify_s=0.1 * (1 + 0.05 * g.gamma))
    assert g.gamma > 8
    for _ in range(30):  # always wrong: one draft at a time
        g.update(g.gamma, 0, draft_s=0.05 * g.gamma, verify_s=0.1 * (1 + 0.05 * g.gamma))
    assert g.gamma == 1
    fixed = GammaController(fixed=6)
    for _ in range(5):
        fixed.update(6, 0, 0.1, 0.1)
    assert fixed.gamma == 6
    assert GammaController(fixed=40, hi=15).gamma == 15
    with pytest.raises(EdgeLLMError):
        GammaController(fixed=0)


def test_gamma_per_proposal_kind():
    """Free proposals (prompt lookup) get γ from their own kind's acceptance: a kind that is always right
    drafts long; one that always misses at the first guess is not worth a verified row: γ 0 (a plain step),
    with one guess every EXPLORE rounds so its estimate can recover; --draft-tokens still pins γ."""
    g = GammaController()
    assert g.gamma_for(3) == 4  # no cost measured yet: the starting γ
    for _ in range(30):
        for kind, right in ((3, True), (1, False)):
            n = g.gamma_for(kind)
            g.update(n, n if right else 0, draft_s=1e-5, verify_s=0.01 * (1 + 0.3 * n), kind=kind)
    assert g.gamma_for(3) >= 8
    tries = [g.gamma_for(1) for _ in range(2 * GammaController.EXPLORE)]
    assert sorted(set(tries)) == [0, 1] and tries.count(1) == 2
    assert g.alpha_of(3) > 0.9 > 0.3 > g.alpha_of(1)  # kind 1 fell from its prior's 0.6
    fixed = GammaController(fixed=5)
    fixed.update(5, 0, 1e-5, 0.01, kind=1)
    assert fixed.gamma_for(1) == 5
    # free proposals: update() leaves γ to gamma_for (the engine asks it every round)
    free, paid = GammaController(free=True), GammaController()
    for g in (free, paid):
        for _ in range(10):
            g.update(4, 4, draft_s=1e-5, verify_s=0.01)
    assert free.gamma == 4 < paid.gamma
    # a proposer's prior per kind starts each kind's estimate (lookup: long agreements start trusted)
    priors = GammaController(kind_prior=PromptLookupProposer().kind_prior)
    for T in (1, 2, 5):
        priors.update(T - 1, 0, draft_s=1e-5, verify_s=0.01 * (1 + 0.3 * (T - 1)))
    assert priors.alpha_of(1) == pytest.approx(0.25) and priors.alpha_of(7) == pytest.approx(6 / 7)
    assert priors.gamma_for(1) == 0 < 2 < priors.gamma_for(7)


def test_verification_cost_per_T_where_measured():
    """The controller prices a pass by that T's own measured cost (the CPU's first extra row costs more than
    the next ones), by the line through the measured ones elsewhere, and never below a smaller T's."""
    g = GammaController()
    for T, sec in ((1, 1.0), (2, 1.5), (3, 1.6), (4, 1.7), (6, 1.65)):
        g.update(T - 1, 0, draft_s=1e-6 * (T - 1), verify_s=sec)
    assert [g.verify_cost(T) for T in (1, 2, 3, 4)] == pytest.approx([1.0, 1.5, 1.6, 1.7])
    assert g.verify_cost(5) == g.verify_cost(6) == pytest.approx(1.7)  # the line says less: floored
    xs, ys = [1, 2, 3, 4, 6], [1.0, 1.5, 1.6, 1.7, 1.65]
    xm, ym = sum(xs) / 5, sum(ys) / 5
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / sum((x - xm) ** 2 for x in xs)
    assert g.verify_cost(12) == pytest.approx(max(1.7, ym + slope * (12 - xm)))


def test_verification_costs_carry_over_to_the_next_answer():
    """What a controller measured (seconds per verification pass and per draft token) starts the next one:
    the costs belong to the engine, only α starts again from the prior."""
    costs = VerifyCosts()
    first = GammaController(costs=costs)
    for T, sec in ((2, 0.012), (5, 0.024)):
        first.update(T - 1, 0, draft_s=1e-4 * (T - 1), verify_s=sec)
    second = GammaController(costs=costs)
    assert second.verify_cost(5) == pytest.approx(0.024) and second.verify_cost(2) == pytest.approx(0.012)
    assert second.c_draft == pytest.approx(first.c_draft)
    assert second.alpha == pytest.approx(0.6) and GammaController().verify_cost(5) == 1.0


def test_quantized_target_verifies_at_most_kernel_rows(target):
    """A CPU target verifies ≤ 16 rows per pass: there the fused step's multi-token call and the C++ int
    kernel compute each row as a one-token step does (beyond, the model's forward and a float GEMM on
    dequantized weights take over, which round differently), so greedy output stays identical to plain
    decoding."""
    from edgellm.kernels.matmul import CPU_KERNEL_MAX_M
    from edgellm.quant.linear import QuantLinear

    assert max_draft_tokens(target.model) == CPU_KERNEL_MAX_M - 1 < GAMMA_MAX
    q = SelfDraftProposer(target.model, search=False).model  # an int4 model
    assert max_draft_tokens(q) == CPU_KERNEL_MAX_M - 1 < GAMMA_MAX
    for lin in [m for m in q.modules() if isinstance(m, QuantLinear)][:3]:
        x = torch.randn(1, CPU_KERNEL_MAX_M, lin.in_features)
        rows = torch.cat([lin(x[:, i:i + 1]) for i in range(x.shape[1])], 1)
        torch.testing.assert_close(lin(x), rows, atol=1e-5, rtol=1e-5)  # same numerics up to summation order


# ------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_run_with_lookup_shows_drafts(bundled_path):
    prompt = "Repeat exactly: The GNU General Public License is a free, copyleft license."
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "run", prompt, "--draft", "lookup", "--show-drafts",
                           "-n", "24", "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" in proc.stdout  # accepted drafts are coloured
    assert "copyleft" in re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)
    assert "drafts" in proc.stderr and "accepted" in proc.stderr and "lookup" in proc.stderr
