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
returns None and the engine calls the model op by op.

A step is `step(token [1, 1] long on the model's device, pos) -> logits [vocab]`, valid until the next
call, and sets `cache.length = pos + 1` as the model does. `step.limit` is the first position it cannot
serve (the caller falls back to the eager model there).
"""
from __future__ import annotations

import torch

from .cache import DevicePosition, KVCache

GRAPH_BUCKET_MIN = 256


class Decoder:
    """One token through `model` at position `pos` of `cache` → logits [vocab]: the compiled step where it
    applies (built on first use, rebuilt when the cache or the mode changes), else the eager model.
    Used by the engine and by draft models (speculative.py)."""

    def __init__(self, model):
        self.model = model
        self._key: tuple | None = None  # (cache, mode) the step was built for
        self._step = None

    def compiled(self, cache: KVCache, mode: str = "auto"):
        """The compiled step for this cache and mode, or None (mode "off", or it does not apply)."""
        if mode == "off":
            return None
        if self._key is None or self._key[0] is not cache or self._key[1] != mode:
            self._key, self._step = (cache, mode), compiled_decode_step(self.model, cache, mode)
        return self._step

    def __call__(self, token: torch.Tensor, cache: KVCache, pos: int, mode: str = "auto") -> torch.Tensor:
        """token [1, 1] long on the model's device; the logits are valid until the next call."""
        step = self.compiled(cache, mode)
        if step is not None and pos < step.limit:
            return step(token, pos)
        return self.model(token, cache, pos)[0, -1]


def compiled_decode_step(model, cache: KVCache, mode: str = "auto"):
    """The fused / graph-captured decode step for this model and cache, or None (use the eager model).
    mode "inductor": on CUDA, torch.compile the forward inside the graph (elsewhere the same as "auto")."""
    if model.device.type == "cpu":
        from .kernels.cpu_decode import fused_decode_step

        return fused_decode_step(model, cache)
    if model.device.type == "cuda" and cuda_graph_supported(model, cache):
        return CudaGraphDecodeStep(model, cache, inductor=mode == "inductor")
    return None


def cuda_graph_supported(model, cache: KVCache) -> bool:
    """The Triton kernel is what reads a device-side position: it must take this cache's head dim."""
    from .kernels.attention import triton_available, triton_supports

    return triton_available() and all(triton_supports(s, model.config.head_dim) for s in cache.layers)


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
