"""A GGUF for speed tests of a type llama.cpp will not quantize here (the IQ2 / IQ3 / IQ1 types want an importance
matrix): a source file with every tensor of one type replaced by random blocks of another, same shapes, same
metadata and tokenizer (each block's fp16 d set small so the values stay finite).

    python benchmarks/random_blocks_gguf.py /work/ggufs/random1b.Q4_K_M.gguf /work/ggufs/random1b.IQ3_XXS.gguf \
        --type IQ3_XXS [--replace Q4_K]

The weights are noise: for load time, memory and kernel speed, not for text.
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np

from gguf_copy import random_blocks, write_copy  # benchmarks/, this script's folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--type", required=True, help="the GGML type of the random blocks, e.g. IQ3_XXS")
    ap.add_argument("--replace", default="Q4_K", help="the source's tensors of this type are replaced")
    ap.add_argument("--d", type=float, default=0.002, help="every block's fp16 d (bytes 0-1); pick it so the weights "
                    "have a trained model's spread (~0.02): with 0.002 the IQ3 weights reach ~1 and the activations "
                    "blow up, fine for speed, chaotic for KL")
    args = ap.parse_args()
    T = gguf.GGMLQuantizationType
    new, old = T[args.type], T[args.replace]
    rng = np.random.default_rng(0)

    def replace(t):
        if t.tensor_type != old:
            return None
        k = int(t.shape[0])
        return random_blocks(new, int(t.n_elements) // k, k, rng, args.d), new

    write_copy(gguf.GGUFReader(args.source), args.out, replace=replace)
    print(args.out)


if __name__ == "__main__":
    main()
