"""Decode speed of a chat's second answer with the weights moved onto 2 MiB pages while the user reads the first
(edgellm/hugepages.py, as `edgellm chat` and `edgellm serve` run it) against the same without (EDGELLM_HUGEPAGES=0):
fresh processes, rounds alternating which goes first.

    python benchmarks/hugepages_ab.py FILE.gguf [FILE.gguf ...] [--rounds 4] [--read 5] [--json OUT.json]

Each child loads the file as `edgellm chat` does (`--weights auto`, 2 threads), sets the engine's idle work as the
chat does, answers once (128 greedy tokens after a short chat prompt: decode tok/s "first"), waits --read seconds
(the user reading; the collapse runs then), and answers three more times ("after": the median). Also reported: how
many MiB of the weights ended up on huge pages (AnonHugePages of the process) and how long the collapse took.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from run_record import CHILD_ENV, run_child, write_run  # benchmarks/, this script's folder

CHAT = "Tell me a random fun fact about the Roman Empire"


def child(path: str, read_s: float) -> dict:
    from edgellm import hugepages
    from edgellm.args import engine_from_args, load_from_args
    from edgellm.bench import run_once
    from edgellm.cli import build_parser

    args = build_parser().parse_args(["run", "x", "-m", path, "--threads", "2"])  # (the chat's loading options)
    loaded = load_from_args(args)
    engine = engine_from_args(args, loaded)
    engine.idle_work = hugepages.when_idle(engine.model)
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": CHAT}])
    run_once(engine, ids, 8)  # warm-up
    first = run_once(engine, ids, 128)[0].decode_tok_s
    t0 = time.perf_counter()
    work = engine.idle_work
    if work is not None:
        work.finished.wait(timeout=read_s)
    collapse_s = time.perf_counter() - t0 if work is not None and work.finished.is_set() else None
    time.sleep(max(0.0, read_s - (time.perf_counter() - t0)))
    after = [run_once(engine, ids, 128)[0].decode_tok_s for _ in range(3)]
    huge = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages"))
    return {"first_tok_s": first, "after_tok_s": statistics.median(after), "anon_huge_mib": huge / 1024,
            "collapse_s": collapse_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--read", type=float, default=5.0, help="seconds between the first answer and the next ones")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.read)))
        return
    rows = []
    for f in args.files:
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                env = {**CHILD_ENV, "EDGELLM_HUGEPAGES": "1" if on else "0"}
                rc, out, err, _ = run_child([sys.executable, __file__, "--child", f, "--read", str(args.read)], env)
                if rc != 0:
                    raise SystemExit(f"child failed on {f}: {err[-2000:]}")
                runs["on" if on else "off"].append(json.loads(out.strip().splitlines()[-1]))
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("first_tok_s", "after_tok_s", "anon_huge_mib")}
               for k, v in runs.items()}
        row = {"file": Path(f).name, "median": med, "after_ratio": med["on"]["after_tok_s"] / med["off"]["after_tok_s"],
               "first_ratio": med["on"]["first_tok_s"] / med["off"]["first_tok_s"], "runs": runs}
        print(json.dumps({k: row[k] for k in ("file", "median", "after_ratio", "first_ratio")}), flush=True)
        rows.append(row)
    if args.json:
        write_run(args.json, rows, threads=2, read_s=args.read)


if __name__ == "__main__":
    main()
