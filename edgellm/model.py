"""The decoder-only transformer of every family we load (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/3.5/4-mini,
SmolLM2, TinyLlama) in one module.

One graph with config flags: RMSNorm, RoPE (plain, linear, llama3, yarn, LongRoPE; partial rotary), grouped-query
attention, SwiGLU or GeGLU. Q/K/V are one fused projection and gate/up another, so a layer costs 4 matrix
products, not 7. The family switches (config.py): q/k norms per head (Qwen3, Gemma 3), norms after attention
and MLP, embeddings times sqrt(dim), soft-capped scores and logits, sliding-window layers with their own RoPE
table (Gemma). Gemma's (1 + w) norms are plain norms here: the + 1 is folded into the weights at load, as
llama.cpp's converter stores them. The KV cache is passed in (see cache.py); attention reads it through the
cache's storage.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import DevicePosition
from .config import ModelConfig, rope_inv_freq
from .errors import ContextOverflowError
from .kernels import pointwise

# A forward that returns only the last position's logits (a prompt) runs the last layer's attention output,
# MLP and residual for that position alone: the other positions need only their K/V there. False: every row
# through every layer (benchmarks' A/B switch).
SKIP_UNUSED_ROWS = True


class Linear(nn.Linear):
    """nn.Linear, except that on the meta device (the loader's skeleton, whose every weight it assigns) the random
    init is skipped: there it runs through torch's Python decompositions, ~1 ms a linear (0.12 s of loading a
    30-layer model)."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = pointwise.rms_norm(x, self.weight, self.eps)  # fp32 on the CPU: one C++ pass
        if fused is not None:
            return fused
        # Normalise in fp32 whatever the compute dtype, as the reference implementation does. (F.rms_norm
        # measured 2.5x slower than these four ops on CPU in torch 2.13: it decomposes.)
        x32 = x.float()
        inv = x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * (x32 * inv).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos [T, 1, R]; sin [T, 1, R] with its first half negated. Rotate-half layout
    (HF): x·cos + (-x2, x1)·sin = x·cos + (x2, x1)·sin', one cat and three arithmetic ops. GGUF's
    interleaved Q/K rows are un-permuted at load so one layout serves every source. R < D (partial
    rotary, Phi-4-mini): the first R dims rotate, the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.wqkv = Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.wo = Linear(cfg.q_size, cfg.dim, bias=False)
        self.scale = cfg.attn_scale
        self.window, self.softcap = cfg.window(layer_id), cfg.attn_softcap
        self.local_rope = cfg.local_rope(layer_id)  # the sliding layers' own RoPE table (Gemma 3)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, cache, start_pos: int, keep: int | None = None) -> torch.Tensor | None:
        """x [1, T, dim] → the attention output [1, T, dim]; K/V of the T rows written into `cache`. keep: only the
        last `keep` rows' output (0: none, None: all)."""
        T = x.shape[1]
        qkv = self.wqkv(x)
        qk = qkv[0, :, :self.q_size + self.kv_size].view(T, self.n_heads + self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # per head, before RoPE (Qwen3, Gemma 3)
            qk = torch.cat((self.q_norm(qk[:, :self.n_heads]), self.k_norm(qk[:, self.n_heads:])), dim=1)
        # RoPE on the Q and K heads together, in the projection's [T, heads, D] layout
        qk = apply_rope(qk, cos, sin)
        q = qk[:, :self.n_heads].transpose(0, 1)[None]  # [1, Hq, T, D]
        k = qk[:, self.n_heads:].transpose(0, 1)  # [Hkv, T, D]
        v = qkv[0, :, self.q_size + self.kv_size:].view(T, self.n_kv_heads, self.head_dim).transpose(0, 1)
        cache.write(self.layer_id, k, v, start_pos)
        if keep == 0:
            return None
        if keep is not None and keep < T:  # the last rows' queries, at their positions, against the whole cache
            q, start_pos, T = q[:, :, T - keep:], start_pos + T - keep, keep
        if self.window or self.softcap:
            out = cache.attend(self.layer_id, q, start_pos, self.scale, window=self.window, softcap=self.softcap)
        else:
            out = cache.attend(self.layer_id, q, start_pos, self.scale)
        return self.wo(out.transpose(1, 2).reshape(1, T, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden = cfg.intermediate_size
        self.w13 = Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13(x)
        fused = pointwise.gated_activation(gate_up, self.gelu)  # fp32 on the CPU: one C++ pass
        if fused is not None:
            return self.w2(fused)
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.w2((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        if cfg.post_norms:  # Gemma 2/3: the outputs normalised too, before the residual add
            self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, cache, start_pos: int, keep: int | None = None) -> torch.Tensor | None:
        """x [1, T, dim] → [1, T, dim]; keep: only the last `keep` rows (0: K/V written, nothing returned)."""
        if self.attention.local_rope:
            cos, sin = cos[1], sin[1]
        elif isinstance(cos, tuple):
            cos, sin = cos[0], sin[0]
        a = self.attention(self.attention_norm(x), cos, sin, cache, start_pos, keep)
        if a is None:
            return None
        x = x[:, x.shape[1] - a.shape[1]:]
        if hasattr(self, "post_attention_norm"):
            h = x + self.post_attention_norm(a)
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # an explicit (empty) table: nn.Embedding's own normal_ init on the meta device imports ~900 torch modules (+160 MB)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = Linear(cfg.dim, cfg.vocab_size, bias=False)
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
        """Precompute cos/sin for positions [0, max_seq_len) once: the decode step only slices. Gemma 3's
        sliding-window layers get a second table (rope_cos_local / rope_sin_local)."""
        dtype = self.dtype if self.dtype != torch.float64 else torch.float64
        cos, sin = rope_tables(self.config, max_seq_len)
        self.register_buffer("rope_cos", cos.to(self.device, dtype), persistent=False)
        self.register_buffer("rope_sin_signed", sin.to(self.device, dtype), persistent=False)
        if self.config.rope_local_theta and any(self.config.layer_windows):
            cos, sin = rope_tables(self.config, max_seq_len, local=True)
            self.register_buffer("rope_cos_local", cos.to(self.device, dtype), persistent=False)
            self.register_buffer("rope_sin_local", sin.to(self.device, dtype), persistent=False)
        self.rope_len = max_seq_len

    def forward(self, tokens: torch.Tensor, cache, start_pos: int | DevicePosition,
                all_logits: bool = False, logits: bool = True) -> torch.Tensor | None:
        """tokens [1, T] → logits [1, T or 1, vocab] (fp32). Writes K/V of the T tokens into `cache`
        at positions [start_pos, start_pos+T) and sets cache.length to start_pos+T. all_logits=False: only
        the last position's logits, and the last layer computes only that row past its K/V (SKIP_UNUSED_ROWS);
        logits=False: none (returns None; a prompt chunk before the last, or all rows for a caller that
        records the attention inputs, with all_logits=True).

        A `DevicePosition` start (one token, the position held on the device) is what a CUDA graph
        captures: nothing here reads it on the host, and the caller (decode_step.py) keeps
        cache.length and the bounds."""
        if getattr(cache, "_needs_calibration", False):  # a quantized cache's first use: its calibration (kv_calibration.py)
            cache.prepare(self)
        tables = [(self.rope_cos, self.rope_sin_signed)]
        if hasattr(self, "rope_cos_local"):
            tables.append((self.rope_cos_local, self.rope_sin_local))
        if isinstance(start_pos, DevicePosition):
            start_pos.update()
            rows = [(c.index_select(0, start_pos.pos), s.index_select(0, start_pos.pos)) for c, s in tables]
            end = None
        else:
            end = start_pos + tokens.shape[1]
            if end > cache.max_seq_len or end > self.rope_len:
                raise ContextOverflowError(
                    f"{end} tokens do not fit the context of {min(cache.max_seq_len, self.rope_len)} tokens")
            rows = [(c[start_pos:end], s[start_pos:end]) for c, s in tables]
        cos, sin = rows[0] if len(rows) == 1 else (tuple(r[0] for r in rows), tuple(r[1] for r in rows))
        h = self.tok_embeddings(tokens)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(dim), rounded to the compute dtype as transformers does
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        keep = None if all_logits or not SKIP_UNUSED_ROWS or end is None else int(logits)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, start_pos, keep if i == len(self.layers) - 1 else None)
        if end is not None:
            cache.length = end
        if not logits:
            return None
        if not all_logits:
            h = h[:, -1:]
        out = self.output(self.norm(h)).float()
        if self.config.final_softcap:  # Gemma 2
            cap = self.config.final_softcap
            out = torch.tanh(out / cap) * cap
        return out


def rope_tables(cfg: ModelConfig, max_seq_len: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (first half negated) for positions [0, max_seq_len), fp32 [T, 1, rotary dims]: broadcast over
    heads in apply_rope's [T, H, D] layout."""
    inv_freq, mscale = rope_inv_freq(cfg, max_seq_len, local)
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    half = emb.shape[-1] // 2
    sign = torch.cat((-torch.ones(half), torch.ones(half)))
    return (emb.cos() * mscale)[:, None], (emb.sin() * mscale * sign)[:, None]
