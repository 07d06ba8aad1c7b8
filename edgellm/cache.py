"""The KV cache: static, preallocated at creation, one per model; one class per storage format behind one
interface (KVCache): FloatKVCache ("fp", the model's dtype), Float16KVCache ("f16": float16 whatever the compute
dtype, llama.cpp's default cache; on the CPU half the bytes of fp32), Int8KVCache ("int8", "int8:G") and
Int4KVCache ("int4", "int4:G"). `KVCache(cfg, max_seq_len, dtype, device, kv_format)` is the one way to make one: it
returns the class of that format. Every cache has `write` (the model's new K/V), `attend` (its queries
against the cache), `truncate` / `reset`, `bytes_per_token` / `nbytes`, `prepare(model)` (a quantized
cache's calibration) and `decode_spec()`, what the fused C++ decode step reads (kernels/cpu_decode.py).

`length` is the source of truth for how many positions are valid; `truncate(n)` is O(1) (speculative
rollback, and a chat turn that diverges from the kept prefix). Storage is per layer, in one of three
formats (edgellm.kernels.kv_store): float in the model's dtype, int8 (symmetric, one scale per token
per head per `group` of the head dim) or int4 (asymmetric, scale + min per group: 16 for keys and 32
for values by default, two codes per byte). New tokens are quantized as they are written; attention
reads the storage in place, a tile at a time, so nothing ever dequantizes the whole cache. Quantized
caches keep their first KV_SINK_TOKENS positions exactly as well (attention sinks), store K and V
minus calibrated per-channel centres, and keys times calibrated per-channel scales that queries divide
back out (kv_calibration.py, which this module imports and which imports no cache): all exact for
attention, they only shrink the quantization error.

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
from .kernels.attention import attention, cpu_flash_prefill, masked_attention, write_kv, write_kv_at
from .kernels.kv_store import FloatKV, Int4KV, Int8KV, KVStore, groups
from .kv_calibration import KVCalibration, kv_calibration

KV_FORMATS = ("fp", "f16", "int8", "int4")
# Scales and mins in fp16: a quarter of an int4 token's bytes at head dim 64 instead of half of them.
SCALE_DTYPE = torch.float16
# int4 groups: values 32, keys 16 (the keys' error decides the int4 cache's quality: on SmolLM2-135M over
# GPL-3, keys in fp with int4 values cost KL 0.009, int4 keys with fp values 0.025; halving the key group
# costs 10% more bytes per token). "int4:G" sets both to G.
INT4_GROUP = 32
INT4_K_GROUP = 16
# Positions kept exactly beside the quantized rows (attention sinks, kernels/attention.py).
KV_SINK_TOKENS = 4


def resolve_kv_format(kv_format: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """The format "auto" stands for (Engine's and the command line's default): f16 for a model computing in fp32 on the CPU (half the memory and
    of a decode step's attention reads; KL to the fp32 cache ~1e-6 on SmolLM2-135M over GPL-3, 1/100 of int8's),
    else "fp", the compute dtype (already 16-bit on CUDA and MPS). Other formats pass through."""
    if kv_format == "auto":
        return "f16" if torch.device(device).type == "cpu" and dtype == torch.float32 else "fp"
    return kv_format


def parse_kv_format(kv_format: str) -> tuple[str, int | None]:
    """'fp' | 'int8' | 'int8:32' | 'int4' | 'int4:64' → (kind, group or None for the default)."""
    kind, sep, group = kv_format.partition(":")
    if kind not in KV_FORMATS or (sep and (kind in ("fp", "f16") or not group.isdigit())):
        raise ValueError(f"unknown KV-cache format {kv_format!r} (choose from fp, f16, int8, int8:G, int4, int4:G)")
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
    """The interface every format implements, and the construction entry point: `KVCache(cfg, max_seq_len,
    dtype, device, kv_format)` returns a FloatKVCache, Float16KVCache, Int8KVCache or Int4KVCache (pathlib.Path's
    way), so callers name a format string, never a class; without one, "fp" (Engine and the command line say
    "auto": resolve_kv_format). Keeps what all formats share: the per-layer storages
    (kernels/kv_store.py), `length` and the bookkeeping around it."""

    kind = ""  # the format's name in kv_format strings: "fp" | "f16" | "int8" | "int4"
    rotation: torch.Tensor | None = None  # [D, D] of a quantized cache (see the module docstring)
    centers: torch.Tensor | None = None  # [n_layers, 2, Hkv, 1, D] fp32, calibrated (the fused C++ step reads it)
    key_scales: torch.Tensor | None = None  # [n_layers, Hkv, 1, D] fp32, calibrated (the fused C++ step reads it)
    _needs_calibration = False  # model.forward calls prepare() first while this is True

    def __new__(cls, *args, **kwargs):
        if cls is KVCache:  # the format's class; Python then runs its __init__ with the same arguments
            def arg(i: int, name: str):
                return kwargs.get(name, args[i] if len(args) > i else None)

            kv_format = arg(4, "kv_format") or "fp"
            cls = _CLASSES[parse_kv_format(resolve_kv_format(kv_format, arg(2, "dtype"), arg(3, "device")))[0]]
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_format: str | None = None):
        # None: the class's own format (through KVCache(...): fp; "auto": the class __new__ chose)
        kv_format = self.kind if kv_format is None else resolve_kv_format(kv_format, dtype, device)
        kind, group = parse_kv_format(kv_format)
        if kind != self.kind:
            raise ValueError(f"{type(self).__name__} stores the {self.kind!r} KV format, not {kv_format!r}")
        self.max_seq_len = max_seq_len
        self.n_layers = cfg.n_layers
        self.kv_format = kv_format
        self.length = 0
        self.group = cfg.n_heads // cfg.n_kv_heads  # query heads per KV head (GQA)
        try:
            self.layers: list[KVStore] = [self._new_store(cfg, max_seq_len, dtype, device, group)
                                          for _ in range(cfg.n_layers)]
        except ValueError as e:  # a group that does not divide the head dim
            raise ValueError(f"KV-cache format {kv_format!r}: {e}") from None

    def _new_store(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                   group: int | None) -> KVStore:
        """One layer's storage."""
        raise NotImplementedError

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

    def prepare(self, model) -> None:
        """Before the first write: whatever the format needs from the model (a quantized cache: its calibration)."""

    def set_calibration(self, calibration: KVCalibration | None) -> None:
        """Use this calibration (None: none) from now on; K/V already written must have used the same. A float
        cache stores K and V as they are: nothing to calibrate."""

    def decode_spec(self) -> list[tuple] | None:
        """Per layer, (K, V) as the fused C++ decode step takes them (kernels/cpu_decode.py), or None where this
        cache's tensors are a layout it does not read (another device, dtype or stride)."""
        raise NotImplementedError

    # -- used by the model ---------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | DevicePosition) -> None:
        """k, v [Hkv, T, D] for positions [start, start+T) (quantized here for int8/int4)."""
        if isinstance(start, DevicePosition):
            write_kv_at(self.layers[layer], k, v, start.pos)
        else:
            write_kv(self.layers[layer], k, v, start)

    def attend(self, layer: int, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """q [1, Hq, T, D] at positions [start, start+T), causal against the cache → [1, Hq, T, D]. `window` > 0:
        each row sees only its last `window` positions; `softcap` > 0: scores soft-capped (Gemma, Phi-3)."""
        raise NotImplementedError

    @staticmethod
    def _read(store: KVStore, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int,
              softcap: float) -> torch.Tensor:
        """Attention over `store` in place (q in the store's basis): the masked path for windows and soft caps,
        the Triton kernel inside a CUDA graph, else flash-decoding (kernels/attention.py)."""
        if window or softcap:
            if isinstance(start, DevicePosition):
                return masked_attention(q, store, start.bound, 0, scale, window, softcap, lengths=start.lengths)
            return masked_attention(q, store, start + q.shape[2], start, scale, window, softcap)
        if isinstance(start, DevicePosition):  # inside a CUDA graph: the Triton kernel reads the lengths
            return _graph_attention(q, store, start.bound, scale, start.lengths)
        return attention(q, store, start + q.shape[2], start, scale)


class FloatKVCache(KVCache):
    """K and V in the model's dtype, as computed."""

    kind = "fp"
    step_dtype = torch.float32  # the storage dtype the fused C++ step reads for this format

    def _new_store(self, cfg, max_seq_len, dtype, device, group) -> FloatKV:
        return FloatKV.empty(cfg.n_kv_heads, max_seq_len, cfg.head_dim, dtype=dtype, device=device)

    def decode_spec(self) -> list[tuple] | None:
        """(K, V) tensors per layer, in step_dtype (fp32; the f16 cache: fp16)."""
        if any(t.dtype != self.step_dtype or t.device.type != "cpu" or not t.is_contiguous()
               for store in self.layers for t in store):
            return None
        return [(store.k, store.v) for store in self.layers]

    def attend(self, layer: int, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        return self._attend_store(self.layers[layer], q, start, scale, window, softcap)

    def _attend_store(self, store: FloatKV, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int,
                      softcap: float) -> torch.Tensor:
        if not (window or softcap or isinstance(start, DevicePosition)):
            T = q.shape[2]
            if (T > 1 or q.is_cuda) and not cpu_flash_prefill(q, store):
                # prefill / verification: one fused SDPA call with a causal mask (on the CPU in fp32 from
                # FLASH_MIN_ROWS rows, attention()'s flash path instead, which leaves the cached prefix unmasked
                # and lets the kernel skip the blocks above the diagonal); on CUDA also decode (eager SDPA
                # 13-65 us vs 45-155 us for two Triton launches from Python, H100,
                # benchmarks/results/attention-cuda.json; the Triton kernel wins only inside a CUDA graph)
                end = start + T
                k, v = store.k[None, :, :end], store.v[None, :, :end]
                mask = None
                if T > 1:
                    rows = torch.arange(start, end, device=q.device)[:, None]
                    mask = torch.arange(end, device=q.device)[None, :] <= rows
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                      enable_gqa=self.group > 1)
        # decode, windows, soft caps and CUDA graphs: over the storage in place
        return self._read(store, q, start, scale, window, softcap)


class Float16KVCache(FloatKVCache):
    """K and V stored as float16 whatever the compute dtype (llama.cpp's default cache type): on the CPU, where the
    model computes in fp32, half the fp32 cache's memory and of the bytes a decode step's attention reads. Written
    rounded to nearest even; read converted back to the compute dtype (exact), a tile at a time: the fused C++ step
    converts 32 rows at a time, a prompt chunk's attention the cache's prefix once per layer."""

    kind = "f16"
    step_dtype = torch.float16

    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_format: str | None = None):
        if torch.device(device).type not in ("cpu", "meta") and dtype != torch.float16:
            raise ValueError(f"the f16 KV cache is for CPU models and float16 ones; this model computes in {dtype} on "
                             f"{torch.device(device).type}: use --kv fp (the model's dtype), int8 or int4")
        super().__init__(cfg, max_seq_len, dtype, device, kv_format)

    def _new_store(self, cfg, max_seq_len, dtype, device, group) -> FloatKV:
        return FloatKV.empty(cfg.n_kv_heads, max_seq_len, cfg.head_dim, dtype=torch.float16, device=device)

    def attend(self, layer: int, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        store = self.layers[layer]
        # a float16 model's own cache, or one row (on the CPU: read a converted tile at a time)
        if q.dtype == store.k.dtype or q.shape[2] == 1:
            return super().attend(layer, q, start, scale, window, softcap)
        # a prompt chunk: the prefix and the chunk's own rows once in the compute dtype, then the float cache's paths
        end = start + q.shape[2]
        prefix = FloatKV(store.k[:, :end].to(q.dtype), store.v[:, :end].to(q.dtype))
        return self._attend_store(prefix, q, start, scale, window, softcap)


class _QuantizedKVCache(KVCache):
    """What int8 and int4 share: K/V centred, keys scaled (calibration) and rotated on write; queries
    rotated and outputs rotated back on read (see the module docstring). Subclasses say how a layer is
    stored and which of its tensors hold scales."""

    bits = 0  # code width, as the fused C++ step takes it

    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_format: str | None = None):
        super().__init__(cfg, max_seq_len, dtype, device, kv_format)
        self.rotation = _rotation(cfg.head_dim, dtype, str(torch.device(device)))
        self.centers = self.key_scales = None
        self._kv_center_t: torch.Tensor | None = None  # the centres in the cache's dtype: subtracted on write
        self._v_center_q: torch.Tensor | None = None  # [n_layers, 1, Hq, 1, D] in dtype: added to outputs
        self._key_scale_t: torch.Tensor | None = None  # [n_layers, Hkv, 1, D] in dtype: keys times it on write
        self._query_scale_t: torch.Tensor | None = None  # [n_layers, 1, Hq, 1, D] in dtype: 1 / key scale, for q
        self._needs_calibration = True

    def prepare(self, model) -> None:
        """Before the first write: take the model's calibrated centres and key scales (kv_calibration.py,
        computed with a float cache of this model)."""
        if self._needs_calibration:
            self.set_calibration(kv_calibration(
                model, lambda n: FloatKVCache(model.config, n, model.dtype, model.device)))

    def set_calibration(self, calibration: KVCalibration | None) -> None:
        self._needs_calibration = False
        self.centers = self.key_scales = None
        self._kv_center_t = self._v_center_q = self._key_scale_t = self._query_scale_t = None
        if calibration is None:
            return
        dtype, device = self.rotation.dtype, self.rotation.device
        self.centers = calibration.centers.to(device=device, dtype=torch.float32)
        self.key_scales = calibration.key_scales.to(device=device, dtype=torch.float32)
        self._kv_center_t = self.centers.to(dtype)
        self._v_center_q = self._kv_center_t[:, 1].repeat_interleave(self.group, 1)[:, None]
        self._key_scale_t = self.key_scales.to(dtype)
        self._query_scale_t = (1 / self.key_scales).repeat_interleave(self.group, 1)[:, None].to(dtype)

    @staticmethod
    def _scales(store: KVStore) -> tuple[torch.Tensor, ...]:
        """The store's scale (and min) tensors: fp16 in the layout the C++ step reads."""
        raise NotImplementedError

    def decode_spec(self) -> list[tuple] | None:
        """Per layer ((bits, K group, codes, scales, mins or None, sink rows), the same for V): codes with fp16
        scales and fp32 sink rows, and the [D, D] rotation (`self.rotation`) in fp32."""
        if self.rotation.dtype != torch.float32 or self.rotation.device.type != "cpu":
            return None
        specs = []
        for store in self.layers:
            if any(t.device.type != "cpu" or not t.is_contiguous() for t in store if isinstance(t, torch.Tensor)):
                return None
            if any(t is not None and t.dtype != torch.float32 for t in (store.k_sink, store.v_sink)):
                return None
            if any(t.dtype != torch.float16 for t in self._scales(store)):
                return None
            gk, gv = groups(store)
            specs.append(((self.bits, gk, store.k, store.k_scale, getattr(store, "k_min", None), store.k_sink),
                          (self.bits, gv, store.v, store.v_scale, getattr(store, "v_min", None), store.v_sink)))
        return specs

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | DevicePosition) -> None:
        if self.centers is not None:
            c = self._kv_center_t[layer]
            k, v = (k - c[0]) * self._key_scale_t[layer], v - c[1]
        super().write(layer, k @ self.rotation, v @ self.rotation, start)

    def attend(self, layer: int, q: torch.Tensor, start: int | DevicePosition, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """Flash-decoding over the codes in place, in the rotated basis."""
        if self._query_scale_t is not None:  # q divided by the key scales, then rotated
            q = q * self._query_scale_t[layer]
        out = self._read(self.layers[layer], q @ self.rotation, start, scale, window, softcap) @ self.rotation.T
        return out if self._v_center_q is None else out + self._v_center_q[layer]


class Int8KVCache(_QuantizedKVCache):
    """int8 codes, symmetric, one fp16 scale per token per head per group of the head dim (the whole head by
    default), the first KV_SINK_TOKENS positions also exact."""

    kind, bits = "int8", 8

    def _new_store(self, cfg, max_seq_len, dtype, device, group) -> Int8KV:
        return Int8KV.empty(cfg.n_kv_heads, max_seq_len, cfg.head_dim, group=group, scale_dtype=SCALE_DTYPE,
                            device=device, n_sink=KV_SINK_TOKENS)

    @staticmethod
    def _scales(store: Int8KV) -> tuple[torch.Tensor, ...]:
        return store.k_scale, store.v_scale


class Int4KVCache(_QuantizedKVCache):
    """int4 codes, two per byte, asymmetric (fp16 scale + min per group: keys INT4_K_GROUP, values INT4_GROUP;
    "int4:G" sets both), the first KV_SINK_TOKENS positions also exact."""

    kind, bits = "int4", 4

    def _new_store(self, cfg, max_seq_len, dtype, device, group) -> Int4KV:
        return Int4KV.empty(cfg.n_kv_heads, max_seq_len, cfg.head_dim, group=group or min(INT4_GROUP, cfg.head_dim),
                            scale_dtype=SCALE_DTYPE, device=device, k_group=group or min(INT4_K_GROUP, cfg.head_dim),
                            n_sink=KV_SINK_TOKENS)

    @staticmethod
    def _scales(store: Int4KV) -> tuple[torch.Tensor, ...]:
        return store.k_scale, store.k_min, store.v_scale, store.v_min


_CLASSES: dict[str, type[KVCache]] = {c.kind: c for c in (FloatKVCache, Float16KVCache, Int8KVCache, Int4KVCache)}
