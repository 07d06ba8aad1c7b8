"""Write a Hugging Face folder with seeded random weights in a real model's shape, for speed runs where
the real weights cannot travel (the GPU machine). The tokenizer is the bundled SmolLM2 one.

    python benchmarks/random_model.py OUT [--shape smollm2-135m|llama-3.2-1b|llama-3.2-3b|qwen2.5-0.5b] [--dtype bf16]

Speed depends on shapes only; quality figures from such a model mean nothing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {  # vocab kept at the bundled tokenizer's 49152 so every id decodes
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    # Qwen2.5-0.5B's matrices (no q/k/v biases: the Llama architecture): 896 = 3.5 x 256, so a Q4_K_M file falls
    # back to legacy types for the rows along it, as real 0.5B files do
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a folder with tokenizer.json (default: the bundled GGUF's tokenizer)")
    args = ap.parse_args()

    shape = SHAPES[args.shape]
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, rms_norm_eps=1e-5,
               max_position_embeddings=8192, hidden_act="silu", bos_token_id=1, eos_token_id=2,
               torch_dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype], **shape)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    d, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = d // shape["num_attention_heads"]
    kv = hd * shape["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)

    def rnd(*s):
        return (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(dtype)

    w = {"model.embed_tokens.weight": rnd(49152, d), "model.norm.weight": torch.ones(d, dtype=dtype)}
    for i in range(L):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(d, d), p + "self_attn.k_proj.weight": rnd(kv, d),
              p + "self_attn.v_proj.weight": rnd(kv, d), p + "self_attn.o_proj.weight": rnd(d, d),
              p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
              p + "mlp.down_proj.weight": rnd(d, f), p + "input_layernorm.weight": torch.ones(d, dtype=dtype),
              p + "post_attention_layernorm.weight": torch.ones(d, dtype=dtype)}
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    if args.tokenizer is not None:
        from edgellm.tokenizer import tokenizer_from_folder

        tok = tokenizer_from_folder(args.tokenizer)
    else:
        from edgellm.loading import bundled_model_path, open_source
        from edgellm.tokenizer import load_tokenizer

        tok = load_tokenizer(open_source(bundled_model_path())[0])
    tok.backend.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "eos_token": tok.eos_token, "bos_token": tok.bos_token}))
    print(f"wrote {args.out} ({sum(t.numel() for t in w.values()) / 1e6:.0f} M parameters, {args.shape})")


if __name__ == "__main__":
    main()
