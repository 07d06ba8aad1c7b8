"""Load-time A/B of one of the `edgellm` command's start-up steps, on (its environment switch unset) against off
(=0): fresh processes started as the command starts (gguf_vs_llamacpp.py's edgellm child, process start to a loaded
model and tokenizer), rounds alternating which goes first. Peak RSS of each child beside its load time; with --decode
also its decode tok/s (gguf_vs_llamacpp.py's decode mode).

    python benchmarks/load_switch_ab.py FILES... [--switch EDGELLM_EARLY_REPACK] [--rounds 8] [--decode]
                                        [--json OUT.json]

Switches: EDGELLM_EARLY_REPACK (edgellm/early_repack.py: a GGUF's K-quants repacked on the second core while torch
is imported; results/early-repack-ab.json, made under this script's earlier name early_repack_ab.py),
EDGELLM_DEFER_META (edgellm/torch_import.py: torch imported without its Python meta kernels;
results/defer-meta-ab.json), EDGELLM_PREFETCH (edgellm/prefetch.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from run_record import CHILD_ENV, run_child, write_run  # benchmarks/, this script's folder

HERE = Path(__file__).resolve().parent


def load_once(path: str, switch: str, on: bool, mode: str = "load") -> dict:
    env = {k: v for k, v in CHILD_ENV.items() if k != switch} if on else {**CHILD_ENV, switch: "0"}
    rc, out, err, rss = run_child([sys.executable, str(HERE / "gguf_vs_llamacpp.py"), "--child", "edgellm", path,
                                   "--mode", mode], env)
    if rc != 0:
        raise SystemExit(f"child failed on {path}: {err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**{k: result[k] for k in ("load_s", "decode_tok_s") if k in result}, "peak_rss_mib": rss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--switch", default="EDGELLM_EARLY_REPACK", help="the environment variable that turns it off")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--decode", action="store_true", help="also decode (128 greedy tokens, median of 3 runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mode = "decode" if args.decode else "load"
    metrics = ("load_s", "decode_tok_s", "peak_rss_mib") if args.decode else ("load_s", "peak_rss_mib")
    load_once(args.files[0], args.switch, True)  # bytecode caches and the page cache warm, the kernels built
    rows = []
    for f in args.files:
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                runs["on" if on else "off"].append(load_once(f, args.switch, on, mode))
        med = {k: {m: statistics.median(x[m] for x in v) for m in metrics} for k, v in runs.items()}
        row = {"file": Path(f).name, "switch": args.switch, "median": med,
               "load_ratio": med["on"]["load_s"] / med["off"]["load_s"], "runs": runs}
        if args.decode:
            row["decode_ratio"] = med["on"]["decode_tok_s"] / med["off"]["decode_tok_s"]
        print(json.dumps({k: row[k] for k in ("file", "median", "load_ratio", "decode_ratio") if k in row}), flush=True)
        rows.append(row)
    if args.json:
        write_run(args.json, rows, threads=2)


if __name__ == "__main__":
    main()
