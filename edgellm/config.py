"""ModelConfig: the shape of a Llama-family transformer, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

import torch

from .errors import UnsupportedModelError

# HF architecture name -> our family flag. Mistral and Llama share one graph; Qwen2 adds q/k/v biases.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2
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
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} KV heads")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        per_layer = (self.dim * (self.q_size + 2 * self.kv_size) + self.q_size * self.dim
                     + 3 * self.dim * self.intermediate_size + 2 * self.dim)
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
            model_type = hf.get("model_type")
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: architecture {archs or hf.get('model_type')} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        n_heads = hf["num_attention_heads"]
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            intermediate_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_hf_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            sliding_window=sliding,
        )


def _hf_rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear", "yarn"):
        raise UnsupportedModelError(f"config.json: rope scaling type {kind!r} is not supported")
    out = {k: v for k, v in scaling.items() if k != "rope_theta"}
    out["rope_type"] = kind
    return out


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) and the attention scaling factor (1.0 unless yarn)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.extra.get("rope_freqs"):  # GGUF stores llama3 scaling as per-frequency divisors
        inv = inv / torch.tensor(cfg.extra["rope_freqs"], dtype=torch.float64)
    sc = cfg.rope_scaling
    if not sc:
        return inv, 1.0
    kind = sc["rope_type"]
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
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
