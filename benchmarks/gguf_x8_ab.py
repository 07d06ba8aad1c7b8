"""GGUF tensors as stored against their repacking for the CPU kernels, in one process, on a real GGUF: K-quants, Q5_0
and Q5_1 in the x8 layout (kernels/cpu_gguf_x8.cpp), or Q5_0 / Q5_1 in the r8 layout (kernels/cpu_gguf.cpp).

    python benchmarks/gguf_x8_ab.py [--gguf /work/ggufs/random1b.Q4_K_M.gguf] [--layout x8|r8] [--threads 1,2]
                                    [--m 1] [--rounds 5] [--json benchmarks/results/gguf-x8-ab.json]

Multiplies every tensor of the layout's types in the file (a copy in memory, so both layouts are read from DRAM
the same way, the whole set larger than the caches) by M rows of x through ext.gguf_linear, once as stored and
once repacked, rounds alternating which goes first; per tensor kind and in total the best round. GB/s = the stored
bytes / time (the x8 copy is 2.8% larger for Q4_K / Q5_K, the same size for Q6_K, Q5_0, Q5_1; r8: the same size).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="/work/ggufs/random1b.Q4_K_M.gguf")
    ap.add_argument("--layout", choices=["x8", "r8"], default="x8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import gguf

    from edgellm.kernels import matmul as K
    from edgellm.quant.gguf_linear import R8, X8

    ext = K.cpu_extension()
    offset = X8 if args.layout == "x8" else R8
    listed = getattr(ext, f"gguf_{args.layout}_types", list)() if ext is not None else []
    if not listed:
        raise SystemExit(f"no {args.layout} kernels in this build (they need AVX2)")
    x8_types = set(listed)
    repack = ext.gguf_repack if args.layout == "x8" else ext.gguf_repack_r8
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in gguf.GGUFReader(args.gguf).tensors:
            if int(t.tensor_type) not in x8_types:
                continue
            n, k = int(t.shape[1]), int(t.shape[0])
            if args.layout == "x8" and n % 8:
                continue  # (the loader keeps such a tensor's last rows % 8 out of the x8 layout)
            raw = torch.from_numpy(np.array(t.data).reshape(n, -1))
            kind = (t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0])
            tensors.append((f"{kind}:{t.tensor_type.name}:{n}x{k}", int(t.tensor_type), n, k, raw,
                            repack(raw, int(t.tensor_type), n, k)))
    total = sum(r.numel() for *_, r, _ in tensors)
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(args.m, k, generator=gen) for k in {t[3] for t in tensors}}
    rows = []
    for threads in [int(v) for v in args.threads.split(",")]:
        torch.set_num_threads(threads)
        best = collections.defaultdict(lambda: [float("inf"), float("inf")])
        for rnd in range(args.rounds):
            for which in (rnd % 2, 1 - rnd % 2):
                per = collections.defaultdict(float)
                t00 = time.perf_counter()
                for kind, ty, n, k, raw, x8 in tensors:
                    parts = [(raw, ty, n, None)] if which == 0 else [(x8, ty + offset, n, None)]
                    t0 = time.perf_counter()
                    ext.gguf_linear(xs[k], parts, n)
                    per[kind] += time.perf_counter() - t0
                per["TOTAL"] = time.perf_counter() - t00
                for kind, v in per.items():
                    best[kind][which] = min(best[kind][which], v)
        nbytes = collections.Counter()
        for kind, *_, raw, _ in tensors:
            nbytes[kind] += raw.numel()
        nbytes["TOTAL"] = total
        for kind, (a, b) in best.items():
            rows.append({"threads": threads, "kind": kind, "bytes": nbytes[kind], "stored_ms": a * 1e3,
                         f"{args.layout}_ms": b * 1e3, "stored_GBps": nbytes[kind] / a / 1e9,
                         f"{args.layout}_GBps": nbytes[kind] / b / 1e9, "speedup": a / b})
            print(f"threads {threads}  {kind:34s} stored {a * 1e3:8.2f} ms {nbytes[kind] / a / 1e9:6.1f} GB/s   "
                  f"{args.layout} {b * 1e3:8.2f} ms {nbytes[kind] / b / 1e9:6.1f} GB/s   x{a / b:.2f}")
    if args.json:
        out = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": {"cpu": platform.processor() or platform.machine(), "isa": ext.isa()},
               "file": args.gguf, "layout": args.layout, "M": args.m, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
