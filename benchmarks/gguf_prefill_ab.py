"""TTFT of a GGUF model under two GGUF_KERNEL_MAX_ROWS tables (int8 kernel vs dequantize + fp32 GEMM per prompt
size), in one process, runs interleaved (robust to a loaded machine).

    python benchmarks/gguf_prefill_ab.py [-m /work/ggufs/random1b.Q4_K_M.gguf] [--tokens 512] [--runs 3]
                                         [--threads 2] [--json FILE]

Setting A: `--a` (default: the table before the per-256 K-quant kernels, which sent prompts of more than 64 / 32
rows to dequantize + GEMM); setting B: kernels/gguf_ops.py's GGUF_KERNEL_MAX_ROWS as committed. The prompt is
GPL-3 text, as benchmarks/gguf_vs_llamacpp.py's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = "/usr/share/common-licenses/GPL-3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/work/ggufs/random1b.Q4_K_M.gguf")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--a", default="Q4_K=64,Q5_K=32,Q6_K=32", help="setting A's table, TYPE=ROWS comma list")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from edgellm.bench import run_once
    from edgellm.args import engine_from_args, load_from_args
    from edgellm.cli import build_parser
    from edgellm.kernels import gguf_ops

    cli = build_parser().parse_args(["run", "x", "-m", args.model, "--ctx", str(args.tokens + 64), "--threads",
                                     str(args.threads)])
    loaded = load_from_args(cli)
    engine = engine_from_args(cli, loaded)
    ids = loaded.tokenizer.encode(open(TEXT).read())[:args.tokens]
    table_b = dict(gguf_ops.GGUF_KERNEL_MAX_ROWS)
    table_a = {k: int(v) for k, v in (kv.split("=") for kv in args.a.split(",") if kv)}
    run_once(engine, ids[:64], 1)  # warm-up
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.runs):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            gguf_ops.GGUF_KERNEL_MAX_ROWS.clear()
            gguf_ops.GGUF_KERNEL_MAX_ROWS.update(table_a if name == "A" else table_b)
            times[name].append(run_once(engine, ids, 1)[0].ttft_s)
            print(name, f"{times[name][-1]:.2f} s", flush=True)
    gguf_ops.GGUF_KERNEL_MAX_ROWS.clear()
    gguf_ops.GGUF_KERNEL_MAX_ROWS.update(table_b)
    res = {k: {"median_s": statistics.median(v), "min_s": min(v), "runs_s": v} for k, v in times.items()}
    print(f"A {table_a}: {res['A']['median_s']:.2f} s   B {table_b}: {res['B']['median_s']:.2f} s   "
          f"B/A = {res['B']['median_s'] / res['A']['median_s']:.2f}")
    if args.json:
        doc = {"command": " ".join(["python", "benchmarks/gguf_prefill_ab.py", *sys.argv[1:]]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "load_average": os.getloadavg(), "model": args.model, "tokens": args.tokens, "threads": args.threads,
               "A": {"max_rows": table_a, **res["A"]}, "B": {"max_rows": table_b, **res["B"]}}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
