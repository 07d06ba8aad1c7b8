"""The fused CPU decode step: one C++ call per token (kernels/cpu_decode.cpp) instead of the model's eager graph.

At SmolLM2-135M's size the eager decode step is dominated by per-op overhead, not arithmetic: ~60 torch ops
per layer at 4-8 µs each from Python (on the 2-core machine class we measure on) cost more than the layer's
matmuls. `fused_decode_step(model, cache)` returns a callable `step(token, pos) -> logits [vocab]` that runs
the same graph as `edgellm.model.Transformer.forward` for one token in C++ (same int4/int8 kernels, fp32
everything else), or None where it does not apply; the caller then uses the model as usual.

Applies to: a float32 model on the CPU, a float32 or int8 / int4 KV cache (fp16 scales), every linear an `nn.Linear` (fp32), a
`QuantLinear` (int4 / int8, groups of a multiple of 32) or a module with `gguf_parts` (GGUF blocks multiplied in
place: parts with `raw` uint8, `type`, `rows`, `out_index` int32 or None), the embedding an `nn.Embedding` (fp32), a
`QuantEmbedding` or a module with `gguf_parts` (rows in order, no out_index); every family edgellm.config describes
(the plan's `family` extras: q/k norms, Gemma's post norms, GeGLU, embedding scale, soft caps, per-layer windows and
RoPE tables, partial rotary). Where it does not apply, `fused_decode_step` raises `NotFused` with the reason (the
engine shows it: edgellm/decode_step.py's DecodePath).

The returned logits tensor is reused: it is valid until the next call. The plan holds references to the
model's and cache's tensors; build a new one after replacing either (Engine keys it on the cache object).
Duck-typed on attribute names, so this module imports nothing else of edgellm (kernels/ depends on nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import matmul as K


class NotFused(Exception):
    """Why the fused step does not serve this model and cache (the caller runs the eager model instead)."""


@dataclass(frozen=True)
class DecodeTuning:
    """A/B switches of the fused step's attention (the same results, other speed; benchmarks/kv_step_split.py):
    attention_rows: a T-token pass over an fp32 cache runs every token's tiles in one parallel region (False: one
    token at a time); int_attention: an int8/int4 cache on an AVX-512 VNNI build scores with integer dots and
    dequantizes values in registers (False: the AVX2 tiles)."""

    attention_rows: bool = True
    int_attention: bool = True


def _linear_spec(mod) -> tuple | None:
    bias = getattr(mod, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return None
    bias = None if bias is None else bias.contiguous()
    parts = getattr(mod, "gguf_parts", None)
    if parts is not None:  # GGUFLinear / GGUF embedding: raw blocks read in place (kernels/cpu_gguf.cpp)
        if any(p.raw.device.type != "cpu" for p in parts):
            return None
        return (1, 0, [(p.raw, int(p.type), int(p.rows), p.out_index) for p in parts], None, None, bias)
    if hasattr(mod, "codes"):  # QuantLinear / QuantEmbedding
        if mod.codes.device.type != "cpu" or mod.group_size % 32 or mod.in_features % 32:
            return None
        return (mod.bits, mod.group_size, mod.codes.contiguous(), mod.scales.contiguous(),
                None if mod.mins is None else mod.mins.contiguous(), bias)
    w = getattr(mod, "weight", None)
    if w is None or w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        return None
    return (0, 0, w.detach().contiguous(), None, None, bias)


def _rope_table(t: torch.Tensor, S: int) -> torch.Tensor:
    """A RoPE table [T, 1, R] as the plan reads it: [S, R] fp32, padded past T (the C++ side indexes the tables up
    to the cache length; positions past the model's context are never read)."""
    t = t.reshape(t.shape[0], -1).contiguous()
    if t.shape[0] < S:
        t = torch.cat((t, torch.zeros(S - t.shape[0], t.shape[1])))
    return t


def _family(model, S: int) -> tuple | None:
    """The family extras of the plan (cpu_bindings.cpp's DecodePlan `family`), or None for Llama's graph."""
    cfg = model.config
    if not (cfg.qk_norm or cfg.post_norms or cfg.hidden_act != "silu" or cfg.embed_scale != 1.0 or cfg.attn_softcap
            or cfg.final_softcap or any(cfg.layer_windows) or cfg.rotary_dim != cfg.head_dim):
        return None
    if cfg.hidden_act not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation {cfg.hidden_act}")
    local = hasattr(model, "rope_cos_local")
    layers = []
    for blk in model.layers:
        a = blk.attention
        norms = [getattr(a, "q_norm", None), getattr(a, "k_norm", None), getattr(blk, "post_attention_norm", None),
                 getattr(blk, "post_ffn_norm", None)]
        if any(n is not None and n.eps != model.norm.eps for n in norms):
            raise ValueError("norms with other epsilons")
        layers.append((*[None if n is None else n.weight.detach().contiguous() for n in norms], int(a.window),
                       bool(a.local_rope)))
    return (cfg.rotary_dim, 1 if cfg.hidden_act == "gelu_tanh" else 0, float(cfg.embed_scale), float(cfg.attn_softcap),
            float(cfg.final_softcap), _rope_table(model.rope_cos_local, S) if local else None,
            _rope_table(model.rope_sin_local, S) if local else None, layers)


class FusedDecodeStep:
    """`step(token [1, 1] int64, pos) -> logits [vocab]`; sets `cache.length = pos + 1` like the model."""

    def __init__(self, plan, cache, vocab: int, limit: int, variant: int = 0):
        self.plan = plan
        self.variant = variant  # the int kernels' activations (kernels/matmul.py ACTIVATIONS)
        self.cache = cache
        self.limit = limit  # positions the rope table and the cache both hold
        self.logits = torch.empty(vocab, dtype=torch.float32)
        self.max_rows = type(plan).max_rows  # tokens per `many` call
        self.rows = torch.empty(0, vocab, dtype=torch.float32)  # `many`'s logits, grown on first use

    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self.plan.step(token, pos, self.logits, self.variant)
        self.cache.length = pos + 1
        return self.logits

    def many(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [T, vocab] of T ≤ `max_rows` tokens at positions [pos, pos + T), causal, each row bit for bit
        what `__call__` gives that token at its position: speculative verification stays exact. Sets
        cache.length = pos + T; valid until the next call."""
        T = tokens.numel()
        if self.rows.shape[0] < T:
            self.rows = torch.empty(T, self.logits.numel(), dtype=torch.float32)
        self.plan.step_many(tokens.reshape(-1).contiguous(), pos, self.rows, self.variant)
        self.cache.length = pos + T
        return self.rows[:T]

    def prefill(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """`many` for a short prompt: the last token's logits [vocab] alone (the LM head over one row); sets
        cache.length = pos + T; valid until the next call."""
        self.plan.step_many(tokens.reshape(-1).contiguous(), pos, self.logits, self.variant, True)
        self.cache.length = pos + tokens.numel()
        return self.logits


def fused_decode_step(model, cache, kernel: K.KernelOptions = K.DEFAULT_OPTIONS,
                      tuning: DecodeTuning = DecodeTuning()) -> FusedDecodeStep:
    """The fused step for this model and cache (the int kernels' activations from `kernel`), or NotFused naming
    why it does not apply (see the module docstring)."""
    ext = K.cpu_extension()
    if ext is None or not hasattr(ext, "DecodePlan"):
        raise NotFused("the C++ CPU extension is off or did not build")
    cfg = model.config
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise NotFused(f"the model runs in {str(model.dtype).replace('torch.', '')} on {model.device.type} "
                       "(the fused step takes fp32 on the CPU)")
    try:
        kv = cache.decode_spec()  # per layer (K, V) as the plan takes them (edgellm/cache.py), or None
        if kv is None:
            raise NotFused(f"the KV cache's layout ({cache.kind}) is not one the fused step reads")
        rot = cache.rotation  # a quantized cache's [D, D] fp32 rotation (checked by decode_spec), None for floats
        emb = model.tok_embeddings
        if hasattr(emb, "codes") and emb.dtype != torch.float32:
            raise NotFused("the quantized embedding is not fp32")
        emb_spec = _linear_spec(emb)
        out_spec = _linear_spec(model.output)
        layers = []
        for i, blk in enumerate(model.layers):
            a, f = blk.attention, blk.feed_forward
            specs = [_linear_spec(m) for m in (a.wqkv, a.wo, f.w13, f.w2)]
            if any(s is None for s in specs):
                raise NotFused(f"layer {i}: a linear whose weight format the fused step does not read")
            layers.append((*specs, blk.attention_norm.weight.detach().contiguous(),
                           blk.ffn_norm.weight.detach().contiguous(), *kv[i]))
        if emb_spec is None or out_spec is None:
            raise NotFused("the embedding or LM head's weight format is not one the fused step reads")
        if len(layers) != cfg.n_layers:
            raise NotFused(f"{len(layers)} layers where the config says {cfg.n_layers}")
        eps = {blk.attention_norm.eps for blk in model.layers} | {blk.ffn_norm.eps for blk in model.layers}
        if len(eps) != 1 or model.norm.eps not in eps:
            raise NotFused("norms with different epsilons")
        S, D = cache.max_seq_len, cfg.head_dim
        cos, sin = _rope_table(model.rope_cos, S), _rope_table(model.rope_sin_signed, S)
        limit = min(S, model.rope_len)
        dims = [cfg.dim, cfg.n_heads, cfg.n_kv_heads, D, cfg.intermediate_size, cfg.vocab_size, S]
        if rot is not None:
            cache.prepare(model)  # its calibration, before the first write (edgellm/kv_calibration.py)
        centers = getattr(cache, "centers", None)
        key_scales = getattr(cache, "key_scales", None)
        plan = ext.DecodePlan(dims, float(model.norm.eps), float(model.layers[0].attention.scale), emb_spec, layers,
                              model.norm.weight.detach().contiguous(), out_spec, cos, sin,
                              None if rot is None else rot.contiguous(),
                              None if centers is None else centers.reshape(cfg.n_layers, 2, -1).contiguous(),
                              None if key_scales is None else key_scales.reshape(cfg.n_layers, -1).contiguous(),
                              _family(model, S))
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        # a model this plan does not describe (the C++ checks name the part): the eager path serves it
        first = (str(e).strip().splitlines() or [""])[0]
        raise NotFused(f"{type(e).__name__}: {first[:200]}") from e
    if hasattr(plan, "int_attention"):
        plan.attention_rows, plan.int_attention = tuning.attention_rows, tuning.int_attention
    return FusedDecodeStep(plan, cache, cfg.vocab_size, limit, kernel.variant)
