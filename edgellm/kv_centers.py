"""Per-channel centres of K and V for the quantized KV caches, calibrated once per model.

Why: SmolLM2-135M's keys carry per-channel offsets 50-100x the median channel, the same for every token.
A per-token int4 group has to span the offset and the token's own signal, and loses the signal (Hadamard
rotation does not help: it spreads a constant offset over every channel, still the same for every token).
Subtracting a constant c from every key of a head changes every score of a query by the same q.c, and
softmax is invariant to that: attention is exactly unchanged, only the quantization error shrinks. The
same holds for V with the centre added back to the output (the softmax weights sum to 1). So a quantized
cache stores (k - c_k) and (v - c_v), rotated, and attention adds c_v to its output; nothing else changes.

The centres are the mean post-RoPE K and V per layer, KV head and channel over a built-in English text
(CALIBRATION_TEXT, ~512 tokens: over GPL-3 at ctx 512 the centres from 512 tokens of text cut the int4
cache's KL to the float cache about 2x; 128 tokens or random token ids helped half as much). They are
computed on first use with a quantized cache (one prefill of the text: ~0.3 s for the bundled model) and
kept on the model.
"""
from __future__ import annotations

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


def kv_centers(model) -> torch.Tensor | None:
    """[n_layers, 2, Hkv, 1, D] fp32: the mean K and V of each layer over the calibration text (computed
    once, kept on the model), or None when the model has no calibration ids."""
    cached = getattr(model, "_kv_centers", None)
    if cached is not None:
        return cached
    ids = list(getattr(model, "calibration_ids", None) or [])[: max(0, model.rope_len - 1)]
    if len(ids) < 2:
        return None
    from .cache import KVCache

    class Probe(KVCache):
        """A float cache that also records the mean K and V each layer writes."""

        def write(self, layer, k, v, start):
            means[layer] = torch.stack((k.float().mean(1, keepdim=True), v.float().mean(1, keepdim=True)))
            super().write(layer, k, v, start)

    means: dict[int, torch.Tensor] = {}
    probe = Probe(model.config, len(ids), model.dtype, model.device)
    with torch.no_grad():
        model(torch.tensor([ids], dtype=torch.long, device=model.device), probe, 0)
    model._kv_centers = torch.stack([means[i] for i in range(model.config.n_layers)])
    return model._kv_centers
