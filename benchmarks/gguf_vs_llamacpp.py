"""edgellm `--weights auto` against llama.cpp on the same GGUF files, side by side, one process per engine and
file (so each peak RSS is that engine's alone), the engines interleaved file by file.

    python benchmarks/gguf_vs_llamacpp.py FILE.gguf [FILE.gguf ...] --peer-python /tmp/peer/bin/python \
        [--rounds 3] [--json benchmarks/results/gguf-vs-llamacpp.json [--merge]]

Per file and engine: load time (file → ready), peak RSS (the child's ru_maxrss), decode tok/s (128 greedy tokens
after a short chat prompt, median of 3), TTFT of a 512- and a 2048-token prompt (GPL-3 text, median of 3 / 2),
2 threads each. The peer needs llama-cpp-python (see ../shared/peers/README.md); make the test files with
benchmarks/make_gguf_files.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from run_record import CHILD_ENV, run_child  # benchmarks/, this script's folder

TEXT = "/usr/share/common-licenses/GPL-3"
CHAT = "Tell me a random fun fact about the Roman Empire"
CTX = 2560
THREADS = 2
# ratio name → the metric of both engines' results it divides (edgellm's by llama.cpp's)
RATIOS = {"decode": "decode_tok_s", "ttft_512": "ttft_512_s", "ttft_2048": "ttft_2048_s", "rss": "peak_rss_bytes",
          "load": "load_s"}


def run_args(path: str) -> list[str]:
    """The `edgellm` command line the edgellm child runs as."""
    return ["run", "x", "-m", path, "--ctx", str(CTX), "--threads", str(THREADS)]


def child_edgellm(path: str, mode: str, t0: float) -> dict:
    from edgellm.bench import run_once
    from edgellm.args import engine_from_args, load_from_args
    from edgellm.cli import build_parser

    args = build_parser().parse_args(run_args(path))
    loaded = load_from_args(args)
    engine = engine_from_args(args, loaded)
    tok = loaded.tokenizer
    load_s = time.perf_counter() - t0
    if mode == "load":
        return {"load_s": load_s}
    text_ids = tok.encode(open(TEXT).read())
    chat_ids = tok.encode_chat([{"role": "user", "content": CHAT}])
    run_once(engine, chat_ids, 8)  # warm-up: lazy kernel builds, first-touch of the weights
    decode = [run_once(engine, chat_ids, 128)[0].decode_tok_s for _ in range(3)]
    if mode == "decode":
        return {"load_s": load_s, "decode_tok_s": statistics.median(decode), "runs_as": loaded.runs_as_text()}
    ttft512 = [run_once(engine, text_ids[:512], 1)[0].ttft_s for _ in range(3)]
    ttft2048 = [run_once(engine, text_ids[:2048], 1)[0].ttft_s for _ in range(2)]
    return {"load_s": load_s, "decode_tok_s": statistics.median(decode), "ttft_512_s": statistics.median(ttft512),
            "ttft_2048_s": statistics.median(ttft2048), "runs_as": loaded.runs_as_text(),
            "path": str(engine.decode_path)}


def child_llamacpp(path: str, mode: str, t0: float) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=CTX, n_batch=512, verbose=False,
                seed=0)
    load_s = time.perf_counter() - t0
    if mode == "load":
        return {"load_s": load_s}
    text_ids = llm.tokenize(open(TEXT).read().encode())
    chat_ids = llm.tokenize(f"<|im_start|>user\n{CHAT}<|im_end|>\n<|im_start|>assistant\n".encode(), special=True)

    def run(ids, n):
        llm.reset()
        t = time.perf_counter()
        times = []
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) >= n:
                break
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return times[0] - t, rate

    run(chat_ids, 8)
    decode = [run(chat_ids, 128)[1] for _ in range(3)]
    if mode == "decode":
        return {"load_s": load_s, "decode_tok_s": statistics.median(decode)}
    ttft512 = [run(text_ids[:512], 1)[0] for _ in range(3)]
    ttft2048 = [run(text_ids[:2048], 1)[0] for _ in range(2)]
    return {"load_s": load_s, "decode_tok_s": statistics.median(decode), "ttft_512_s": statistics.median(ttft512),
            "ttft_2048_s": statistics.median(ttft2048)}


# The children run with Python's bytecode cache (run_record.CHILD_ENV: llama-cpp-python's modules come compiled by
# pip, edgellm's editable install's would be compiled from source on every start); `warm_bytecode` writes the
# caches once before any timing.
def warm_bytecode(python: str) -> None:
    subprocess.run([python, "-c", "import edgellm.args, edgellm.bench, edgellm.cli, edgellm.loading, edgellm.tokenizer, "
                    "edgellm.quant.gguf_linear, edgellm.quant.convert, edgellm.kernels.cpu_decode"],
                   env=CHILD_ENV, check=True)


def measure(python: str, engine: str, path: str, mode: str = "full", env: dict[str, str] | None = None) -> dict:
    """One engine on one file in a fresh process (mode: full | decode | load): its JSON line plus its own peak RSS
    (wait4's rusage)."""
    code, out, err, peak = run_child([python, __file__, "--child", engine, path, "--mode", mode], env)
    if code != 0:
        return {"error": (err.strip().splitlines() or ["?"])[-1]}
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_bytes"] = peak
    return result


def _median_run(runs: list[dict]) -> dict:
    """One engine's runs on a file → each numeric metric's median (the text fields of the first run)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in ok)
    return out


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    return sorted(x for x in flags if x.startswith(("avx", "fma", "f16c", "amx")))


def write_doc(path: str, rows: list[dict], **fields) -> None:
    """{command, date, machine (cpu, cores, SIMD flags: no torch import in this parent), **fields, rows}, written
    atomically."""
    doc = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "flags": cpu_flags()}, **fields, "rows": rows}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--json", default=None)
    ap.add_argument("--note", default=None, help="a line kept in the --json file (how the peer was built, say)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the --json file's rows of other files (each row carries its own date and load)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each engine this many times per file, alternating which goes first; the row holds "
                         "each metric's median and the runs (a shared machine's memory bandwidth drifts)")
    ap.add_argument("--decode-only", action="store_true", help="load and decode only (no TTFT runs): quick "
                    "repeated rounds for the decode ratio")
    ap.add_argument("--load-only", action="store_true", help="file -> ready only (process start to a loaded "
                    "model and tokenizer): quick repeated rounds for the load ratio")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # load time: from here to a loaded model and tokenizer
        t0 = time.perf_counter()
        if args.child[0] == "edgellm":  # as the `edgellm` command starts (edgellm/entry.py): the file's read
            from edgellm.entry import import_frozen  # begun, then the CLI (and torch) imported, collector paused
            from edgellm.prefetch import model_files, prefetch
            from edgellm.torch_import import deferred_meta_kernels

            if os.environ.get("EDGELLM_PREFETCH") != "0":
                prefetch(model_files(Path(args.child[1])))
            if os.environ.get("EDGELLM_EARLY_REPACK") != "0":
                from edgellm import early_repack

                early_repack.start(run_args(args.child[1]))
            # Called from main(), as the command calls it from its main(): Python 3.11 keeps its frames in 16 KiB
            # chunks and unmaps one as soon as the stack leaves it, so a call tree going up and down across a
            # chunk's edge maps and unmaps it each time, and how often depends on the depth the import starts at.
            # From here, as from the command, ~850 times (strace); from one function deeper, 12,000-15,000 times:
            # +0.08 s of load the command does not have.
            with deferred_meta_kernels():
                import_frozen("edgellm.cli")
        fn = child_edgellm if args.child[0] == "edgellm" else child_llamacpp
        print(json.dumps(fn(args.child[1], args.mode, t0)))
        return
    warm_bytecode(sys.executable)
    rows = []
    for f in args.files:
        runs: dict[str, list[dict]] = {"edgellm": [], "llama.cpp": []}
        for r in range(args.rounds):
            order = [("edgellm", sys.executable), ("llama.cpp", args.peer_python)]
            for engine, python in (order if r % 2 == 0 else order[::-1]):
                mode = "load" if args.load_only else "decode" if args.decode_only else "full"
                runs[engine].append(measure(python, engine, f, mode))
        ours, theirs = (_median_run(runs[e]) for e in ("edgellm", "llama.cpp"))
        row = {"file": Path(f).name, "file_bytes": Path(f).stat().st_size, "edgellm": ours, "llama.cpp": theirs,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "load_average": [round(v, 2) for v in os.getloadavg()]}
        if args.rounds > 1:
            row["runs"] = runs
        if "error" not in ours and "error" not in theirs:
            measured = ("load",) if args.load_only else ("decode", "rss", "load") if args.decode_only else RATIOS
            row["ratio"] = {name: ours[key] / theirs[key] for name, key in RATIOS.items() if name in measured}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json and args.merge and Path(args.json).exists():
        done = {r["file"] for r in rows}
        rows = [r for r in json.loads(Path(args.json).read_text())["rows"] if r["file"] not in done] + rows
    if args.json:
        write_doc(args.json, rows, threads=THREADS, ctx=CTX, **({"note": args.note} if args.note else {}))


if __name__ == "__main__":
    main()
