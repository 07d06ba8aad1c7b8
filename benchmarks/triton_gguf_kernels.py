"""The Triton GGUF kernels alone on CUDA (kernels/triton_gguf.py): the decode product's time and bandwidth per type at
Llama-3.2-1B's matrix shapes, beside the torch-ops dequantization it replaces (+ F.linear) and cuBLAS on the bf16
weight (the float model's product), and a sweep of the launch (rows per program, warps) for the main types.

    python benchmarks/triton_gguf_kernels.py --json OUT.json

Random blocks (the bytes and shapes are what the speed depends on). Timed with triton.testing.do_bench.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench as _do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgellm.kernels import triton_gguf as TG  # noqa: E402
from edgellm.quant.gguf_tensor import dequantize_blocks  # noqa: E402
from gguf_copy import random_blocks  # noqa: E402  (benchmarks/, this script's folder)

NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
SHAPES = {"attn_q 2048x2048": (2048, 2048), "attn_k 512x2048": (512, 2048), "ffn_up 8192x2048": (8192, 2048),
          "ffn_down 2048x8192": (2048, 8192), "head 49152x2048": (49152, 2048)}
# (rows per program, units of 256 values per iteration, warps)
SWEEP = [(1, 8, 4), (2, 8, 4), (4, 8, 4), (4, 4, 4), (8, 2, 4), (16, 1, 4)]


DRY = "--dry" in sys.argv  # a check of this script on the CPU (TRITON_INTERPRET=1): tiny shapes, one call each


def do_bench(fn) -> float:
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return _do_bench(fn, warmup=5, rep=25)  # ms; short: ~100 timings a run, on a leased GPU


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="1,4", help="rows of x (decode 1, a verification more)")
    ap.add_argument("--dry", action="store_true", help="on the CPU under TRITON_INTERPRET=1, tiny shapes")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.dry else "cuda")
    shapes = {"tiny 16x256": (16, 256)} if args.dry else SHAPES
    rng = np.random.default_rng(0)
    out = {"command": " ".join(sys.argv), "gpu": "" if args.dry else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "host": platform.node(), "rows": []}
    for type_id, name in NAMES.items():
        for label, (n, k) in shapes.items():
            raw = torch.from_numpy(random_blocks(gguf.GGMLQuantizationType[name], n, k, rng)).to(dev)
            parts = [(raw, type_id, n, None)]
            w = TG.gguf_dequantize(parts, k, torch.bfloat16)
            configs = SWEEP if name in ("Q4_K", "Q6_K", "Q8_0") else [None]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                row = {"type": name, "shape": label, "m": m, "raw_bytes": raw.numel()}
                row["cublas_bf16_us"] = do_bench(lambda: F.linear(x, w)) * 1e3
                if m == 1:
                    row["torch_dequant_us"] = do_bench(lambda: F.linear(x, dequantize_blocks(raw, type_id, (n, k),
                                                                                               torch.bfloat16))) * 1e3
                    row["triton_dequant_us"] = do_bench(lambda: F.linear(x, TG.gguf_dequantize(parts, k,
                                                                                                torch.bfloat16))) * 1e3
                sweep = {}
                for launch in configs:
                    us = do_bench(lambda: TG.gguf_rows(x, parts, n, launch=launch)) * 1e3
                    sweep["x".join(map(str, launch or TG._launch(n, k)))] = us
                row["triton_rows_us"] = sweep
                best = min(sweep.values())
                row["triton_rows_gb_s"] = raw.numel() / best / 1e3
                row["cublas_bf16_gb_s"] = w.numel() * 2 / row["cublas_bf16_us"] / 1e3
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
                if args.json:  # after each row: a run stopped at its time limit keeps what it measured
                    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
