"""RMSNorm and the MLP's gated activation on the CPU in one pass each (kernels/cpu_pointwise.cpp), where the C++
kernels are built; None elsewhere (another device or dtype, no extension, inside torch.compile), and the model's
torch ops serve. A prompt chunk of 512 rows spends ~10% of its prefill in these ops as torch runs them (4-6 passes
over [T, dim] / [T, hidden] each); benchmarks/gguf_prefill_ab.py --compare pointwise times the two.
"""
from __future__ import annotations

import torch

ENABLED = True  # A/B switch for benchmarks (process-wide)


def _ext(x: torch.Tensor):
    if not ENABLED or x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    from .matmul import cpu_extension

    return cpu_extension()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, or None (use the torch ops)."""
    ext = _ext(x)
    if ext is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return ext.rms_norm(x, weight, eps)


def gated_activation(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
    """act(gate) * up for the fused gate/up product [..., 2 H] (act: silu, or gelu_tanh if gelu), or None."""
    ext = _ext(gate_up)
    return None if ext is None else ext.gated_mlp(gate_up, gelu)
