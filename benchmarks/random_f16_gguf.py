"""An F16 GGUF with seeded random weights in a real model's shape, for make_gguf_files.py to quantize with llama.cpp's
own quantizer: a Gemma-3-1B shape (the tests' fixture builds the family: q/k norms, sandwich norms, 5 sliding
layers to 1 global), or any HF folder of fp16 / fp32 safetensors (e.g. `random_model.py --dtype fp16`: the Llama /
Qwen2.5 shapes), written as llama.cpp's converter would (tests/fixtures/tiny.make_gguf). Faster than `edgellm
quantize`'s Q8_0 export, and any family the fixture has.

    python benchmarks/random_f16_gguf.py OUT.F16.gguf (--shape gemma-3-1b | --hf FOLDER)
    /tmp/peer/bin/python benchmarks/make_gguf_files.py OUT.F16.gguf /work/ggufs --types Q4_K_M
    python benchmarks/real_vocab_gguf.py /work/ggufs/OUT.Q4_K_M.gguf /work/ggufs/OUT-v262k.Q4_K_M.gguf --vocab 262144

The tokenizer is the fixture's small BPE one (real_vocab_gguf.py gives the file a real vocabulary's size). The
weights are noise: for speed, load time and memory, not for text.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.tiny import make_gguf, make_hf_model  # noqa: E402

GEMMA3_1B = dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                 layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
                 rope_theta=1_000_000.0, rope_scaling=None, rope_local_base_freq=10000.0,
                 max_position_embeddings=32768)
SHAPES = {"gemma-3-1b": ("gemma3", GEMMA3_1B)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=sorted(SHAPES))
    src.add_argument("--hf", type=Path, help="an HF folder with safetensors weights and tokenizer.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        folder = args.hf
        if folder is None:
            variant, shape = SHAPES[args.shape]
            folder = make_hf_model(Path(tmp) / "hf", variant, seed=1, **shape)
        make_gguf(folder, args.out, float_type="F16")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
