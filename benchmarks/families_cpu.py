"""Decode tok/s and TTFT of each model family on the CPU, random weights, side by side in one run.

    python benchmarks/families_cpu.py [--threads 2] [--sizes tiny,1b] [-p 128] [-n 32] [--tiny-tokens 256] [-r 3]
                                      [--out benchmarks/results/families-cpu.json]

Two shapes per family, built in memory through edgellm's own model (speed depends on shapes only; these
weights say nothing of quality):
  tiny: the test fixtures' shapes (tests/fixtures/tiny.py: dim 64, 2-3 layers, vocab 400), fp32, one thread (its
      ops are microseconds: a second thread only adds hand-offs), --tiny-tokens steps: the fixed cost of a step,
      where the families' extra ops (norms, soft caps, GELU) show most;
  1b: a real ~1B model's shape per family (Llama-3.2-1B, Qwen3-0.6B, Gemma-3-1B, Gemma-2-2B; Phi has no ~1B
      model, so Llama-3.2-1B's shape with Phi-4-mini's switches: 3/4 rotary, LongRoPE), vocabularies included,
      as a user runs it: int4 linears (symmetric, groups of 32) and an int8 embedding / LM head, random codes.
TTFT: a prompt of -p random tokens through Engine.prefill on an empty cache (median of r); decode: -n greedy
steps through Engine.step after it (the fused C++ step where it serves: `fused` says), tokens 2..n over their
time, median of r.
--long P: also Gemma-3-1B's shape after a P-token prompt, as it is (25 of 26 layers read a 512-token window of
their full-length cache) and with every layer global: what keeping the whole cache but reading only the window
costs in decode against attending to everything (size "1b-long").
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from edgellm.config import ModelConfig  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
                rope_theta=500000.0, tie_embeddings=True)
ONE_B = {
    "llama": ModelConfig(arch="llama", **LLAMA_1B),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                         head_dim=128, intermediate_size=3072, rope_theta=1e6, tie_embeddings=True, qk_norm=True),
    "gemma3": ModelConfig(arch="gemma3", vocab_size=262144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                          head_dim=256, intermediate_size=6912, rope_theta=1e6, tie_embeddings=True, qk_norm=True,
                          post_norms=True, hidden_act="gelu_tanh", embed_scale=1152 ** 0.5, query_scale=256.0,
                          layer_windows=[0 if (i + 1) % 6 == 0 else 512 for i in range(26)],
                          rope_local_theta=10000.0, norm_eps=1e-6),
    "gemma2": ModelConfig(arch="gemma2", vocab_size=256000, dim=2304, n_layers=26, n_heads=8, n_kv_heads=4,
                          head_dim=256, intermediate_size=9216, tie_embeddings=True, post_norms=True,
                          hidden_act="gelu_tanh", embed_scale=2304 ** 0.5, query_scale=256.0, attn_softcap=50.0,
                          final_softcap=30.0, layer_windows=[4096 if i % 2 == 0 else 0 for i in range(26)],
                          norm_eps=1e-6),
    "phi3": ModelConfig(arch="phi3", **LLAMA_1B, rotary_dim=48, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                      "short_factor": [1.0] * 24, "long_factor": [1.0 + i for i in range(24)]}),
}
ONE_B_NAMES = {"llama": "Llama-3.2-1B", "qwen3": "Qwen3-0.6B", "gemma3": "Gemma-3-1B", "gemma2": "Gemma-2-2B",
               "phi3": "Llama-3.2-1B shape, Phi-4-mini switches"}
TINY = {"llama": "llama_gqa", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi4_partial"}


def tiny_config(variant: str) -> ModelConfig:
    """The test fixture's config, read as the loader reads it (no weights written)."""
    import transformers

    from tests.fixtures.tiny import CONFIG_CLASSES, hf_config

    d = hf_config(variant, 400)
    arch = d["architectures"][0]
    cls = getattr(transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config")))
    hf = cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")}).to_dict()
    return ModelConfig.from_hf({**hf, "architectures": [arch]})


def random_codes(n: int, k: int, bits: int, g: torch.Generator):
    """A QuantizedTensor [n, k] of random codes and scales (groups of 32, symmetric): what a quantized weight of
    this shape costs to read, made without a float copy to quantize (speed depends on shapes only)."""
    from edgellm.quant.groups import QuantizedTensor

    codes = torch.randint(0, 256, (n, k // 2 if bits == 4 else k), dtype=torch.uint8, generator=g)
    scale = (k ** -0.5 / (4 if bits == 4 else 64))
    scales = (torch.rand(n, k // 32, generator=g) * scale + scale / 2).half()
    return QuantizedTensor(bits, 32, True, (n, k), codes if bits == 4 else codes.view(torch.int8), scales)


def build(cfg: ModelConfig, quantized: bool, ctx: int):
    """A model of this shape with seeded random weights (std 1/sqrt(fan-in)); quantized: int4 g32 linears and an
    int8 embedding of random codes."""
    from torch import nn

    from edgellm.model import Transformer
    from edgellm.quant.linear import QuantEmbedding, QuantLinear

    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    for name, mod in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(mod, nn.Linear) and not (name == "output" and cfg.tie_embeddings):
            if quantized:
                setattr(parent, attr, QuantLinear.from_quantized(random_codes(mod.out_features, mod.in_features, 4, g)))
            else:
                w = torch.randn(mod.out_features, mod.in_features, generator=g) * mod.in_features ** -0.5
                mod.weight = nn.Parameter(w, requires_grad=False)
        elif isinstance(mod, nn.Embedding):
            if quantized:
                setattr(parent, attr, QuantEmbedding.from_quantized(random_codes(mod.num_embeddings, mod.embedding_dim, 8, g)))
            else:
                w = torch.randn(mod.num_embeddings, mod.embedding_dim, generator=g)
                mod.weight = nn.Parameter(w, requires_grad=False)
        elif hasattr(mod, "weight") and mod.weight.is_meta:  # a norm
            mod.weight = nn.Parameter(torch.ones(mod.weight.shape), requires_grad=False)
    if cfg.tie_embeddings:
        if quantized:
            model.output = QuantLinear.from_quantized(model.tok_embeddings.qtensor())
        else:
            model.output.weight = model.tok_embeddings.weight
    model.eval().requires_grad_(False)
    model.setup_rope(ctx)
    return model


def measure(model, prompt_len: int, n: int, reps: int) -> dict:
    from edgellm.generate import Engine
    from edgellm.tokenizer import Tokenizer

    engine = Engine(model, Tokenizer(None, None, set()), prompt_len + n + 8)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    ttfts, rates = [], []
    with torch.inference_mode():
        for _ in range(reps):
            engine.reset()
            t0 = time.perf_counter()
            logits = engine.prefill(prompt)
            ttfts.append(time.perf_counter() - t0)
            tok = torch.tensor([[int(logits.argmax())]])
            stamps = []
            for _ in range(n):
                tok[0, 0] = int(engine.step(tok).argmax())
                stamps.append(time.perf_counter())
            rates.append((n - 1) / (stamps[-1] - stamps[0]))
    return {"ttft_s": round(statistics.median(ttfts), 5), "decode_tok_s": round(statistics.median(rates), 2),
            "fused": engine.compiled_step() is not None,
            "load_avg_1m": round(os.getloadavg()[0], 2)}  # (a shared machine: other tenants' load, as measured)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="tiny,1b")
    ap.add_argument("--families", default=",".join(ONE_B))
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("--tiny-tokens", type=int, default=256)
    ap.add_argument("--long", type=int, default=0, help="prompt tokens of the window comparison (0: none)")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/families-cpu.json"))
    args = ap.parse_args()
    from benchmarks.run_record import write_run

    rows = []
    for size in [s for s in args.sizes.split(",") if s]:
        for fam in args.families.split(","):
            tiny = size == "tiny"
            torch.set_num_threads(1 if tiny else args.threads)
            n = args.tiny_tokens if tiny else args.tokens
            cfg = tiny_config(TINY[fam]) if tiny else ONE_B[fam]
            model = build(cfg, quantized=not tiny, ctx=args.prompt + n + 8)
            params = cfg.num_parameters()
            row = {"size": size, "family": fam, "shape": TINY[fam] if size == "tiny" else ONE_B_NAMES[fam],
                   "weights": "fp32" if size == "tiny" else "int4 g32 + int8 embedding",
                   "params_m": round(params / 1e6, 1), "threads": torch.get_num_threads(),
                   "prompt_tokens": args.prompt, "decode_tokens": n, **measure(model, args.prompt, n, args.reps)}
            print(row, flush=True)
            rows.append(row)
            del model
            gc.collect()
    if args.long:
        torch.set_num_threads(args.threads)
        g3 = ONE_B["gemma3"]
        for name, cfg in (("gemma3", g3), ("gemma3 all-global", dataclasses.replace(g3, layer_windows=[0] * 26))):
            model = build(cfg, quantized=True, ctx=args.long + args.tokens + 8)
            row = {"size": "1b-long", "family": name, "shape": ONE_B_NAMES["gemma3"],
                   "weights": "int4 g32 + int8 embedding", "params_m": round(cfg.num_parameters() / 1e6, 1),
                   "threads": args.threads, "prompt_tokens": args.long, "decode_tokens": args.tokens,
                   **measure(model, args.long, args.tokens, 1)}
            print(row, flush=True)
            rows.append(row)
            del model
            gc.collect()
    write_run(args.out, rows, args.threads, config={k: v for k, v in vars(args).items() if k != "out"})


if __name__ == "__main__":
    main()
