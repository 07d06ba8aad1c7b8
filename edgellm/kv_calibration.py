"""Calibration of the quantized KV caches, once per model: per-channel K/V centres and key scales.

Centres. SmolLM2-135M's keys carry per-channel offsets 50-100x the median channel, the same for every
token. A per-token int4 group has to span the offset and the token's own signal, and loses the signal
(Hadamard rotation does not help: it spreads a constant offset over every channel, still the same for every
token). Subtracting a constant c from every key of a head changes every score of a query by the same q.c,
and softmax is invariant to that: attention is exactly unchanged, only the quantization error shrinks. The
same holds for V with the centre added back to the output (the softmax weights sum to 1). So a quantized
cache stores (k - c_k) and (v - c_v), rotated, and attention adds c_v to its output.

Key scales. What attention feels of a key's error e is q.e. After the rotation the error is spread evenly
over the channels, so its cost grows with the energy of q, and its size with the energy of the stored key.
Storing keys times s (per channel) and reading them with q / s leaves every score exactly as it was, and
makes the expected score error proportional to sum(E[q^2] / s^2) * sum(E[k^2] s^2): smallest for
s^2 = sqrt(E[q^2] / E[k^2]), channel by channel (the same balancing as SmoothQuant's, between a query and a
key instead of an activation and a weight). On SmolLM2-135M over GPL-3 at ctx 512 it cut the int4 cache's KL to
the float cache from 0.0217 to ~0.015 (benchmarks/results/kv-quality.md).

Both come from the post-RoPE K, V and q of each layer, KV head and channel over a built-in English text
(CALIBRATION_TEXT, ~512 tokens: over GPL-3 at ctx 512 the centres from 512 tokens of text cut the int4
cache's KL about 2x; 128 tokens or random token ids helped half as much). They are computed on first use
with a quantized cache (one prefill of the text: ~0.3 s for the bundled model) and kept on the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# Original prose and code written for this purpose (a mix of registers, like a chat's turns).
CALIBRATION_TEXT = """\
The harbour town woke slowly that morning. Fishing boats came back one after another, their engines
coughing in the cold air, and the gulls followed them in wide, lazy circles. On the quay a woman in a
yellow coat was counting crates of mackerel, writing numbers on a clipboard that the wind kept trying to
take from her. Further up the hill the bakery had been open for an hour already, and the smell of bread
drifted down the narrow streets between houses painted blue, white and pale green.

Questions people often ask about learning to cook: How do I stop onions from burning? Keep the heat
medium, add a pinch of salt early so they release their water, and stir every minute or two. Why does my
rice turn out sticky? Rinse it until the water runs clear, measure the water carefully, and let it rest
with the lid on for ten minutes after cooking. What knife should I buy first? One good chef's knife of
about twenty centimetres will do almost everything a beginner needs.

In 1969 the first people walked on the Moon, and the mission's computer had less memory than a modern
greeting card that plays music. Engineers wrote its programs by hand, checked them line by line, and
wove the final code into rope memory, where a wire passing through a magnetic core meant one and a wire
passing around it meant zero.

def moving_average(values, window):
    \"\"\"Return the averages of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result

User: Can you explain what a neural network is in simple terms?
Assistant: Sure. A neural network is a long chain of simple calculations. Each step takes some numbers,
multiplies them by weights, adds them up and passes the result on. During training the weights are nudged,
a little at a time, so that the final numbers come closer to the answers we want. After enough examples
the chain has learned patterns, such as which words tend to follow which, or what a cat looks like.

Dear Ms. Alvarez, thank you for your letter of 12 March. I am pleased to confirm that the meeting room
on the third floor is reserved for your team from nine until half past twelve on Thursday. Coffee and
water will be provided; please let us know by Tuesday if anyone in your group has dietary requirements.
"""
CALIBRATION_TOKENS = 512


def calibration_ids(tokenizer) -> list[int]:
    """The calibration text's token ids (at most CALIBRATION_TOKENS), or [] if the tokenizer fails."""
    try:
        return list(tokenizer.encode(CALIBRATION_TEXT))[:CALIBRATION_TOKENS]
    except Exception:  # noqa: BLE001 - no centres is a valid (less accurate) choice, never an error
        return []


# Key scales are kept within [1/KEY_SCALE_LIMIT, KEY_SCALE_LIMIT] of their RMS: a channel no calibration
# query uses would otherwise get a scale near 0 (and q / s would blow up if a later query used it).
KEY_SCALE_LIMIT = 16.0


@dataclass(frozen=True)
class KVCalibration:
    centers: torch.Tensor     # [n_layers, 2, Hkv, 1, D] fp32: the mean K and V
    key_scales: torch.Tensor  # [n_layers, Hkv, 1, D] fp32: keys are stored times these, queries read them divided


def key_scales(q_energy: torch.Tensor, k_energy: torch.Tensor) -> torch.Tensor:
    """s = (E[q^2] / E[k^2])^(1/4) per channel (last dim), normalised to RMS 1 and bounded by KEY_SCALE_LIMIT."""
    floor = 1e-12
    s = (q_energy.double().clamp_min(floor) / k_energy.double().clamp_min(floor)) ** 0.25
    s = s / s.pow(2).mean(-1, keepdim=True).sqrt()
    return s.clamp(1 / KEY_SCALE_LIMIT, KEY_SCALE_LIMIT).float()


class _Recorder:
    """Passes a model's writes and reads through to a float cache, keeping each layer's K, V (post-RoPE) and
    the energy of its queries per KV head and channel."""

    def __init__(self, cache, n_kv_heads: int, group: int):
        self.cache, self.n_kv_heads, self.group = cache, n_kv_heads, group
        self.max_seq_len = cache.max_seq_len
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.q_energy: dict[int, torch.Tensor] = {}

    @property
    def length(self) -> int:
        return self.cache.length

    @length.setter
    def length(self, n: int) -> None:
        self.cache.length = n

    def write(self, layer, k, v, start):
        self.kv[layer] = k.float(), v.float()
        self.cache.write(layer, k, v, start)

    def attend(self, layer, q, start, scale, **kw):
        self.q_energy[layer] = q[0].float().pow(2).mean(1).view(self.n_kv_heads, self.group, -1).mean(1)  # [Hkv, D]
        return self.cache.attend(layer, q, start, scale, **kw)


def kv_calibration(model, float_cache: Callable[[int], Any]) -> KVCalibration | None:
    """The model's KV centres and key scales over the calibration text (computed once, kept on the model),
    or None when the model has no calibration ids. `float_cache(n)`: a float KV cache of n positions for
    this model (edgellm.cache passes its own, so this module imports no cache)."""
    cached = getattr(model, "_kv_calibration", None)
    if cached is not None:
        return cached
    ids = list(getattr(model, "calibration_ids", None) or [])[: max(0, model.rope_len - 1)]
    if len(ids) < 2:
        return None
    cfg = model.config
    probe = _Recorder(float_cache(len(ids)), cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads)
    with torch.no_grad():
        # every row through every layer (the last layer's queries too), no logits
        model(torch.tensor([ids], dtype=torch.long, device=model.device), probe, 0, all_logits=True, logits=False)
    centers, scales = [], []
    for i in range(cfg.n_layers):
        k, v = probe.kv[i]  # [Hkv, T, D]
        ck, cv = k.mean(1, keepdim=True), v.mean(1, keepdim=True)
        centers.append(torch.stack((ck, cv)))
        scales.append(key_scales(probe.q_energy[i], (k - ck).pow(2).mean(1))[:, None])
    model._kv_calibration = KVCalibration(torch.stack(centers), torch.stack(scales))
    return model._kv_calibration
