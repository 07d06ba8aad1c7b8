"""Make the GGUF test files of issue 22 with llama.cpp's own quantizer (run with llama-cpp-python's Python).

    /tmp/peer/bin/python benchmarks/make_gguf_files.py SOURCE.gguf OUT_DIR [--types Q4_K_M,Q6_K,...]

Requantizes SOURCE (e.g. the bundled SmolLM2 Q4_1, or a Q8_0/F16 export of a random 1B-shaped model) to each type
with `llama_model_quantize` (allow_requantize), as users' files are made. Files already there are kept.
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import llama_cpp

FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q6_K": 18, "Q4_K_M": 15, "Q5_K_M": 17,
          "Q4_K_S": 14, "Q3_K_M": 12, "Q2_K": 10, "IQ4_NL": 25, "IQ4_XS": 30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q5_0,Q8_0,Q4_0")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.types.split(","):
        dst = args.out / f"{args.source.stem.split('.')[0]}.{name}.gguf"
        if dst.exists():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[name]
        params.allow_requantize = True
        params.nthread = 2
        tmp = dst.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(args.source).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"{name}: llama_model_quantize failed ({rc})")
        tmp.replace(dst)
        print(dst)


if __name__ == "__main__":
    main()
