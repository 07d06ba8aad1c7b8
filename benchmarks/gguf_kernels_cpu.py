"""The GGUF kernels (kernels/cpu_gguf.cpp) per type at 1B-shaped matrices, beside the int4 kernel on the same data.

    python benchmarks/gguf_kernels_cpu.py [--threads 2] [--rounds 7] [--m 1,2,4,8,16] [--prefill 16,32,64,128,256,512]
                                          [--out benchmarks/results/gguf-kernels-cpu.json]

Decode is memory-bound: each method cycles through weight copies totalling >= 64 MB (past the L3), so weights come
from DRAM as in a model, and the table gives GB/s of weight bytes read (raw GGUF blocks, scales included) next to
the microseconds. "int4 sym/asym g32" is cpu_kernels.cpp's int4 kernel on Q4_0 / Q4_1's own data (the same codes
and fp16 scales, stored apart instead of interleaved in 18 / 20-byte blocks). Calls are timed from Python (the
call overhead the model pays is in), methods interleaved round-robin, the median round kept.

A "hot" table runs the same calls on one 256 x 2048 copy that stays in L2 (compute speed, less noisy on a loaded
machine). The prefill table times, for the K-quants at M rows >= 16 (wq: 2048 x 2048), the int-dot kernel against dequantize
(gguf_dequantize into a reused buffer) + fp32 F.linear, and records the largest M where the kernel still wins:
kernels/gguf_ops.py GGUF_KERNEL_MAX_ROWS holds those thresholds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.kernels_cpu import bench_round_robin, cpu_model, cycling, load_average  # noqa: E402
from benchmarks.run_record import write_run  # noqa: E402
from edgellm.kernels.cpu_ext import get_extension  # noqa: E402

# (name, N, K): Llama-3.2-1B's q/o projection, fused gate+up (w13), down (w2)
SHAPES = [("wq", 2048, 2048), ("w13", 16384, 2048), ("w2", 2048, 8192)]
# GGML type id -> (name, values per block, bytes per block, byte offsets of fp16 fields that must be sane)
TYPES = {2: ("Q4_0", 32, 18, (0,)), 3: ("Q4_1", 32, 20, (0, 2)), 6: ("Q5_0", 32, 22, (0,)),
         7: ("Q5_1", 32, 24, (0, 2)), 8: ("Q8_0", 32, 34, (0,)), 10: ("Q2_K", 256, 84, (80, 82)),
         11: ("Q3_K", 256, 110, (108,)), 12: ("Q4_K", 256, 144, (0, 2)), 13: ("Q5_K", 256, 176, (0, 2)),
         14: ("Q6_K", 256, 210, (208,)), 20: ("IQ4_NL", 32, 18, (0,)), 23: ("IQ4_XS", 256, 136, (0,))}
COLD_BYTES = 64 << 20
STAT = statistics.median  # --stat min: the fastest round (a loaded machine's rounds mostly measure the others)


def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes] of valid random blocks (speed does not depend on the values; fp16 fields sane)."""
    _, qv, bb, halves = TYPES[qtype]
    nb = n * k // qv
    raw = torch.randint(0, 256, (nb, bb), dtype=torch.uint8, generator=gen)
    for off in halves:
        raw[:, off:off + 2] = (torch.rand(nb, generator=gen) * 1e-3 + 1e-4).half().view(torch.uint8).view(nb, 2)
    return raw.view(n, k // qv * bb)


def gguf_method(ext, qtype: int, n: int, k: int, gen) -> tuple[int, Callable[[], Callable]]:
    def f():
        raw = random_blocks(qtype, n, k, gen)
        parts = [(raw, qtype, n, None)]
        return lambda x: ext.gguf_linear(x, parts, n)
    return n * k // TYPES[qtype][1] * TYPES[qtype][2], f


def int4_method(ext, asym: bool, n: int, k: int, gen) -> tuple[int, Callable[[], Callable]]:
    def f():
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // 32, generator=gen) * 1e-3).half()
        mins = (torch.rand(n, k // 32, generator=gen) * -1e-2).half() if asym else torch.empty(0, dtype=torch.float16)
        return lambda x: ext.int4_gemm(x, codes, scales, mins, 32)
    return n * k // 32 * (20 if asym else 18), f


def cold(nbytes: int, factory, cold_bytes: int) -> Callable[[torch.Tensor], Callable[[], object]]:
    return cycling([factory() for _ in range(max(1, -(-cold_bytes // nbytes)))])


def decode_table(ext, ms: list[int], rounds: int, gen, shapes=SHAPES, cold_bytes: int = COLD_BYTES,
                 table: str = "decode") -> list[dict]:
    rows = []
    for shape, n, k in shapes:
        methods = {f"{TYPES[t][0]}": gguf_method(ext, t, n, k, gen) for t in TYPES}
        methods["int4 sym g32 (Q4_0 data)"] = int4_method(ext, False, n, k, gen)
        methods["int4 asym g32 (Q4_1 data)"] = int4_method(ext, True, n, k, gen)
        bound = {name: (nbytes, cold(nbytes, f, cold_bytes)) for name, (nbytes, f) in methods.items()}
        for m in ms:
            x = torch.randn(m, k, generator=gen)
            us = bench_round_robin({name: b(x) for name, (_, b) in bound.items()}, rounds, STAT)
            for name, t in us.items():
                nbytes = bound[name][0]
                rows.append({"table": table, "shape": shape, "N": n, "K": k, "M": m, "method": name,
                             "us": round(t, 1), "weight_GBps": round(nbytes / t / 1e3, 2)})
                print(f"{table} {shape:4s} N={n:5d} K={k:4d} M={m:2d} {name:26s} {t:9.1f} us {nbytes / t / 1e3:6.2f} GB/s",
                      flush=True)
    return rows


def prefill_table(ext, ms: list[int], rounds: int, gen) -> tuple[list[dict], dict[str, int]]:
    """Kernel vs dequantize + GEMM for the K-quants at the wq shape; threshold = the largest M of the first run of
    kernel wins."""
    rows, thresholds = [], {}
    for qtype in (12, 13, 14):
        name = TYPES[qtype][0]
        wins = []
        for shape, n, k in SHAPES[:1]:
            raw = random_blocks(qtype, n, k, gen)
            parts = [(raw, qtype, n, None)]
            buf = torch.empty(n * k)
            for m in ms:
                x = torch.randn(m, k, generator=gen)
                us = bench_round_robin({
                    "kernel": lambda: ext.gguf_linear(x, parts, n),
                    "dequantize+GEMM": lambda: F.linear(x, ext.gguf_dequantize(raw, qtype, n, k, buf)),
                }, rounds, STAT)
                win = us["kernel"] <= us["dequantize+GEMM"]
                wins.append((m, win))
                for meth, t in us.items():
                    rows.append({"table": "prefill", "type": name, "shape": shape, "N": n, "K": k, "M": m,
                                 "method": meth, "us": round(t, 1)})
                print(f"prefill {name} {shape} M={m:3d} kernel {us['kernel']:9.1f} us  dequant+GEMM "
                      f"{us['dequantize+GEMM']:9.1f} us", flush=True)
        # the largest M of the first run of kernel wins (M = 16 is the decode kernels' own limit)
        best = 16
        for m, win in wins:
            if not win:
                break
            best = m
        thresholds[name] = best
    return rows, thresholds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m", default="1,2,4,8,16", help="M values of the decode / verification table")
    ap.add_argument("--prefill", default="16,32,64,128,256,512", help="M values of the prefill table ('' skips it)")
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="statistic over the rounds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf-kernels-cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    ext = get_extension()
    if ext is None or not hasattr(ext, "gguf_linear"):
        sys.exit("the CPU kernel extension is unavailable (the build failed: see the warning above)")
    gen = torch.Generator().manual_seed(0)
    load_before = load_average()
    ms = [int(v) for v in args.m.split(",") if v]
    rows = decode_table(ext, ms, args.rounds, gen)
    # the same kernels on one weight copy that stays in L2: their compute speed, which a loaded machine's DRAM
    # timings blur (each figure is then weights x rows per second, not a bandwidth)
    rows += decode_table(ext, [m for m in ms if m in (1, 16)], args.rounds, gen, [("hot", 256, 2048)], 0, "hot")
    thresholds = {}
    if args.prefill:
        prows, thresholds = prefill_table(ext, [int(v) for v in args.prefill.split(",") if v], args.rounds, gen)
        rows += prows
        print("kernel wins up to M =", thresholds)
    flags = sorted(f for f in open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
                   if f.startswith(("avx", "fma", "f16c", "sse4", "vnni"))) if os.path.exists("/proc/cpuinfo") else []
    write_run(args.out, rows, args.threads, cpu=cpu_model(), cpu_flags=flags, isa=ext.isa(),
              load_average=[load_before, load_average()], stat=args.stat, gguf_kernel_max_rows=thresholds)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
