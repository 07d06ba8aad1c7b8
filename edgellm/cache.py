"""The KV cache: static, preallocated at creation, one per model.

`length` is the source of truth for how many positions are valid; `truncate(n)` is O(1) (speculative
rollback, and a chat turn that diverges from the kept prefix). Storage is per layer, in one of three
formats (edgellm.kernels.attention): float in the model's dtype, int8 (symmetric, one scale per token
per head per `group` of the head dim) or int4 (asymmetric, scale + min per group: 16 for keys and 32
for values by default, two codes per byte). New tokens are quantized as they are written; attention
reads the storage in place, a tile at a time, so nothing ever dequantizes the whole cache. Quantized
caches keep their first KV_SINK_TOKENS positions exactly as well (attention sinks), store K and V
minus calibrated per-channel centres, and keys times calibrated per-channel scales that queries divide
back out (kv_calibration.py): all exact for attention, they only shrink the quantization error.

Quantized caches store K and V rotated by an orthonormal Hadamard matrix H along the head dim, and
attention runs on q·H with its output rotated back (q·k = qH·kH, softmax·VH = (softmax·V)H). The
rotation spreads a few outlier channels over the whole head, so a per-token scale fits every channel
(QuaRot, Ashkboos et al. 2024): on SmolLM2-135M it cuts the int8 cache's KL to the float cache 3.5×.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kernels.attention import (FloatKV, Int4KV, Int8KV, KVStore, attention, cpu_flash_prefill, masked_attention,
                                write_kv, write_kv_at)

KV_FORMATS = ("fp", "int8", "int4")
# Scales and mins in fp16: a quarter of an int4 token's bytes at head dim 64 instead of half of them.
SCALE_DTYPE = torch.float16
# int4 groups: values 32, keys 16 (the keys' error decides the int4 cache's quality: on SmolLM2-135M over
# GPL-3, keys in fp with int4 values cost KL 0.009, int4 keys with fp values 0.025; halving the key group
# costs 10% more bytes per token). "int4:G" sets both to G.
INT4_GROUP = 32
INT4_K_GROUP = 16
# Positions kept exactly beside the quantized rows (attention sinks, kernels/attention.py).
KV_SINK_TOKENS = 4


def parse_kv_format(kv_format: str) -> tuple[str, int | None]:
    """'fp' | 'int8' | 'int8:32' | 'int4' | 'int4:64' → (kind, group or None for the default)."""
    kind, sep, group = kv_format.partition(":")
    if kind not in KV_FORMATS or (sep and (kind == "fp" or not group.isdigit())):
        raise ValueError(f"unknown KV-cache format {kv_format!r} (choose from fp, int8, int8:G, int4, int4:G)")
    return kind, int(group) if group else None


@dataclass
class DevicePosition:
    """The position of a one-token decode step held on the device, so a captured CUDA graph serves
    every step: `pos` int64 [1] (set by the caller before each replay), `lengths` int32 [kv_len,
    q_start] derived from it inside the graph for the attention kernel, and `bound`, a host-side upper
    bound of kv_len that sizes the kernel's launch grid (the graph's context bucket)."""

    pos: torch.Tensor
    bound: int
    lengths: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.lengths = torch.zeros(2, dtype=torch.int32, device=self.pos.device)

    def update(self) -> None:
        """lengths ← (pos + 1, pos), on the device (recorded in the graph)."""
        self.lengths.copy_(torch.cat((self.pos + 1, self.pos)))


@functools.lru_cache(maxsize=None)
def _rotation(d: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """An orthonormal [d, d] matrix: Sylvester-Hadamard / sqrt(d) for powers of two, otherwise a fixed
    seeded random orthogonal matrix (QR of a Gaussian)."""
    if d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h /= math.sqrt(d)
    else:
        h, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return h.to(dtype=dtype, device=device)


def _graph_attention(q: torch.Tensor, store: KVStore, bound: int, scale: float, lengths: torch.Tensor) -> torch.Tensor:
    return _opaque_triton_attention()(q, store, bound, 0, scale, lengths=lengths)


@functools.lru_cache(maxsize=None)
def _opaque_triton_attention():
    """The Triton kernel behind torch.compiler.disable: inductor cannot compile the kernel itself, and a CUDA
    graph records it all the same. Made on first use: torch.compiler.disable imports torch._dynamo, which
    imports triton, and at module import that would fix triton's mode before TRITON_INTERPRET can be set."""
    from .kernels.triton_attention import triton_attention

    return torch.compiler.disable(triton_attention)


class KVCache:
    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_format: str = "fp"):
        kind, group = parse_kv_format(kv_format)
        self.max_seq_len = max_seq_len
        self.n_layers = cfg.n_layers
        self.kv_format = kv_format
        self.kind = kind
        self.length = 0
        self.group = cfg.n_heads // cfg.n_kv_heads  # query heads per KV head (GQA)
        args = (cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        try:
            if kind == "fp":
                make = lambda: FloatKV.empty(*args, dtype=dtype, device=device)  # noqa: E731
            elif kind == "int8":
                make = lambda: Int8KV.empty(*args, group=group, scale_dtype=SCALE_DTYPE, device=device,  # noqa: E731
                                            n_sink=KV_SINK_TOKENS)
            else:
                gv = group or min(INT4_GROUP, cfg.head_dim)
                gk = group or min(INT4_K_GROUP, cfg.head_dim)
                make = lambda: Int4KV.empty(*args, group=gv, scale_dtype=SCALE_DTYPE, device=device,  # noqa: E731
                                            k_group=gk, n_sink=KV_SINK_TOKENS)
            self.layers: list[KVStore] = [make() for _ in range(cfg.n_layers)]
        except ValueError as e:  # a group that does not divide the head dim
            raise ValueError(f"KV-cache format {kv_format!r}: {e}") from None
        self.rotation = None if kind == "fp" else _rotation(cfg.head_dim, dtype, str(torch.device(device)))
        # calibrated per-channel K/V centres and key scales (kv_calibration.py), set by prepare()
        self.centers: torch.Tensor | None = None  # [n_layers, 2, Hkv, 1, D] fp32 (the fused C++ step reads it)
        self.key_scales: torch.Tensor | None = None  # [n_layers, Hkv, 1, D] fp32 (the fused C++ step reads it)
        self._kv_center_t: torch.Tensor | None = None  # the centres in the cache's dtype: subtracted on write
        self._v_center_q: torch.Tensor | None = None  # [n_layers, 1, Hq, 1, D] in dtype: added to outputs
        self._key_scale_t: torch.Tensor | None = None  # [n_layers, Hkv, 1, D] in dtype: keys times it on write
        self._query_scale_t: torch.Tensor | None = None  # [n_layers, 1, Hq, 1, D] in dtype: 1 / key scale, for q
        self._needs_calibration = kind != "fp"

    def prepare(self, model) -> None:
        """Before the first write of a quantized cache: take the model's calibrated centres and key scales."""
        if self._needs_calibration:
            from .kv_calibration import kv_calibration

            self.set_calibration(kv_calibration(model))

    def set_calibration(self, calibration) -> None:
        """Use this KVCalibration (None: none) from now on; K/V already written must have used the same."""
        self._needs_calibration = False
        self.centers = self.key_scales = None
        self._kv_center_t = self._v_center_q = self._key_scale_t = self._query_scale_t = None
        if calibration is None or self.rotation is None:
            return
        dtype, device = self.rotation.dtype, self.rotation.device
        self.centers = calibration.centers.to(device=device, dtype=torch.float32)
        self.key_scales = calibration.key_scales.to(device=device, dtype=torch.float32)
        self._kv_center_t = self.centers.to(dtype)
        self._v_center_q = self._kv_center_t[:, 1].repeat_interleave(self.group, 1)[:, None]
        self._key_scale_t = self.key_scales.to(dtype)
        self._query_scale_t = (1 / self.key_scales).repeat_interleave(self.group, 1)[:, None].to(dtype)

    # -- bookkeeping ---------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes across all layers, K and V, scales and mins included."""
        return sum(store.bytes_per_token for store in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for store in self.layers for t in store if isinstance(t, torch.Tensor))

    # -- used by the model ---------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | DevicePosition) -> None:
        """k, v [Hkv, T, D] for positions [start, start+T) (quantized here for int8/int4)."""
        if self.rotation is not None:
            if self.centers is not None:
                c = self._kv_center_t[layer]
                k, v = (k - c[0]) * self._key_scale_t[layer], v - c[1]
            k, v = k @ self.rotation, v @ self.rotation
        if isinstance(start, DevicePosition):
            write_kv_at(self.layers[layer], k, v, start.pos)
        else:
            write_kv(self.layers[layer], k, v, start)

    def attend(self, layer: int, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """q [1, Hq, T, D] at positions [start, start+T), causal against the cache → [1, Hq, T, D]. `window` > 0:
        each row sees only its last `window` positions; `softcap` > 0: scores soft-capped (Gemma, Phi-3)."""
        store = self.layers[layer]
        if window or softcap:
            qr = q if self.rotation is None else self._rotate_query(q, layer)
            if isinstance(start, DevicePosition):
                out = masked_attention(qr, store, start.bound, 0, scale, window, softcap, lengths=start.lengths)
            else:
                out = masked_attention(qr, store, start + q.shape[2], start, scale, window, softcap)
            return out if self.rotation is None else self._unrotate(out, layer)
        if isinstance(start, DevicePosition):  # inside a CUDA graph: the Triton kernel reads the lengths
            qr = q if self.rotation is None else self._rotate_query(q, layer)
            out = _graph_attention(qr, store, start.bound, scale, start.lengths)
            return out if self.rotation is None else self._unrotate(out, layer)
        T = q.shape[2]
        end = start + T
        if isinstance(store, FloatKV) and (T > 1 or q.is_cuda) and not cpu_flash_prefill(q, store):
            # prefill / verification on a float cache: one fused SDPA call with a causal mask (on the CPU in
            # fp32 from FLASH_MIN_ROWS rows, attention()'s flash path instead, which leaves the cached prefix
            # unmasked and lets the kernel skip the blocks above the diagonal); on CUDA also decode (eager
            # SDPA 13-65 us vs 45-155 us for two Triton launches from Python, H100,
            # benchmarks/results/attention-cuda.json; the Triton kernel wins only inside a CUDA graph)
            k, v = store.k[None, :, :end], store.v[None, :, :end]
            mask = None
            if T > 1:
                rows = torch.arange(start, end, device=q.device)[:, None]
                mask = torch.arange(end, device=q.device)[None, :] <= rows
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=self.group > 1)
        # decode, and anything on a quantized cache: flash-decoding over the storage in place
        if self.rotation is None:
            return attention(q, store, end, start, scale)
        return self._unrotate(attention(self._rotate_query(q, layer), store, end, start, scale), layer)

    def _rotate_query(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q [1, Hq, T, D] in a quantized cache's basis: divided by the key scales, rotated."""
        if self._query_scale_t is not None:
            q = q * self._query_scale_t[layer]
        return q @ self.rotation

    def _unrotate(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        """A quantized cache's attention output back in the model's basis, the V centre added back."""
        out = out @ self.rotation.T
        return out if self._v_center_q is None else out + self._v_center_q[layer]
