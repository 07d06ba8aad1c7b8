"""ModelConfig: the shape of a decoder-only transformer (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3), read from a HF
config.json or GGUF metadata. The families differ by small switches (see the fields below), not by graphs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

import torch

from .errors import ModelFormatError, UnsupportedModelError

MAX_LAYERS = 1 << 16  # far past any model; checked before a per-layer list is built from a file's count

# HF architecture name -> our family flag. Mistral and Llama share one graph; Qwen2 adds q/k/v biases, Qwen3 q/k
# norms; Gemma 2/3 add norms after attention and MLP, GeGLU, (1 + w) norms, soft-capping and sliding-window layers;
# Phi-3 stores Q/K/V and gate/up fused and scales RoPE with LongRoPE factors.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # the 4B+ checkpoints: their text tower (language_model.*)
    "Phi3ForCausalLM": "phi3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3"}
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3": "gemma3", "phi3": "phi3"}
GEMMA = ("gemma2", "gemma3")
# Every `sliding_window_pattern`-th layer attends to the whole context, the others to a window (the default of
# configs written before `layer_types`, and of GGUF files, which do not store the pattern)
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 | phi3
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    sliding_window: int | None = None  # Mistral v0.1; contexts beyond it are refused, not approximated
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before the residual add (Gemma 2/3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(dim))
    query_scale: float = 0.0  # attention scale query_scale ** -0.5 (Gemma's query_pre_attn_scalar); 0: head_dim
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the softmax (Gemma 2); 0: off
    final_softcap: float = 0.0  # the same on the logits (Gemma 2); 0: off
    layer_windows: list[int] = field(default_factory=list)  # per layer: W > 0 attends to the last W positions
    rope_local_theta: float = 0.0  # RoPE base of the sliding-window layers, unscaled (Gemma 3); 0: the global one
    rotary_dim: int = 0  # RoPE on the first rotary_dim dims of each head (Phi-4-mini); 0: the whole head
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} KV heads")
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise UnsupportedModelError(f"RoPE over {self.rotary_dim} of {self.head_dim} head dims is not supported")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"activation {self.hidden_act!r} is not supported (silu, gelu_tanh)")
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise UnsupportedModelError(f"{len(self.layer_windows)} layer windows for {self.n_layers} layers")

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (positions it attends to, its own included), or 0: all of them."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` uses the sliding-window layers' own RoPE table (Gemma 3)."""
        return bool(self.rope_local_theta) and self.window(layer) > 0

    @property
    def attn_scale(self) -> float:
        return (self.query_scale or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        per_layer = (self.dim * (self.q_size + 2 * self.kv_size) + self.q_size * self.dim
                     + 3 * self.dim * self.intermediate_size + (4 if self.post_norms else 2) * self.dim
                     + (2 * self.head_dim if self.qk_norm else 0))
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + embed + head + self.dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = MODEL_TYPES.get(hf.get("model_type"))
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: architecture {archs or hf.get('model_type')} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if isinstance(hf.get("text_config"), dict):  # a multimodal checkpoint (Gemma 3 4B+): its language model
            hf = {**hf["text_config"], "architectures": archs}
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError(f"{source}: bidirectional attention (an embedding model) is not supported")
        n_heads = hf["num_attention_heads"]
        n_layers = layer_count(hf["num_hidden_layers"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
        rope = _hf_rope(hf, arch)
        family: dict[str, Any] = {}
        if arch in GEMMA:
            family = dict(post_norms=True, embed_scale=math.sqrt(hf["hidden_size"]),
                          query_scale=float(hf.get("query_pre_attn_scalar") or head_dim),
                          attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
                          final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
                          layer_windows=_hf_layer_windows(hf, arch, n_layers), qk_norm=arch == "gemma3")
            if arch == "gemma3":
                family["rope_local_theta"] = rope.pop("local_theta")
        elif arch == "qwen3":
            family = dict(qk_norm=True)
        elif arch == "phi3" and hf.get("sliding_window") and hf["sliding_window"] < hf.get("max_position_embeddings", 4096):
            family = dict(layer_windows=[int(hf["sliding_window"])] * n_layers)  # every layer, as transformers' Phi3
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        family["hidden_act"] = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act, act)
        if family["hidden_act"] == "gelu":  # Gemma 1 configs say "gelu" and mean the tanh approximation
            family["hidden_act"] = "gelu_tanh" if arch in GEMMA else "gelu"
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            intermediate_size=hf["intermediate_size"],
            head_dim=head_dim,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope["theta"],
            rope_scaling=rope["scaling"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            sliding_window=sliding if arch in ("llama", "mistral", "qwen2") else None,
            rotary_dim=int(head_dim * rope["partial"]) // 2 * 2,
            **family,
        )


def layer_count(value: Any) -> int:
    """A file's layer count, refused before anything is sized by it."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LAYERS:
        raise ModelFormatError(f"model n_layers = {value!r} is out of range (1 to {MAX_LAYERS})")
    return value


def _hf_layer_windows(hf: dict[str, Any], arch: str, n_layers: int) -> list[int]:
    window = int(hf.get("sliding_window") or 0)
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern") or SLIDING_PATTERN[arch])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"config.json: layer_types {types} are not supported")
    return [window if t == "sliding_attention" else 0 for t in types]


def _hf_rope(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """theta, scaling, partial (rotary fraction) and, for Gemma 3, local_theta, from either config layout:
    rope_theta / rope_scaling / partial_rotary_factor / rope_local_base_freq at the top level (configs on the
    hub), or transformers 5's rope_parameters (per layer type for Gemma 3)."""
    params = hf.get("rope_parameters") or {}
    local = None
    if arch == "gemma3":
        if "full_attention" in params or "sliding_attention" in params:
            local = float((params.get("sliding_attention") or {}).get("rope_theta", 10000.0))
            params = params.get("full_attention") or {}
        else:
            local = float(hf.get("rope_local_base_freq", 10000.0))
    theta = hf.get("rope_theta") or params.get("rope_theta") or (1e6 if arch == "gemma3" else 10000.0)
    scaling_src = hf.get("rope_scaling") or params
    partial = float(hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    scaling = _hf_rope_scaling(scaling_src, hf)
    if scaling and scaling["rope_type"] == "linear" and float(scaling.get("factor", 1.0)) == 1.0:
        scaling = None
    out = {"theta": float(theta), "scaling": scaling, "partial": partial}
    if local is not None:
        out["local_theta"] = local
    return out


def _hf_rope_scaling(scaling: dict[str, Any] | None, hf: dict[str, Any]) -> dict[str, Any] | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind == "su":  # Phi-3's first name for LongRoPE
        kind = "longrope"
    if kind not in ("llama3", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"config.json: rope scaling type {kind!r} is not supported")
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    out["rope_type"] = kind
    if kind == "longrope":
        original = out.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
        if not original or "long_factor" not in out or "short_factor" not in out:
            raise UnsupportedModelError("config.json: LongRoPE needs short_factor, long_factor and "
                                        "original_max_position_embeddings")
        out["original_max_position_embeddings"] = int(original)
    return out


def rope_inv_freq(cfg: ModelConfig, ctx: int | None = None, local: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) over the rotary dims and the factor cos/sin are scaled by (1.0 unless yarn
    or LongRoPE). `ctx`: the context the tables serve (LongRoPE takes its long factors beyond the original
    context, for every position, as llama.cpp does for a context that large); `local`: the sliding-window
    layers' table (Gemma 3: its own base, never scaled)."""
    dim = cfg.rotary_dim or cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if local and cfg.rope_local_theta:
        return inv, 1.0
    if cfg.extra.get("rope_freqs"):  # GGUF stores llama3 scaling as per-frequency divisors
        inv = inv / torch.tensor(cfg.extra["rope_freqs"], dtype=torch.float64)
    sc = cfg.rope_scaling
    if not sc:
        return inv, 1.0
    kind = sc["rope_type"]
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "longrope":  # Phi-3.5 / Phi-4-mini (transformers' _compute_longrope_parameters)
        old_ctx = int(sc["original_max_position_embeddings"])
        factor = float(sc.get("factor") or cfg.max_position_embeddings / old_ctx)
        mscale = sc.get("attention_factor")
        if mscale is None:
            mscale = math.sqrt(1 + math.log(factor) / math.log(old_ctx)) if factor > 1.0 else 1.0
        long = ctx is not None and ctx > old_ctx
        ext = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float64)
        if ext.numel() != inv.numel():
            raise UnsupportedModelError(f"LongRoPE: {ext.numel()} factors for {inv.numel()} frequencies")
        return inv / ext, float(mscale)
    if kind == "llama3":
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled), 1.0
    # yarn (Peng et al. 2023), as in HF's _compute_yarn_parameters
    old_ctx = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings / factor)
    beta_fast = float(sc.get("beta_fast", 32.0))
    beta_slow = float(sc.get("beta_slow", 1.0))
    mscale = sc.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv, float(mscale)
