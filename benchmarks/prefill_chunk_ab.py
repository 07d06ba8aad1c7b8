"""Prompt rows per forward pass on the CPU (edgellm.device.prefill_chunk): TTFT and peak RSS per chunk size.

    python benchmarks/prefill_chunk_ab.py -m /work/ggufs/random-qwen0.5b.Q4_K_M.gguf [--chunks 512,256,128]
                                          [--tokens 512,2048] [--runs 5] [--json benchmarks/results/F.json [--merge]]

TTFT: one process, one engine, the chunk sizes interleaved run by run (robust to a loaded machine), GPL-3 text.
Peak RSS: per chunk size a fresh process (load, a 64-token warm-up, then the longest prompt once), its wait4 peak,
as benchmarks/gguf_vs_llamacpp.py measures it (same --ctx 2560, 2 threads).
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

from run_record import run_child  # noqa: E402  (benchmarks/, this script's folder)

TEXT = "/usr/share/common-licenses/GPL-3"
CTX, THREADS = 2560, 2


def _engine(model: str):
    from edgellm.args import engine_from_args, load_from_args
    from edgellm.cli import build_parser

    cli = build_parser().parse_args(["run", "x", "-m", model, "--ctx", str(CTX), "--threads", str(THREADS)])
    loaded = load_from_args(cli)
    return loaded, engine_from_args(cli, loaded)


def _prompt(tokenizer, n: int) -> list[int]:
    text = open(TEXT).read()
    while len(tokenizer.encode(text)) < n:
        text += "\n" + text
    return tokenizer.encode(text)[:n]


def _force_chunk(rows: int) -> None:
    from edgellm import device

    device.PREFILL_CHUNK = device.CPU_MIN_PREFILL_CHUNK = rows


def child(model: str, chunk: int, tokens: int) -> None:
    _force_chunk(chunk)
    loaded, engine = _engine(model)
    engine.prefill(_prompt(loaded.tokenizer, 64))
    engine.reset()
    engine.prefill(_prompt(loaded.tokenizer, tokens))
    print(json.dumps({"ok": True}))


def peak_rss(model: str, chunk: int, tokens: int) -> int:
    code, out, err, peak = run_child([sys.executable, __file__, "--child", model, str(chunk), str(tokens)])
    if code != 0:
        raise SystemExit(f"child failed: {err[-2000:]}")
    assert '"ok"' in out
    return peak


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/work/ggufs/random-qwen0.5b.Q4_K_M.gguf")
    ap.add_argument("--chunks", default="512,256")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the --json file's rows of other models")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    lengths = [int(n) for n in args.tokens.split(",")]

    rss = {c: peak_rss(args.model, c, max(lengths)) for c in chunks}
    for c in chunks:
        print(f"chunk {c}: peak RSS {rss[c] / 2**20:.0f} MiB", flush=True)

    loaded, engine = _engine(args.model)
    prompts = {n: _prompt(loaded.tokenizer, n) for n in lengths}
    engine.prefill(prompts[lengths[0]])  # warm-up
    ttft: dict[int, dict[int, list[float]]] = {n: {c: [] for c in chunks} for n in lengths}
    for r in range(args.runs):
        for n in lengths:
            for c in (chunks if r % 2 == 0 else chunks[::-1]):
                _force_chunk(c)
                engine.reset()
                t = time.perf_counter()
                engine.prefill(prompts[n])
                ttft[n][c].append(time.perf_counter() - t)
        print(f"run {r}: " + ", ".join(f"{n} tokens / chunk {c}: {ttft[n][c][-1]:.2f} s" for n in lengths
                                       for c in chunks), flush=True)
    base = chunks[0]
    row = {"model": args.model, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load_average": os.getloadavg(), "runs": args.runs, "threads": THREADS, "ctx": CTX,
           "peak_rss_bytes": {str(c): rss[c] for c in chunks},
           "ttft_s": {str(n): {str(c): {"median": statistics.median(ttft[n][c]), "runs": ttft[n][c]} for c in chunks}
                      for n in lengths},
           f"over_{base}": {str(c): {"peak_rss": rss[c] / rss[base],
                                     **{f"ttft_{n}": statistics.median(ttft[n][c]) / statistics.median(ttft[n][base])
                                        for n in lengths}} for c in chunks[1:]}}
    print(json.dumps(row[f"over_{base}"], indent=1))
    if args.json:
        path = Path(args.json)
        rows = [row]
        if args.merge and path.exists():
            rows = [r for r in json.loads(path.read_text())["rows"] if r["model"] != args.model] + rows
        doc = {"what": "CPU prompt chunk size (edgellm.device.prefill_chunk): TTFT interleaved in one process, peak "
                       "RSS of a fresh process per size (load + the longest prompt)",
               "command": " ".join(["python", "benchmarks/prefill_chunk_ab.py", *sys.argv[1:]]),
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "rows": rows}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)


if __name__ == "__main__":
    main()
