"""Load-time A/B of the Q8_0 / Q4_0 / Q4_1 mapping onto edgellm's int8 / int4 layout (quant/convert.try_exact_gguf):
each part copied once, straight into its rows of the fused tensor (now), against a copy per part, the RoPE rows
permuted in another copy and the parts concatenated (before). Both in one process, rounds alternating.

    python benchmarks/gguf_exact_load_ab.py FILE.gguf [--rounds 6] [--json benchmarks/results/gguf-exact-load-ab.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def before(parts, heads):
    """The former path: from_gguf per part, the permutation as a copy, then torch.cat."""
    from edgellm.gguf_file import unpermute_rope_rows
    from edgellm.quant.groups import from_gguf

    fields = []
    for (raw, ggml_type, shape), h in zip(parts, heads):
        qt = from_gguf(raw, ggml_type, shape)
        ts = [t for t in (qt.codes, qt.scales, qt.mins) if t is not None]
        fields.append([unpermute_rope_rows(t, h).contiguous() if h else t for t in ts])
    return fields[0] if len(fields) == 1 else [torch.cat(f) for f in zip(*fields)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from edgellm.loading import open_source, source_names, weight_plan
    from edgellm.quant.convert import try_exact_gguf

    src, cfg, fmt = open_source(Path(args.file))
    available = set(src.names())
    plan = weight_plan(cfg, source_names(cfg, fmt, available), gguf_layout=True, available=available)
    groups = [([src.raw(p) for p in parts], [plan.permute.get(p) for p in parts]) for parts in plan.parts.values()
              if all(src.tensor_type(p) in ("Q8_0", "Q4_0", "Q4_1") for p in parts)]
    variants = {"before": before, "now": lambda parts, heads: try_exact_gguf(parts, (8, 32, True), heads)}
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            t = time.perf_counter()
            kept = [variants[name](parts, heads) for parts, heads in groups]
            runs[name].append(time.perf_counter() - t)
            del kept
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{Path(args.file).name}: {len(groups)} tensors, before {med['before']:.3f} s, now {med['now']:.3f} s "
          f"({med['before'] / med['now']:.2f}x)")
    if args.json:
        doc = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
               "file": Path(args.file).name, "tensors": len(groups), "median_s": med, "runs_s": runs}
        rows = json.loads(Path(args.json).read_text())["rows"] if Path(args.json).exists() else []
        rows = [r for r in rows if r["file"] != doc["file"]] + [doc]
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
