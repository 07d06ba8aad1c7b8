"""The KV cache: static, preallocated at creation, one per model.

`length` is the source of truth for how many positions are valid; `truncate(n)` is O(1) (speculative
rollback, and a chat turn that diverges from the kept prefix). Storage is per layer; attention reads
it in place through edgellm.kernels.attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_format: str = "fp"):
        if kv_format != "fp":
            raise ValueError(f"KV format {kv_format!r} is not available yet")
        self.max_seq_len = max_seq_len
        self.n_layers = cfg.n_layers
        self.kv_format = kv_format
        shape = (cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.length = 0
        self.group = cfg.n_heads // cfg.n_kv_heads

    # -- bookkeeping ---------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    @property
    def bytes_per_token(self) -> int:
        return sum(t[:, 0].nbytes for t in self.k + self.v)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    # -- used by the model ---------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k, v [Hkv, T, D] for positions [start, start+T)."""
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v

    def attend(self, layer: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """q [1, Hq, T, D] at positions [start, start+T), causal against the cache → [1, Hq, T, D]."""
        T = q.shape[2]
        end = start + T
        k = self.k[layer][None, :, :end]
        v = self.v[layer][None, :, :end]
        mask = None
        if T > 1:
            rows = torch.arange(start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= rows
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=self.group > 1)
