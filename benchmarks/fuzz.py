"""The long fuzz run: every broken and hostile input tests/fuzz_cases.py makes (or a seeded sample of
--count), from the five tiny models and the bundled GGUF, loaded in child processes under an address-space
limit and a per-case alarm. Writes benchmarks/results/fuzz.json: how many cases, by kind and outcome, and
every failure (there should be none).

    python benchmarks/fuzz.py                 # every case (~12k; ~5 min on 2 cores)
    python benchmarks/fuzz.py --count 2000    # a seeded sample
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from run_record import write_run  # noqa: E402
from tests.fixtures.tiny import VARIANTS, make_gguf, make_hf_model  # noqa: E402
from tests.fuzz_cases import run_worker  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=None, help="a seeded sample of this many cases (default: all)")
    p.add_argument("--seed", type=int, default=20261124)
    p.add_argument("--random", type=int, default=100, help="seeded random header damages per GGUF (default 100)")
    p.add_argument("--memory-limit-gib", type=float, default=2.0,
                   help="address space a case may add above the worker's start (default 2 GiB)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per case before it counts as a hang")
    p.add_argument("--bundled-count", type=int, default=300,
                   help="header cases on the bundled 98 MB GGUF, a seeded sample (default 300; 0: none)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/fuzz.json"))
    p.add_argument("--progress", action="store_true", help="print each outcome as it comes")
    args = p.parse_args()

    from edgellm.loading import bundled_model_path

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sources = {}
        for i, variant in enumerate(VARIANTS):
            folder = make_hf_model(root / variant, variant, seed=i)
            sources[variant] = (str(folder), str(make_gguf(folder, root / f"{variant}.gguf")))
        spec = {"sources": sources, "bundled": str(bundled_model_path()) if args.bundled_count else None,
                "bundled_count": args.bundled_count,
                "seed": args.seed, "n_random": args.random, "work": str(root / "work"), "sample": args.count,
                "memory_limit": int(args.memory_limit_gib * 2**30), "timeout_s": args.timeout,
                "progress": args.progress}
        t0 = time.perf_counter()
        outcomes, proc = run_worker(spec, root / "out.jsonl", timeout_s=6 * 3600)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0 and not outcomes:
        print(proc.stderr if proc.stderr else "the worker failed", file=sys.stderr)
        return 1
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_kind[o.name.split(":")[0]][o.result] += 1
    results = collections.Counter(o.result for o in outcomes)
    failures = [{"case": o.name, "detail": o.detail} for o in outcomes if o.result == "FAIL"]
    slowest = max(outcomes, key=lambda o: o.seconds)
    rows = [{"kind": k, "cases": sum(c.values()), **dict(c)} for k, c in sorted(by_kind.items())]
    write_run(args.out, rows, threads=1, cases=len(outcomes), results=dict(results), all_clean=not failures,
              failures=failures, seconds=round(seconds, 1), slowest_case={"case": slowest.name,
                                                                           "seconds": round(slowest.seconds, 2)},
              seed=args.seed, memory_limit_gib=args.memory_limit_gib, timeout_s=args.timeout,
              outcomes_meaning={"refused": "an edgellm error naming the file", "loaded": "a benign mutation that "
                                "loads and generates", "FAIL": "anything else: another exception, a hang, a crash, "
                                "a MemoryError under the limit, or a file that must be refused but loaded"})
    print(f"{len(outcomes)} cases in {seconds:.0f} s: {dict(results)}; slowest {slowest.seconds:.2f} s ({slowest.name})")
    for f in failures[:40]:
        print(f"FAIL {f['case']}: {f['detail']}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
