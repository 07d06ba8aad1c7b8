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

SCALE_OFFSET = {"Q6_K": 208}  # byte offset of a block's fp16 d where it is not the first two bytes
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


def random_rows(tensor_type: gguf.GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    qv, qb = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = rng.integers(0, 256, size=(rows, k // qv * qb), dtype=np.uint8)
    at = SCALE_OFFSET.get(tensor_type.name, 0)
    raw.reshape(rows, -1, qb)[:, :, at:at + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, required=True, help="tokens in the new file, e.g. 128256 (Llama 3)")
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.source)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    if args.vocab <= len(tokens):
        raise SystemExit(f"the source already has {len(tokens)} tokens")
    tokens, merges = extend_vocab(tokens, reader.fields["tokenizer.ggml.merges"].contents(), args.vocab)
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    types = types + [1] * (len(tokens) - len(types))
    new = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types}
    writer = gguf.GGUFWriter(args.out, reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = new.get(key, f.contents())
        if key.endswith(".vocab_size"):
            value = len(tokens)
        writer.add_key_value(key, value, f.types[0], f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in reader.tensors:
        if t.name in VOCAB_TENSORS:
            k = int(t.shape[0])
            if t.tensor_type in float_types:
                data = (rng.standard_normal((len(tokens), k)) * 0.02).astype(np.asarray(t.data).dtype)
                writer.add_tensor(t.name, data)
            else:
                writer.add_tensor(t.name, random_rows(t.tensor_type, len(tokens), k, rng), raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, np.asarray(t.data),
                              raw_dtype=None if t.tensor_type in float_types else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {len(tokens)} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main()
