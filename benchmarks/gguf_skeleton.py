"""A GGUF's skeleton (its metadata, tokenizer included, and its tensors' names, shapes and types, no data) and a
file grown back from one with random blocks: a test file's exact shape and type mix moved to a machine it cannot
travel to whole (the GPU machine takes 64 MiB; a 1B Q4_K_M file is 700 MB, its skeleton 2 MB).

    python benchmarks/gguf_skeleton.py shrink /work/ggufs/random1b.Q4_K_M.gguf .gpu/random1b.Q4_K_M.skel.gguf
    python benchmarks/gguf_skeleton.py grow .gpu/random1b.Q4_K_M.skel.gguf /tmp/random1b.Q4_K_M.gguf

Grown tensors are random blocks of the source's type with every block's fp16 scales set small (gguf_copy.py's
random_blocks: finite weights); float tensors (norms) are ones. Noise: for speed and memory, not for text.
"""
from __future__ import annotations

import argparse
import json

import gguf
import numpy as np

from gguf_copy import FLOAT_TYPES, finish, metadata_writer, random_blocks  # benchmarks/, this script's folder

KEY = "edgellm.skeleton.tensors"  # [[name, [rows, k] (numpy order), type name], ...] as JSON


def shrink(source: str, out: str) -> None:
    reader = gguf.GGUFReader(source)
    writer = metadata_writer(reader, out, skip=(KEY,))
    tensors = [[t.name, [int(d) for d in reversed(t.shape)], t.tensor_type.name] for t in reader.tensors]
    writer.add_string(KEY, json.dumps(tensors))
    finish(writer)


def grow(skeleton: str, out: str, seed: int = 0) -> None:
    reader = gguf.GGUFReader(skeleton)
    tensors = json.loads(reader.fields[KEY].contents())
    writer = metadata_writer(reader, out, skip=(KEY,))
    rng = np.random.default_rng(seed)
    T = gguf.GGMLQuantizationType
    for name, shape, type_name in tensors:
        qtype = T[type_name]
        if qtype in FLOAT_TYPES:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32 if qtype == T.F32 else np.float16))
        else:
            rows, k = int(np.prod(shape[:-1])), shape[-1]
            writer.add_tensor(name, random_blocks(qtype, rows, k, rng, d=0.0005), raw_dtype=qtype)
    finish(writer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("verb", choices=("shrink", "grow"))
    ap.add_argument("source")
    ap.add_argument("out")
    args = ap.parse_args()
    (shrink if args.verb == "shrink" else grow)(args.source, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
