"""The KV storages attention reads in place, one per layer, preallocated for max_seq_len S; positions
[0, kv_len) are valid. Shared by the torch path (attention.py) and the Triton kernel (triton_attention.py),
so neither imports the other for them.

  FloatKV(k, v)                                    k, v [Hkv, S, D] fp32/bf16/fp16
  Int8KV(k, k_scale, v, v_scale, group)            codes int8 [Hkv, S, D], scales [Hkv, S, D//group];
                                                   x = code * scale
  Int4KV(k, k_scale, k_min, v, v_scale, v_min, group)
                                                   uint8 [Hkv, S, D//2], split-halves nibbles (byte j:
                                                   element j low, element j + D/2 high, see kv_quant);
                                                   scale/min [Hkv, S, D//group]; x = code * scale + min

Quantized stores may carry `k_group` (K's group when it differs from V's `group`: keys hold the outliers,
so the default int4 cache gives them groups of 16, values 32) and `k_sink` / `v_sink` fp32 [Hkv, n_sink + 1,
D]: the first n_sink positions also kept exactly (attention-sink tokens draw most of the attention mass,
and an error in their keys shifts every score; StreamingLLM, Xiao et al. 2023; IntactKV, Liu et al. 2024).
Every reader takes rows < n_sink from there instead of dequantizing them; the last row is where a write
at a device-held position >= n_sink goes (a CUDA graph cannot branch on the position).
"""
from __future__ import annotations

import functools
import math
import mmap
from typing import NamedTuple, Union

import torch

# CPU stores at least this large come from an anonymous mapping (zeros): see `zeros`. (A 135M model's layer store at
# 2560 tokens is 960 KiB of fp16: under the 1 MiB this was, its 60 stores were written whole at load.)
LAZY_ZEROS_MIN_BYTES = 64 << 10


def zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, except that a large CPU store is backed by an anonymous memory mapping: the kernel's zero pages,
    made resident only as positions are written. torch.zeros writes every page up front (a 1B model's 2560-token
    fp32 cache: 170 MB resident and ~0.45 s of page faults at load on a 2-core VM), most of it for context a chat
    may never reach."""
    dev = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if dev.type != "cpu" or nbytes < LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=dev)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class FloatKV(NamedTuple):
    k: torch.Tensor  # [Hkv, S, D]
    v: torch.Tensor

    @classmethod
    def empty(cls, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "FloatKV":
        shape = (n_kv_heads, max_seq_len, head_dim)
        return cls(zeros(shape, dtype, device), zeros(shape, dtype, device))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position occupies in this layer (K and V, all KV heads)."""
        return _bytes_per_token(self)


class Int8KV(NamedTuple):
    k: torch.Tensor        # int8 [Hkv, S, D]
    k_scale: torch.Tensor  # [Hkv, S, D // k_group] fp16 or fp32
    v: torch.Tensor
    v_scale: torch.Tensor  # [Hkv, S, D // group]
    group: int
    k_group: int | None = None         # None: the same as group
    k_sink: torch.Tensor | None = None  # fp32 [Hkv, n_sink + 1, D]: positions < n_sink, exact
    v_sink: torch.Tensor | None = None

    @classmethod
    def empty(cls, n_kv_heads: int, max_seq_len: int, head_dim: int, group: int | None = None,
              scale_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              k_group: int | None = None, n_sink: int = 0) -> "Int8KV":
        group = head_dim if group is None else group
        k_group = group if k_group is None else k_group
        _check_layout(head_dim, group, packed=False)
        _check_layout(head_dim, k_group, packed=False)
        codes = (n_kv_heads, max_seq_len, head_dim)
        z = functools.partial(zeros, device=device)
        return cls(z(codes, dtype=torch.int8), z((n_kv_heads, max_seq_len, head_dim // k_group), dtype=scale_dtype),
                   z(codes, dtype=torch.int8), z((n_kv_heads, max_seq_len, head_dim // group), dtype=scale_dtype),
                   group, k_group, *_sinks(n_kv_heads, n_sink, head_dim, device))

    @property
    def bytes_per_token(self) -> int:
        return _bytes_per_token(self)


class Int4KV(NamedTuple):
    k: torch.Tensor        # uint8 [Hkv, S, D // 2], split-halves nibbles
    k_scale: torch.Tensor  # [Hkv, S, D // k_group]
    k_min: torch.Tensor    # [Hkv, S, D // k_group]
    v: torch.Tensor
    v_scale: torch.Tensor  # [Hkv, S, D // group]
    v_min: torch.Tensor
    group: int
    k_group: int | None = None         # None: the same as group
    k_sink: torch.Tensor | None = None  # fp32 [Hkv, n_sink + 1, D]: positions < n_sink, exact
    v_sink: torch.Tensor | None = None

    @classmethod
    def empty(cls, n_kv_heads: int, max_seq_len: int, head_dim: int, group: int = 32,
              scale_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              k_group: int | None = None, n_sink: int = 0) -> "Int4KV":
        k_group = group if k_group is None else k_group
        _check_layout(head_dim, group, packed=True)
        _check_layout(head_dim, k_group, packed=True)
        codes = (n_kv_heads, max_seq_len, head_dim // 2)
        ks = (n_kv_heads, max_seq_len, head_dim // k_group)
        vs = (n_kv_heads, max_seq_len, head_dim // group)
        z = functools.partial(zeros, device=device)
        return cls(z(codes, dtype=torch.uint8), z(ks, dtype=scale_dtype), z(ks, dtype=scale_dtype),
                   z(codes, dtype=torch.uint8), z(vs, dtype=scale_dtype), z(vs, dtype=scale_dtype),
                   group, k_group, *_sinks(n_kv_heads, n_sink, head_dim, device))

    @property
    def bytes_per_token(self) -> int:
        return _bytes_per_token(self)


KVStore = Union[FloatKV, Int8KV, Int4KV]


def _check_layout(head_dim: int, group: int, packed: bool) -> None:
    if group <= 0 or head_dim % group:
        raise ValueError(f"group size {group} does not divide the head dim {head_dim}")
    if packed and head_dim % 2:
        raise ValueError(f"int4 packing needs an even head dim, got {head_dim}")


def _sinks(n_kv_heads: int, n_sink: int, head_dim: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if n_sink <= 0:
        return None, None
    shape = (n_kv_heads, n_sink + 1, head_dim)  # + 1: the slot a device-position write past the sinks hits
    return torch.zeros(shape, device=device), torch.zeros(shape, device=device)


def n_sink(store: KVStore) -> int:
    """Positions [0, n_sink) a quantized store also keeps exactly (0: none)."""
    sink = getattr(store, "k_sink", None)
    return 0 if sink is None else sink.shape[1] - 1


def groups(store: KVStore) -> tuple[int, int]:
    """(K group, V group) of a quantized store."""
    return (store.group if store.k_group is None else store.k_group), store.group


def _bytes_per_token(store: KVStore) -> int:
    """Per-position bytes (the fixed sink rows are not per position)."""
    fixed = {id(getattr(store, "k_sink", None)), id(getattr(store, "v_sink", None))}
    return sum(t[:, 0].numel() * t.element_size() for t in store if isinstance(t, torch.Tensor) and id(t) not in fixed)


def head_dim_of(store: KVStore) -> int:
    return store.k.shape[-1] * (2 if isinstance(store, Int4KV) else 1)


def triton_supports(store: KVStore, head_dim: int) -> bool:
    """Head dims the Triton kernel compiles for: a power of two whose dot products have K ≥ 16 (an int4
    cache splits the head dim into two nibble planes of head_dim / 2)."""
    min_d = 32 if isinstance(store, Int4KV) else 16
    return head_dim >= min_d and head_dim & (head_dim - 1) == 0


def check_attention_args(q: torch.Tensor, store: KVStore, kv_len: int) -> int:
    """The query heads group over the store's KV heads and kv_len lies in the cache; → the KV head count."""
    n_q_heads, n_kv = q.shape[1], store.k.shape[0]
    if n_q_heads % n_kv:
        raise ValueError(f"{n_q_heads} query heads do not group over {n_kv} KV heads")
    if not 0 < kv_len <= store.k.shape[1]:
        raise ValueError(f"kv_len {kv_len} outside the cache (1..{store.k.shape[1]})")
    return n_kv
