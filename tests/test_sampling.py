"""Sampling filters keep exactly the right support; seeds reproduce."""
import math

import pytest
import torch

from edgellm.generate import Engine, GenerationSettings
from edgellm.sampling import Sampler, SamplingSettings, apply_repeat_penalty, argmax, filter_logits

# a hand-made distribution over 6 tokens: probabilities .40 .25 .15 .10 .06 .04
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
LOGITS = P.log()


def support(s: SamplingSettings) -> set[int]:
    return set(torch.nonzero(filter_logits(LOGITS, s).isfinite()).flatten().tolist())


def test_top_k_support():
    assert support(SamplingSettings(temperature=1, top_k=2)) == {0, 1}
    assert support(SamplingSettings(temperature=1, top_k=0)) == set(range(6))


@pytest.mark.parametrize("top_p,expected", [(0.39, {0}), (0.41, {0, 1}), (0.64, {0, 1}), (0.66, {0, 1, 2}),
                                            (0.95, {0, 1, 2, 3, 4}), (1.0, set(range(6)))])
def test_top_p_support(top_p, expected):
    assert support(SamplingSettings(temperature=1, top_p=top_p)) == expected


@pytest.mark.parametrize("min_p,expected", [(0.2, {0, 1, 2, 3}), (0.5, {0, 1}), (0.6, {0, 1}), (0.7, {0})])
def test_min_p_support(min_p, expected):
    # min-p keeps tokens with p >= min_p * p_max (p_max = .40)
    assert support(SamplingSettings(temperature=1, min_p=min_p)) == expected


def test_temperature_scales_distribution():
    probs = filter_logits(LOGITS, SamplingSettings(temperature=0.5)).softmax(-1)
    ref = P ** 2 / (P ** 2).sum()
    torch.testing.assert_close(probs, ref)


def test_repeat_penalty_follows_llamacpp():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repeat_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_argmax_is_torchs_argmax():
    """The numpy fast path for CPU float32 logits picks what torch.argmax picks: the first index on ties,
    +inf over everything, a row of -inf → 0; rows [T, V], one row [V], a strided view; other dtypes go to torch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49152, generator=g)
    x[1, 7] = x[1, 300] = x[1].max() + 1  # a tie: the first wins
    x[2, 40000] = float("inf")
    x[3] = float("-inf")
    x[4, ::3] = 9.0  # many equal maxima
    for t in (x, x[0], x[:, ::2], x.to(torch.float64), x[1].to(torch.bfloat16)):
        got = argmax(t)
        assert got.dtype == torch.long and got.shape == t.shape[:-1]
        assert torch.equal(got, t.argmax(-1)), t.dtype
    assert argmax(x)[1] == 7 and argmax(x)[4] == 0


def test_sampler_draws_from_distribution_and_is_seeded():
    s = SamplingSettings(temperature=1.0, seed=123)
    a = [int(Sampler(s)(LOGITS)) for _ in range(1)]
    sampler = Sampler(s)
    draws = torch.stack([sampler(LOGITS) for _ in range(20000)])
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert torch.allclose(freq, P, atol=0.015)
    again = Sampler(s)
    assert [int(again(LOGITS)) for _ in range(1)] == a


def test_zero_probability_never_drawn():
    sampler = Sampler(SamplingSettings(temperature=1.0, top_k=1, seed=0))
    assert all(int(sampler(LOGITS)) == 0 for _ in range(200))


def test_seeded_generation_reproduces(tiny_llama):
    from edgellm.loading import load_model

    lm = load_model(tiny_llama[0])
    settings = GenerationSettings(max_tokens=20, ignore_eos=True,
                                  sampling=SamplingSettings(temperature=1.0, top_p=0.9, seed=7))
    runs = []
    for _ in range(2):
        engine = Engine(lm.model, lm.tokenizer, 64)
        runs.append(list(engine.generate([5, 6, 7], settings))[-1].tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 20
    other = GenerationSettings(max_tokens=20, ignore_eos=True, sampling=SamplingSettings(temperature=1.0, seed=8))
    assert list(Engine(lm.model, lm.tokenizer, 64).generate([5, 6, 7], other))[-1].tokens != runs[0]


def test_bad_settings_raise():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"min_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingSettings(**kw)
