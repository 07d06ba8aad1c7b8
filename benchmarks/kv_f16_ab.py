"""The float16 KV cache (--kv f16, the CPU default) against the fp32 one (--kv fp), one process, one model, runs
interleaved (robust to a loaded machine): TTFT of an N-token prompt and decode tok/s of 32 tokens after it.

    python benchmarks/kv_f16_ab.py -m /work/ggufs/random1b.Q4_K_M.gguf --tokens 2048 [--runs 8] [--threads 2]
                                   [--json benchmarks/results/kv-f16-decode-ab.json [--merge]]

The prompt is GPL-3 text (repeated to the length). Each decode run starts from the same cached prompt (the cache
truncated back to it), so both formats read the same context every time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = "/usr/share/common-licenses/GPL-3"
FORMATS = ("fp", "f16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/work/ggufs/random1b.Q4_K_M.gguf")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the --json file's rows of other models / lengths")
    args = ap.parse_args()

    import torch

    from edgellm.args import engine_from_options, load_from_args, options_from_args
    from edgellm.cli import build_parser

    cli = build_parser().parse_args(["run", "x", "-m", args.model, "--ctx", str(args.tokens + 64), "--threads",
                                     str(args.threads)])
    loaded = load_from_args(cli)
    options = options_from_args(cli)
    engines = {kv: engine_from_options(options, loaded, kv=kv) for kv in FORMATS}
    text = open(TEXT).read()
    while len(loaded.tokenizer.encode(text)) < args.tokens:
        text += "\n" + text
    ids = loaded.tokenizer.encode(text)[:args.tokens]
    token = torch.tensor([[ids[-1]]])
    ttft: dict[str, list[float]] = {kv: [] for kv in FORMATS}
    decode: dict[str, list[float]] = {kv: [] for kv in FORMATS}
    for r in range(args.runs):
        for kv in (FORMATS if r % 2 == 0 else FORMATS[::-1]):
            e = engines[kv]
            e.reset()
            t = time.perf_counter()
            e.prefill(ids)
            ttft[kv].append(time.perf_counter() - t)
            e.step(token)  # (first step: the fused plan is built on the first call)
            t = time.perf_counter()
            for _ in range(32):
                e.step(token)
            decode[kv].append(32 / (time.perf_counter() - t))
            print(kv, f"TTFT {ttft[kv][-1]:.2f} s, decode {decode[kv][-1]:.1f} tok/s", flush=True)
    med = {kv: {"ttft_s": statistics.median(ttft[kv]), "decode_tok_s": statistics.median(decode[kv]),
                "ttft_runs_s": ttft[kv], "decode_runs_tok_s": decode[kv],
                "kv_bytes_per_token": engines[kv].cache.bytes_per_token,
                "decode_path": str(engines[kv].decode_path)} for kv in FORMATS}
    ratio = {"decode": med["f16"]["decode_tok_s"] / med["fp"]["decode_tok_s"],
             "ttft": med["f16"]["ttft_s"] / med["fp"]["ttft_s"]}
    print(f"f16 / fp: decode {ratio['decode']:.3f}x tok/s, TTFT {ratio['ttft']:.3f}x the time")
    if args.json:
        row = {"model": args.model, "tokens": args.tokens, "threads": args.threads, "runs": args.runs,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "load_average": os.getloadavg(), **med, "f16_over_fp": ratio}
        path = Path(args.json)
        rows = []
        if args.merge and path.exists():
            rows = [r for r in json.loads(path.read_text())["rows"]
                    if (r["model"], r["tokens"]) != (args.model, args.tokens)]
        doc = {"command": " ".join(["python", "benchmarks/kv_f16_ab.py", *sys.argv[1:]]),
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "rows": rows + [row]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)


if __name__ == "__main__":
    main()
