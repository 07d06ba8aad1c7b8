"""The decode step as one unit per device: what `Engine.step` runs instead of the model's eager graph.

At batch size 1 a small model's decode step is launch- and interpreter-bound (~30 layers × ~20 ops per
token), so the step is run as one unit where the device allows:
- CPU: the fused C++ step (kernels/cpu_decode.py), one call per token;
- CUDA: the model's forward captured once in a CUDA graph and replayed per token. The position lives on
  the device (cache.DevicePosition), so one graph serves every step; attention is the Triton
  flash-decoding kernel reading that position. One graph is captured per context bucket (256, 512,
  1024, ... up to the cache size) so the kernel's launch grid follows the context, not the cache size.
`--compile inductor` also runs torch.compile on the forward inside the graph (fused elementwise ops).
Elsewhere (MPS, a model or cache the unit does not describe, `--compile off`) `compiled_decode_step`
returns no step and the engine calls the model op by op. Which path runs, and why not a faster one, is a
`DecodePath` (`Decoder.path`): `--debug` prints it, `edgellm info` shows it, `edgellm bench` rows carry it.

Selection, in order: compile "off" → eager ("--compile off"); CPU: fused off → eager ("fused step off"), else
the fused step, or eager with the reason the fused plan refused (kernels/cpu_decode.py NotFused: no extension,
not fp32, a cache or weight layout it does not read, a C++ check); CUDA: a CUDA graph (inductor: of the
torch.compile'd forward) when Triton takes every cache layer's head dim, else eager with that reason; any other
device: eager.

A step is `step(token [1, 1] long on the model's device, pos) -> logits [vocab]`, valid until the next
call, and sets `cache.length = pos + 1` as the model does. `step.limit` is the first position it cannot
serve (the caller falls back to the eager model there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import DevicePosition, KVCache
from .options import Options

GRAPH_BUCKET_MIN = 256


@dataclass(frozen=True)
class DecodePath:
    """Which decode step runs: "fused-cpu", "cuda-graph", "cuda-graph-inductor" or "eager"; `reason` says why
    the eager model serves ("" on a compiled path)."""

    name: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})" if self.reason else self.name


class Decoder:
    """One token through `model` at position `pos` of `cache` → logits [vocab]: the compiled step where it
    applies (built on first use, rebuilt when the cache or the mode changes), else the eager model.
    Used by the engine and by draft models (speculative.py). `options`: its kernel and decode settings."""

    def __init__(self, model, options: Options | None = None):
        self.model = model
        self.options = options or Options()
        self._key: tuple | None = None  # (cache, mode) the step was built for
        self._step = None
        self.path: DecodePath | None = None  # of the last step built (None: none yet)

    def compiled(self, cache: KVCache, mode: str = "auto"):
        """The compiled step for this cache and mode, or None (mode "off", or it does not apply)."""
        if self._key is None or self._key[0] is not cache or self._key[1] != mode:
            self._step, self.path = compiled_decode_step(self.model, cache, mode, self.options)
            self._key = (cache, mode)
        return self._step

    def built(self, cache: KVCache, mode: str = "auto"):
        """The compiled step if it is already built for this cache and mode, else None (builds nothing)."""
        return self._step if self._key is not None and self._key[0] is cache and self._key[1] == mode else None

    def __call__(self, token: torch.Tensor, cache: KVCache, pos: int, mode: str = "auto") -> torch.Tensor:
        """token [1, 1] long on the model's device; the logits are valid until the next call."""
        step = self.compiled(cache, mode)
        if step is not None and pos < step.limit:
            return step(token, pos)
        return self.model(token, cache, pos)[0, -1]


def compiled_decode_step(model, cache: KVCache, mode: str = "auto",
                         options: Options | None = None) -> tuple[object | None, DecodePath]:
    """The fused / graph-captured decode step for this model and cache, or None (use the eager model), and the
    DecodePath saying which (the selection rules: the module docstring). mode "inductor": on CUDA,
    torch.compile the forward inside the graph (elsewhere the same as "auto")."""
    options = options or Options()
    if mode == "off":
        return None, DecodePath("eager", "--compile off")
    if model.device.type == "cpu":
        from .kernels.cpu_decode import NotFused, fused_decode_step

        if not options.decode.fused:
            return None, DecodePath("eager", "the fused CPU step is off")
        try:
            return fused_decode_step(model, cache, options.kernel, options.decode.tuning), DecodePath("fused-cpu")
        except NotFused as e:
            return None, DecodePath("eager", str(e))
    if model.device.type == "cuda":
        why = cuda_graph_unsupported(model, cache)
        if why:
            return None, DecodePath("eager", why)
        inductor = mode == "inductor"
        return (CudaGraphDecodeStep(model, cache, inductor=inductor),
                DecodePath("cuda-graph-inductor" if inductor else "cuda-graph"))
    return None, DecodePath("eager", f"no compiled decode step on {model.device.type}")


def cuda_graph_supported(model, cache: KVCache) -> bool:
    """The Triton kernel is what reads a device-side position: it must take this cache's head dim."""
    return not cuda_graph_unsupported(model, cache)


def cuda_graph_unsupported(model, cache: KVCache) -> str:
    """Why a CUDA graph cannot serve this model and cache ("" where it can)."""
    from .kernels.attention import triton_available, triton_supports

    if not triton_available():
        return "Triton is unavailable (the graph needs its attention kernel)"
    if not all(triton_supports(s, model.config.head_dim) for s in cache.layers):
        return f"the Triton attention kernel does not take head dim {model.config.head_dim} with this cache"
    return ""


class CudaGraphDecodeStep:
    def __init__(self, model, cache: KVCache, inductor: bool = False):
        """inductor: capture torch.compile(model.forward) instead of the eager forward. It fuses the
        elementwise ops between the matmuls (RMSNorm, RoPE, SiLU·up, residuals): measured 2x the decode
        tok/s of the plain graph on an H100 (benchmarks/results/compile-cuda.json), for 10-30 s of
        compilation at the first step. The attention kernel stays outside the traced graphs (a graph
        break per layer, free at replay)."""
        self.model, self.cache = model, cache
        self.forward = torch.compile(model.forward, dynamic=False) if inductor else model
        self.limit = min(cache.max_seq_len, model.rope_len)
        dev = model.device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.pool = torch.cuda.graph_pool_handle()  # the buckets' graphs share one memory pool
        # bucket → (graph, its logits, its DevicePosition); the graph holds raw pointers only, so every
        # tensor it reads that was made outside the capture (the position's lengths) is kept alive here
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, DevicePosition]] = {}

    def bucket(self, pos: int) -> int:
        """The smallest captured context (256 · 2^k, at most the cache) that holds position `pos`."""
        b = GRAPH_BUCKET_MIN
        while b <= pos:
            b *= 2
        return min(b, self.limit)

    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self.token.copy_(token)
        self.pos.fill_(pos)  # a kernel argument: no host-device sync
        b = self.bucket(pos)
        entry = self.graphs.get(b)
        if entry is None:
            entry = self.graphs[b] = self._capture(b)
        entry[0].replay()
        self.cache.length = pos + 1
        return entry[1]

    def _capture(self, bound: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, DevicePosition]:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels), as torch's docs
        # ask; the warm-up writes this step's own K/V, which the replay writes again identically.
        at = DevicePosition(self.pos, bound)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self.forward(self.token, self.cache, at)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            logits = self.forward(self.token, self.cache, at)[0, -1]
        return graph, logits, at
