"""Activation-aware quantization: how much each input channel of each linear matters.

Used by loading.load_model(calibration=...): it runs the float model, so it sits above quant/.
The scale search (quant/groups.py) minimises the squared error of the weights; what the model feels is
the error of the outputs, sum_k (w_k - q_k) x_k over its inputs x. Weighting each input channel's error
by E[x_k^2] over some text (llama.cpp's importance matrix, `llama-imatrix`) makes the search spend its
levels on the channels that carry signal. On the bundled SmolLM2-135M (GPL-3, ctx 512) it took int4 g32
symmetric from ppl 22.84 to ~19.8 and g64 asymmetric from 23.08 to ~19.2 (benchmarks/results/quality.md).

The text is edgellm's built-in calibration text (edgellm/kv_calibration.py, ~512 tokens of mixed prose,
code and chat, written for this) or a file the user gives; evaluation texts should not be calibration
texts. Chunks of up to CHUNK tokens, at most MAX_TOKENS in all.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .cache import KVCache
from .errors import EdgeLLMError
from .kv_calibration import CALIBRATION_TEXT

CHUNK = 512
MAX_TOKENS = 8192


def calibration_tokens(tokenizer, source: str) -> list[list[int]]:
    """`source`: "builtin" or a text file's path → token chunks."""
    if source == "builtin":
        text = CALIBRATION_TEXT
    else:
        try:
            text = Path(source).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise EdgeLLMError(f"calibration text {source}: {e.strerror or e}") from e
    ids = list(tokenizer.encode(text))[:MAX_TOKENS]
    if len(ids) < 16:
        raise EdgeLLMError(f"calibration text {source}: {len(ids)} tokens, need at least 16")
    return [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK) if len(ids[i:i + CHUNK]) >= 16]


def activation_importance(model, chunks: list[list[int]]) -> dict[str, torch.Tensor]:
    """{parameter name ("layers.0.attention.wqkv.weight", "output.weight", ...): mean x_k^2 [in_features]}
    of every nn.Linear's input over the chunks (each run from an empty float cache)."""
    sums: dict[str, torch.Tensor] = {}
    count = 0

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.square().sum(0)
        return record

    handles = [m.register_forward_pre_hook(hook(name + ".weight"))
               for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            for ids in chunks:
                n = min(len(ids), model.rope_len)
                cache = KVCache(model.config, n, model.dtype, model.device)
                model(torch.tensor([ids[:n]], device=model.device), cache, 0, all_logits=True)
                count += n
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, s in sums.items():
        imp = (s / count).cpu()
        out[name] = imp + 1e-6 * imp.mean().clamp_min(1e-30)  # no channel weighs exactly 0
    return out
