"""Which kernels a prompt chunk runs, named as decode_step.DecodePath names the decode step: each linear of the
layers asked how it multiplies a chunk's rows (the methods its forward picks by), and the causal attention kernel.
`edgellm info` shows it, `edgellm bench` rows carry it, `--debug` prints it. The LM head (one row per prompt) and
the embedding are not in it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

# each linear class's method names (quant/gguf_linear.GGUFLinear.method, quant/linear.QuantLinear.method), as shown
METHOD_NAMES = {"amx": "AMX bf16", "prompt": "int8 GEMM", "rows": "int8 rows", "kernel": "int8 rows",
                "dequantize": "dequantize + GEMM", "dense": "dequantize + GEMM", "packed": "device kernel",
                "triton": "Triton GGUF rows"}
FUSED = "fused decode step"  # a short prompt part's path (Engine.prefill)


@dataclass(frozen=True)
class PrefillPath:
    rows: int  # prompt tokens in the forward pass described (a longer prompt runs in chunks of the device's size)
    linears: dict[str, int] = field(default_factory=dict)  # method → how many of the layers' linears run it
    attention: str = ""
    fused_rows: int = 0  # prompt parts of up to this many tokens run the fused decode step instead (0: none)

    def __str__(self) -> str:
        if self.rows <= self.fused_rows:
            return f"{FUSED}, LM head on the last row (at {self.rows} rows)"
        linears = ", ".join(name if len(self.linears) == 1 else f"{name} ×{n}" for name, n in self.linears.items())
        text = f"{linears or 'no linears'}; attention {self.attention} (at {self.rows} rows)"
        return text + (f"; up to {self.fused_rows} rows: the {FUSED}" if self.fused_rows else "")

    def as_dict(self) -> dict:
        return {"rows": self.rows, "linears": dict(self.linears), "attention": self.attention,
                "fused_rows": self.fused_rows}


def fused_prefill_rows(step) -> int:
    """How many prompt tokens the decode step `step` prefills at once (kernels/cpu_decode.FusedDecodeStep.prefill:
    Engine.prefill takes it for a prompt part that short), 0 for a step without it (None: the eager model)."""
    return step.max_rows if getattr(step, "prefill", None) is not None else 0


def linear_method(module: nn.Module, x: torch.Tensor) -> str | None:
    """How `module` multiplies x, by its display name; None for a module that is not a linear."""
    how = getattr(module, "method", None)
    if callable(how) and hasattr(module, "in_features"):
        name = how(x)
        return METHOD_NAMES.get(name, name)
    if isinstance(module, nn.Linear):
        return f"{str(module.weight.dtype).replace('torch.', '').replace('float', 'fp')} GEMM"
    return None


def attention_kernel(dtype: torch.dtype, device: torch.device, head_dim: int, rows: int) -> str:
    """The kernel the causal attention of `rows` prompt rows runs on (kernels/attention._causal_kernel, for the
    fp32 CPU models it serves from FLASH_MIN_ROWS rows on), or torch's own."""
    from .kernels import attention

    if device.type != "cpu" or rows < attention.FLASH_MIN_ROWS:
        return "torch SDPA"
    kernel = attention._causal_kernel(torch.empty(1, 1, head_dim, dtype=dtype), head_dim)
    if kernel is None:
        return "torch flash" if dtype == torch.float32 else "torch SDPA"
    return "AMX bf16x3" if getattr(kernel, "keywords", {}).get("amx") else "C++ fp32"


def prefill_path(model: nn.Module, tokens: int | None = None, fused_rows: int = 0) -> PrefillPath:
    """The path of a `tokens`-token prompt's (first) forward pass through `model`; default: a full chunk (the
    chunk size on its device). `fused_rows`: the engine's fused_prefill_rows (a part that short runs the fused
    decode step, its linears and attention named as such)."""
    from .device import prefill_chunk

    cfg = model.config
    rows = prefill_chunk(model.device, cfg.intermediate_size)
    rows = rows if tokens is None else max(1, min(tokens, rows))
    if rows <= fused_rows:
        return PrefillPath(rows, {FUSED: 4 * cfg.n_layers}, FUSED, fused_rows)
    methods: Counter[str] = Counter()
    with torch.no_grad():
        for layer in model.layers:
            for module in layer.modules():
                # a stand-in for the chunk's activations: the methods read its shape, dtype and device only
                x = torch.zeros((), dtype=model.dtype, device=model.device).expand(rows, module.in_features) \
                    if hasattr(module, "in_features") else None
                name = linear_method(module, x) if x is not None else None
                if name is not None:
                    methods[name] += 1
    attention = attention_kernel(model.dtype, model.device, cfg.head_dim, rows)
    return PrefillPath(rows, dict(methods.most_common()), attention, fused_rows)
