"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM2, TinyLlama) in one module.

One graph with config flags: RMSNorm, RoPE (plain, linear, llama3, yarn), grouped-query attention,
SwiGLU. Q/K/V are one fused projection and gate/up another, so a layer costs 4 matrix products,
not 7. The KV cache is passed in (see cache.py); attention reads it through the cache's storage.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, rope_inv_freq
from .errors import ContextOverflowError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, H, T, D]; cos/sin [T, D]. Rotate-half layout (HF); GGUF's interleaved Q/K rows are
    un-permuted at load so one layout serves every source."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.wqkv = nn.Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.dim, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, cache, start_pos: int) -> torch.Tensor:
        T = x.shape[1]
        qkv = self.wqkv(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(1, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        cache.write(self.layer_id, k[0], v[0], start_pos)
        out = cache.attend(self.layer_id, q, start_pos, self.scale)
        return self.wo(out.transpose(1, 2).reshape(1, T, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, cache, start_pos: int) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope_len = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def setup_rope(self, max_seq_len: int) -> None:
        """Precompute cos/sin for positions [0, max_seq_len) once: the decode step only slices."""
        inv_freq, mscale = rope_inv_freq(self.config)
        pos = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.outer(pos, inv_freq).float()
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.dtype if self.dtype != torch.float64 else torch.float64
        self.register_buffer("rope_cos", (emb.cos() * mscale).to(self.device, dtype), persistent=False)
        self.register_buffer("rope_sin", (emb.sin() * mscale).to(self.device, dtype), persistent=False)
        self.rope_len = max_seq_len

    def forward(self, tokens: torch.Tensor, cache, start_pos: int, all_logits: bool = False) -> torch.Tensor:
        """tokens [1, T] → logits [1, T or 1, vocab] (fp32). Writes K/V of the T tokens into `cache`
        at positions [start_pos, start_pos+T) and sets cache.length to start_pos+T."""
        T = tokens.shape[1]
        end = start_pos + T
        if end > cache.max_seq_len or end > self.rope_len:
            raise ContextOverflowError(
                f"{end} tokens do not fit the context of {min(cache.max_seq_len, self.rope_len)} tokens")
        cos, sin = self.rope_cos[start_pos:end], self.rope_sin[start_pos:end]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, cache, start_pos)
        cache.length = end
        if not all_logits:
            h = h[:, -1:]
        return self.output(self.norm(h)).float()
