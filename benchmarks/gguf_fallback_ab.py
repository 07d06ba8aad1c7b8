"""GGUF types without a kernel (Q2_K, IQ*): their matrix parts requantized to Q8_0 at load (edgellm.loading.
REQUANTIZE_WITHOUT_KERNEL, the `--weights auto` default) against dequantized to fp32 (what auto did before), one
fresh process per variant and round, the variants alternating:

    python benchmarks/gguf_fallback_ab.py /work/ggufs/SmolLM2-135M-Instruct.Q2_K.gguf [--rounds 2] [--json F [--merge]]

`--variants q8_0,q8_0-numpy` (or q8_0-whole): the IQ / TQ types requantized by the C++ converter (quant/gguf_grid.py,
the default) against gguf.quants' numpy in chunks of rows on threads (loading.REQUANTIZE_ROWS / _THREADS), or
gguf.quants with each tensor whole on one thread (before either).
Files of IQ types llama.cpp quantizes only with an importance
matrix: benchmarks/random_blocks_gguf.py.

`--variants native,native-grid`: IQ2_XXS / IQ3_XXS / IQ3_S recoded at load as IQ4_XS blocks over their levels (l4,
quant/gguf_linear.GRID_LAYOUT, the default) against multiplied through their grids.

`--variants native,q6_k` on an IQ1_S / IQ1_M file: recoded as L4 (per 16) blocks against the Q6_K blocks of their
values (their form off the CPU).

`--variants native,q8_0` on an IQ1_S / IQ1_M / TQ1_0 / TQ2_0 / IQ2_XS / IQ2_S file: IQ1_S recoded at load as L4
blocks (the CPU default), IQ2_XS / IQ2_S as L4 blocks with a scale per 16 values, IQ1_M rewritten as Q6_K blocks, the
ternary types as Q2_K blocks, against all requantized to Q8_0 (before).

`--as-without Q3_K --variants native,q8_0`: a type that has kernels run as stored ("native") against treated as one
without (its parts requantized to Q8_0 as before it had kernels; through gguf.quants' numpy, so that variant's load
time is not the C++ requantizer's).

Per variant: load time, peak RSS (wait4), decode tok/s (64 greedy tokens after a short chat prompt, median of 3),
TTFT of a 512-token prompt (median of 2), 2 threads, --ctx 2560 as benchmarks/gguf_vs_llamacpp.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from run_record import run_child  # noqa: E402  (benchmarks/, this script's folder)

TEXT = "/usr/share/common-licenses/GPL-3"
VARIANTS = ("native", "native-grid", "q6_k", "q8_0", "q8_0-numpy", "q8_0-whole", "fp32")


def child(path: str, variant: str, as_without: list[str]) -> None:
    import time
    import warnings

    t0 = time.perf_counter()
    from edgellm import loading
    from edgellm.args import engine_from_args, load_from_args
    from edgellm.bench import run_once
    from edgellm.cli import build_parser

    if variant == "fp32":
        loading.REQUANTIZE_WITHOUT_KERNEL = False
    if variant == "q8_0-whole":
        loading.REQUANTIZE_ROWS, loading.REQUANTIZE_THREADS = 1 << 40, 1
    if variant in ("q8_0-numpy", "q8_0-whole"):
        from edgellm.quant import gguf_grid

        gguf_grid.convert = lambda *args, **kwargs: None  # no C++ converter: gguf.quants' numpy
    if variant == "q6_k":  # IQ1_S / IQ1_M as the loader's Q6_K blocks of their values, not recoded as L4
        from edgellm.quant import gguf_linear

        gguf_linear.cpu_recoded_types = lambda device: frozenset()
    if variant.startswith("q8_0"):  # IQ1_S and TQ* requantized to Q8_0 (what the loader did before), not recoded as
        # L4 / rewritten as Q2_K
        from edgellm.quant import gguf_grid, gguf_linear, gguf_tensor

        gguf_linear.cpu_recoded_types = lambda device: frozenset()
        gguf_tensor.STORED_TYPES = gguf_tensor.NATIVE_TYPES  # (IQ2_XS / IQ2_S: not kept as stored either)
        gguf_grid.TERNARY_TYPES, gguf_grid.IQ1_TYPES = {}, {}
    if variant == "native-grid":  # the grid i-quants multiplied through their grids, not recoded (l4)
        from edgellm.quant import gguf_linear

        gguf_linear.GRID_LAYOUT = "stored"
    if not variant.startswith("native") and as_without:
        from edgellm.quant import gguf_tensor

        gguf_tensor.STORED_TYPES = gguf_tensor.STORED_TYPES - set(as_without)  # (what the loader keeps as blocks)
    args = build_parser().parse_args(["run", "x", "-m", path, "--ctx", "2560", "--threads", "2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_from_args(args)
    engine = engine_from_args(args, loaded)
    load_s = time.perf_counter() - t0
    tok = loaded.tokenizer
    chat = tok.encode_chat([{"role": "user", "content": "Tell me a random fun fact about the Roman Empire"}])
    text = tok.encode(open(TEXT).read())[:512]
    run_once(engine, chat, 8)
    decode = [run_once(engine, chat, 64)[0].decode_tok_s for _ in range(3)]
    ttft = [run_once(engine, text, 1)[0].ttft_s for _ in range(2)]
    print(json.dumps({"load_s": load_s, "decode_tok_s": statistics.median(decode), "ttft_512_s": statistics.median(ttft),
                      "runs_as": loaded.runs_as_text()}))


def measure(path: str, variant: str, as_without: list[str]) -> dict:
    code, out, err, peak = run_child([sys.executable, __file__, "--child", path, variant, ",".join(as_without)])
    if code != 0:
        raise SystemExit(f"{variant} failed: {err[-2000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    row["peak_rss_bytes"] = peak
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], [t for t in sys.argv[4].split(",") if t])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the --json file's rows of other files")
    ap.add_argument("--variants", default="q8_0,fp32", help=f"two of {', '.join(VARIANTS)}: the first over the second")
    ap.add_argument("--as-without", default="", help="native types to treat as without a kernel, e.g. Q3_K")
    args = ap.parse_args()
    variants = tuple(args.variants.split(","))
    assert len(variants) == 2 and set(variants) <= set(VARIANTS), args.variants
    as_without = [t for t in args.as_without.split(",") if t]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            runs[v].append(measure(args.file, v, as_without))
            print(v, runs[v][-1], flush=True)
    med = {v: {k: statistics.median(x[k] for x in runs[v]) for k in ("load_s", "decode_tok_s", "ttft_512_s",
                                                                     "peak_rss_bytes")} | {"runs_as": runs[v][0]["runs_as"]}
           for v in variants}
    a, b = variants
    ratio = {k: med[a][k] / med[b][k] for k in ("load_s", "decode_tok_s", "ttft_512_s", "peak_rss_bytes")}
    print(f"{a} / {b}:", json.dumps(ratio))
    if args.json:
        path = Path(args.json)
        row = {"file": Path(args.file).name, "file_bytes": os.path.getsize(args.file),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "load_average": os.getloadavg(), "rounds": args.rounds, "as_without": as_without, **med,
               f"{a}_over_{b}": ratio, "runs": runs}
        rows = [row]
        if args.merge and path.exists():
            rows = [r for r in json.loads(path.read_text())["rows"] if r["file"] != row["file"]] + rows
        doc = {"what": "GGUF types without a kernel: matrix parts requantized to Q8_0 at load (the --weights auto default) "
                       "vs dequantized to fp32 (before), or by the C++ converter vs gguf.quants' numpy in chunks of rows on "
                       "threads (q8_0-numpy) or whole (q8_0-whole), or "
                       "(as_without) a native type as stored vs requantized to Q8_0; fresh processes alternating",
               "command": " ".join(["python", "benchmarks/gguf_fallback_ab.py", *sys.argv[1:]]), "rows": rows}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)


if __name__ == "__main__":
    main()
