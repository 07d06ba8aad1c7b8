"""The quantized caches' calibration (edgellm/kv_calibration.py): the key scales are the optimum they claim,
they leave attention exact (only the stored rounding changes), and on real weights they cut the int4
cache's error."""
import math

import pytest
import torch

from edgellm.cache import FloatKVCache, Int4KVCache, Int8KVCache, KVCache
from edgellm.kernels.attention import dequantize_kv, reference_attention
from edgellm.kv_calibration import KEY_SCALE_LIMIT, KVCalibration, key_scales
from edgellm.loading import load_model

IDS = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 33, 8, 19, 2, 77, 31]


def expected_score_error(q_energy, k_energy, s):
    """E[(q.e)^2] up to a constant, for an error e spread evenly over the channels of k * s (rotated), read
    with q / s: sum(E[q^2] / s^2) * sum(E[k^2] s^2)."""
    return (q_energy / s**2).sum(-1) * (k_energy * s**2).sum(-1)


def test_key_scales_minimise_the_expected_score_error():
    g = torch.Generator().manual_seed(0)
    q_energy = torch.rand(3, 64, generator=g, dtype=torch.float64) * 10 + 0.1
    k_energy = torch.rand(3, 64, generator=g, dtype=torch.float64) ** 4 * 10 + 0.1
    s = key_scales(q_energy, k_energy).double()
    torch.testing.assert_close(s.pow(2).mean(-1), torch.ones(3, dtype=torch.float64), rtol=1e-6, atol=0)
    best = expected_score_error(q_energy, k_energy, s)
    # Cauchy-Schwarz: the least possible value is (sum sqrt(E[q^2] E[k^2]))^2, reached by these scales
    torch.testing.assert_close(best, (q_energy * k_energy).sqrt().sum(-1) ** 2, rtol=1e-5, atol=0)
    assert (best < expected_score_error(q_energy, k_energy, torch.ones_like(s)) * 0.95).all()
    for _ in range(50):  # and no nearby scales do better
        other = s * torch.exp(0.2 * torch.randn(s.shape, generator=g, dtype=torch.float64))
        assert (expected_score_error(q_energy, k_energy, other) >= best * (1 - 1e-9)).all()


def test_key_scales_stay_finite_and_bounded_for_dead_channels():
    q_energy = torch.ones(2, 8)
    q_energy[0, 3] = 0.0  # a channel no query uses
    k_energy = torch.ones(2, 8)
    k_energy[1, 5] = 0.0  # a channel every key leaves at its centre
    s = key_scales(q_energy, k_energy)
    assert torch.isfinite(s).all() and torch.isfinite(1 / s).all()
    assert s.min() >= 1 / KEY_SCALE_LIMIT and s.max() <= KEY_SCALE_LIMIT


class Recording:
    """A cache that keeps each layer's query and attention output (the model's basis)."""

    def attend(self, layer, q, start, scale):
        out = super().attend(layer, q, start, scale)
        self.seen = getattr(self, "seen", {})
        self.seen[layer] = (q.clone(), out.clone(), start, scale)
        return out


RECORDING = {"int8": type("RecordingInt8", (Recording, Int8KVCache), {}),
             "int4": type("RecordingInt4", (Recording, Int4KVCache), {})}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_scaled_keys_leave_attention_exact(tiny_llama, fmt):
    """Attention on a calibrated quantized cache equals float64 attention of the model's own queries over the
    stored K/V mapped back to the model's basis (rotated back, keys divided by their scales, centres added):
    the queries' division undoes the keys' scaling, whatever the rounding did to the codes."""
    model = load_model(tiny_llama[0]).model
    cache = RECORDING[fmt](model.config, 64, model.dtype, model.device, kv_format=fmt)
    with torch.no_grad():
        model(torch.tensor([IDS[:10]]), cache, 0)  # T > 1 against the cache
        model(torch.tensor([IDS[10:]]), cache, 10)
        model(torch.tensor([[5]]), cache, len(IDS))  # one decode step
    assert cache.key_scales is not None and (cache.key_scales - 1).abs().max() > 0.05
    H = cache.rotation.double()
    for layer in range(model.config.n_layers):
        k_rot, v_rot = dequantize_kv(cache.layers[layer], 0, cache.length)
        c = cache.centers[layer].double()
        k = (k_rot.double() @ H.T) / cache.key_scales[layer].double() + c[0]
        v = v_rot.double() @ H.T + c[1]
        q, out, start, scale = cache.seen[layer]
        want = reference_attention(q, k, v, cache.length, start, scale)
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_key_scales_cut_the_int4_error_on_the_bundled_model(bundled):
    """On real weights (300 tokens of GPL-3, the model's forward pass): the int4 cache's KL to the float
    cache with the calibrated key scales is well below the same cache with scales of 1 (centres kept)."""
    m = bundled.model
    ids = bundled.tokenizer.encode(open("/usr/share/common-licenses/GPL-3").read()[:3000])[:300]

    def logprobs(calibration=None):
        cache = KVCache(m.config, 512, m.dtype, m.device, kv_format="fp" if calibration is None else "int4")
        if calibration is not None:
            cache.set_calibration(calibration)
        with torch.no_grad():
            return m(torch.tensor([ids]), cache, 0, all_logits=True)[0].double().log_softmax(-1)

    from edgellm.kv_calibration import kv_calibration

    ref = logprobs()
    calibrated = kv_calibration(m, lambda n: FloatKVCache(m.config, n, m.dtype, m.device))
    kl = {}
    for name, cal in (("scaled", calibrated),
                      ("unscaled", KVCalibration(calibrated.centers, torch.ones_like(calibrated.key_scales)))):
        kl[name] = (ref.exp() * (ref - logprobs(cal))).sum(-1).mean().item()
    assert math.isfinite(kl["scaled"]) and kl["scaled"] < 0.85 * kl["unscaled"], kl
