"""Speculative decoding is exact: the same greedy tokens as plain decoding with every proposer, the
same cache afterwards, and, when sampling, the target's distribution (chi-square against the exact
joint distribution of the first two tokens, computed from the target's logits alone)."""
import math

import pytest
import torch

from edgellm import speculative
from edgellm.errors import EdgeLLMError
from edgellm.generate import Done, Engine, GenerationSettings, Token
from edgellm.loading import load_model
from edgellm.sampling import SamplingSettings
from edgellm.speculative import DraftModelProposer, PromptLookupProposer, SelfDraftProposer, check_tokenizers

PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 33, 8],
           [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],  # repetitive: lookup proposes long runs
           [40, 41, 42]]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models["llama_gqa"][0])


@pytest.fixture(scope="module")
def other(tiny_models):
    return load_model(tiny_models["llama_tied"][0])  # same tokenizer, different random weights


def run(engine, prompt, settings):
    events = list(engine.generate(prompt, settings))
    done = events[-1]
    assert isinstance(done, Done)
    return done, [e for e in events if isinstance(e, Token)]


def proposers(target, other):
    yield "lookup", lambda: PromptLookupProposer()
    yield "self", lambda: SelfDraftProposer(target.model)
    yield "self-L1", lambda: SelfDraftProposer(target.model, n_layers=1)
    yield "model", lambda: DraftModelProposer(other.model, other.tokenizer, target.tokenizer)


@pytest.mark.parametrize("gamma", [None, 1, 3])
def test_greedy_identical_to_plain(target, other, gamma):
    m, tok = target.model, target.tokenizer
    for name, make in proposers(target, other):
        for prompt in PROMPTS:
            for n in (1, 4, 17):
                s = GenerationSettings(max_tokens=n, ignore_eos=True)
                plain, _ = run(Engine(m, tok, 64), prompt, s)
                spec_engine = Engine(m, tok, 64, draft=make(), draft_tokens=gamma)
                spec, toks = run(spec_engine, prompt, s)
                assert spec.tokens == plain.tokens, (name, prompt, n, gamma)
                assert [t.id for t in toks if t.id >= 0] == plain.tokens
                # the cache holds what plain decoding leaves: every emitted token but the last
                assert spec_engine.cache.length == len(prompt) + len(plain.tokens) - 1
                assert spec_engine.cached_ids == (prompt + plain.tokens)[:spec_engine.cache.length]


def test_drafts_are_accepted_and_marked(target):
    """On a repetitive prompt the target repeats itself and lookup's guesses get accepted."""
    m, tok = target.model, target.tokenizer
    prompt = PROMPTS[1] * 3
    plain, _ = run(Engine(m, tok, 128), prompt, GenerationSettings(max_tokens=30, ignore_eos=True))
    spec, toks = run(Engine(m, tok, 128, draft=SelfDraftProposer(m)), prompt,
                     GenerationSettings(max_tokens=30, ignore_eos=True))
    assert spec.tokens == plain.tokens
    assert spec.stats.draft_proposed > 0 and spec.stats.draft_accepted > 0  # an int4 copy agrees often
    assert sum(t.from_draft for t in toks) == spec.stats.draft_accepted
    assert 0 < spec.stats.acceptance_rate <= 1


def test_cache_after_rejections_equals_plain_cache(target, other):
    m, tok = target.model, target.tokenizer
    s = GenerationSettings(max_tokens=20, ignore_eos=True)
    plain_engine = Engine(m, tok, 64)
    plain, _ = run(plain_engine, PROMPTS[0], s)
    spec_engine = Engine(m, tok, 64, draft=DraftModelProposer(other.model, other.tokenizer, tok), draft_tokens=4)
    spec, _ = run(spec_engine, PROMPTS[0], s)
    assert spec.stats.draft_proposed > spec.stats.draft_accepted  # rejections happened
    n = plain_engine.cache.length
    assert spec_engine.cache.length == n
    for a, b in zip(plain_engine.cache.layers, spec_engine.cache.layers):
        torch.testing.assert_close(b.k[:, :n], a.k[:, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.v[:, :n], a.v[:, :n], atol=1e-5, rtol=1e-5)


def test_stops_inside_accepted_drafts(target):
    """EOS (here: a token id declared EOS), max_tokens and context end inside a run of drafts."""
    m, tok = target.model, target.tokenizer
    prompt = PROMPTS[1] * 3
    plain, _ = run(Engine(m, tok, 128), prompt, GenerationSettings(max_tokens=30, ignore_eos=True))
    stop_id = plain.tokens[5]
    saved = set(tok.eos_ids)
    tok.eos_ids = {stop_id}
    try:
        a, _ = run(Engine(m, tok, 128), prompt, GenerationSettings(max_tokens=30))
        b, _ = run(Engine(m, tok, 128, draft=PromptLookupProposer(), draft_tokens=8), prompt,
                   GenerationSettings(max_tokens=30))
        c, _ = run(Engine(m, tok, 128, draft=SelfDraftProposer(m), draft_tokens=8), prompt,
                   GenerationSettings(max_tokens=30))
    finally:
        tok.eos_ids = saved
    assert a.tokens == b.tokens == c.tokens and a.stats.finish_reason == b.stats.finish_reason == "eos"
    # a draft longer than the room left in the context
    ctx = len(prompt) + 6
    a, _ = run(Engine(m, tok, ctx), prompt, GenerationSettings(max_tokens=30, ignore_eos=True))
    b, _ = run(Engine(m, tok, ctx, draft=SelfDraftProposer(m), draft_tokens=16), prompt,
               GenerationSettings(max_tokens=30, ignore_eos=True))
    assert a.tokens == b.tokens and a.stats.finish_reason == b.stats.finish_reason


def test_tokenizer_mismatch_is_refused(target, bundled):
    with pytest.raises(EdgeLLMError, match="tokenizer"):
        check_tokenizers(bundled.tokenizer, target.tokenizer, bundled.config.vocab_size, target.config.vocab_size)


# ---------------------------------------------------------------------------------------------------
# Sampling: the first two tokens' joint distribution
# ---------------------------------------------------------------------------------------------------
def exact_joint(model, prompt, s: SamplingSettings) -> dict[tuple[int, int], float]:
    """P(t1, t2) from the target alone, with the same top-k/temperature filter (float64)."""
    from edgellm.cache import KVCache
    from edgellm.sampling import probabilities

    def dist(ids):
        cache = KVCache(model.config, 64, model.dtype, model.device)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), cache, 0)[0, -1]
        return probabilities(logits[None], s)[0].double()

    p1 = dist(prompt)
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def chi_square_pvalue(counts: dict, joint: dict, n: int) -> float:
    """Pearson's chi-square, cells with expected count < 5 pooled into one."""
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for key, p in joint.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    outside = n - sum(counts.get(k, 0) for k in joint)
    assert outside == 0, "a sample outside the target's support"
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_pairs(target, other, s: SamplingSettings, n: int) -> dict:
    m, tok = target.model, target.tokenizer
    engine = Engine(m, tok, 64, draft=DraftModelProposer(other.model, other.tokenizer, tok), draft_tokens=2)
    counts: dict = {}
    for i in range(n):
        # 3 tokens: the round after the first token drafts the second (γ is capped by max_tokens)
        settings = GenerationSettings(max_tokens=3, ignore_eos=True,
                                      sampling=SamplingSettings(**{**s.__dict__, "seed": 1000 + i}))
        engine.reset()
        done = list(engine.generate(PROMPTS[2], settings))[-1]
        assert done.stats.draft_proposed >= 1
        key = tuple(done.tokens[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
def test_sampling_matches_target_distribution(target, other, monkeypatch):
    s = SamplingSettings(temperature=1.5, top_k=6)
    joint = exact_joint(target.model, PROMPTS[2], s)
    n = 2500
    p = chi_square_pvalue(sample_pairs(target, other, s, n), joint, n)
    assert p > 1e-3, f"speculative sampling differs from the target's distribution (p = {p:.2e})"
    # the same test catches a wrong residual: resample from p itself after a rejection
    monkeypatch.setattr(speculative, "residual", lambda p_, q_: p_)
    p_wrong = chi_square_pvalue(sample_pairs(target, other, s, n), joint, n)
    assert p_wrong < 1e-4, f"a wrong residual went unnoticed (p = {p_wrong:.2e})"
    assert math.isfinite(p)
