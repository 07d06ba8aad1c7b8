"""Load time (process start → ready to prefill) with the GGUF file out of the page cache, as on the first run after
the file was written a while ago, beside the same with it cached, for edgellm with and without its prefetch
(edgellm/prefetch.py: the `edgellm` command starts reading the file before it imports torch) or its early repack
(edgellm/early_repack.py: the K-quants repacked on the second core meanwhile), and for llama.cpp.

    python benchmarks/cold_load.py FILE.gguf [FILE.gguf ...] --peer-python /tmp/peer/bin/python \
        [--rounds 5] [--json benchmarks/results/cold-load.json]

Before each cold run the file's cached pages are dropped (posix_fadvise DONTNEED; the libraries stay cached).
The variants alternate within each round; the row holds each variant's median and its runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

from gguf_vs_llamacpp import CHILD_ENV, measure, warm_bytecode, write_doc  # benchmarks/, this script's folder

VARIANTS = {  # name → (engine, extra environment)
    "edgellm": ("edgellm", {}),
    "edgellm, no prefetch": ("edgellm", {"EDGELLM_PREFETCH": "0"}),
    "edgellm, no early repack": ("edgellm", {"EDGELLM_EARLY_REPACK": "0"}),  # (edgellm/early_repack.py)
    "llama.cpp": ("llama.cpp", {}),
}


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warm_bytecode(sys.executable)
    rows = []
    for f in args.files:
        runs: dict[str, list[float]] = {f"{v}, {c}": [] for c in ("cold", "warm") for v in VARIANTS}
        for r in range(args.rounds):
            names = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for cache in ("cold", "warm"):
                for name in names:
                    engine, extra = VARIANTS[name]
                    if cache == "cold":
                        drop_from_page_cache(f)
                    python = sys.executable if engine == "edgellm" else args.peer_python
                    result = measure(python, engine, f, "load", {**CHILD_ENV, **extra})
                    if "error" in result:
                        raise SystemExit(f"{name} on {f}: {result['error']}")
                    runs[f"{name}, {cache}"].append(round(result["load_s"], 3))
        medians = {k: statistics.median(v) for k, v in runs.items()}
        row = {"file": Path(f).name, "file_bytes": Path(f).stat().st_size, "load_s": medians,
               "ratio_to_llama.cpp": {k: v / medians[f"llama.cpp, {k.rsplit(', ', 1)[1]}"]
                                      for k, v in medians.items() if not k.startswith("llama.cpp")},
               "runs": runs, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "load_average": [round(v, 2) for v in os.getloadavg()]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("file", "load_s", "ratio_to_llama.cpp")}), flush=True)
    if args.json:
        write_doc(args.json, rows)


if __name__ == "__main__":
    main()
