"""A GGUF with a real model's vocabulary size, for load-time runs: the test files made from the bundled model keep
its 49152 tokens, where Llama 3 has 128256 and Qwen2.5 151936, and a load parses and builds all of them.

    python benchmarks/real_vocab_gguf.py /work/ggufs/random1b.Q4_K_M.gguf /work/ggufs/random1b-v128k.Q4_K_M.gguf \
        --vocab 128256

The source's tokens and merges are kept (its chat template and special tokens still work) and extended with seeded
random byte-level BPE tokens, each the concatenation of two earlier ones with its merge; token_embd / output get
`--vocab` rows of random blocks of their stored type (fp16 scales set small). The weights are noise: for load time,
memory and kernel speed, not for text.
"""
from __future__ import annotations

import argparse
import random

import gguf
import numpy as np

from gguf_copy import FLOAT_TYPES, random_blocks, write_copy  # benchmarks/, this script's folder

VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def extend_vocab(tokens: list[str], merges: list[str], size: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    tokens, merges, known = list(tokens), list(merges), set(tokens)
    usable = [t for t in tokens if not t.startswith("<") and " " not in t]  # not the special tokens
    while len(tokens) < size:
        a, b = rng.choice(usable), rng.choice(usable)
        if a + b in known or len(a + b) > 32:
            continue
        known.add(a + b)
        tokens.append(a + b)
        usable.append(a + b)
        merges.append(f"{a} {b}")
    return tokens, merges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out")
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--vocab", type=int, help="tokens in the new file, e.g. 128256 (Llama 3)")
    size.add_argument("--vocab-from", metavar="VOCAB.gguf",
                      help="a real vocabulary instead: this GGUF's tokenizer (tokens, merges, types, pre-tokenizer, "
                      "BOS / EOS ids where the source has such keys), e.g. llama.cpp's models/ggml-vocab-llama-bpe.gguf "
                      "(Llama 3) or ggml-vocab-qwen2.gguf; the random extension's tokens run 4-5x longer than real "
                      "ones (~40 bytes against 8-11), which overstates a load's header and tokenizer work")
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.source)
    if args.vocab_from:
        vocab = gguf.GGUFReader(args.vocab_from).fields
        keys = [k for k in vocab if k.startswith("tokenizer.ggml.") and k in reader.fields]
        values = {k: vocab[k].contents() for k in keys}
        tokens, merges = values["tokenizer.ggml.tokens"], values.get("tokenizer.ggml.merges", [])
    else:
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        if args.vocab <= len(tokens):
            raise SystemExit(f"the source already has {len(tokens)} tokens")
        tokens, merges = extend_vocab(tokens, reader.fields["tokenizer.ggml.merges"].contents(), args.vocab)
        types = reader.fields["tokenizer.ggml.token_type"].contents()
        types = types + [1] * (len(tokens) - len(types))
        values = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types}
    values |= {key: len(tokens) for key in reader.fields if key.endswith(".vocab_size")}
    rng = np.random.default_rng(0)

    def replace(t):
        if t.name not in VOCAB_TENSORS:
            return None
        k = int(t.shape[0])
        if t.tensor_type in FLOAT_TYPES:
            return (rng.standard_normal((len(tokens), k)) * 0.02).astype(np.asarray(t.data).dtype), None
        return random_blocks(t.tensor_type, len(tokens), k, rng), t.tensor_type

    write_copy(reader, args.out, values, replace)
    print(f"{args.out}: {len(tokens)} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main()
