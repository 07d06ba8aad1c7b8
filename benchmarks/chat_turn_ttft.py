"""TTFT of a chat turn: N new prompt tokens after a P-token prefix both engines hold in their KV cache (a follow-up
message in a conversation), and of a short first prompt (P = 0), edgellm `--weights auto` against llama.cpp on the
same GGUF, one process per engine and file, 2 threads.

    python benchmarks/chat_turn_ttft.py FILE.gguf ... --peer-python /tmp/peer/bin/python [--prefix 1500]
        [--new 1,4,8,16,24,40,64,128] [--runs 5] [--eager-too] [--json benchmarks/results/chat-turn-ttft.json]

Each point: the prefix prefilled and cached (not timed), then the first token of prefix + N tokens of GPL-3 text
timed (median of --runs). edgellm reuses the cached prefix through Engine.generate; llama.cpp through
llama-cpp-python's generate(reset=True), which keeps the longest common prefix of its cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from run_record import CHILD_ENV, write_run  # benchmarks/, this script's folder

TEXT, CTX, THREADS = "/usr/share/common-licenses/GPL-3", 2560, 2


def child(engine: str, path: str, prefix: int, news: list[int], runs: int) -> dict:
    """{N: median seconds to the first token of prefix + N tokens, the prefix cached}. engine: edgellm,
    edgellm-eager (generate.FUSED_PREFILL off) or llama.cpp."""
    if engine.startswith("edgellm"):
        import torch

        from edgellm import generate
        from edgellm.args import engine_from_args, load_from_args

        generate.FUSED_PREFILL = engine != "edgellm-eager"
        from edgellm.cli import build_parser
        from edgellm.generate import GenerationSettings

        args = build_parser().parse_args(["run", "x", "-m", path, "--ctx", str(CTX), "--threads", str(THREADS)])
        loaded = load_from_args(args)
        eng = engine_from_args(args, loaded)
        ids = loaded.tokenizer.encode(open(TEXT).read())
        with torch.inference_mode():  # an answer decoded before the turns, as in a chat (it builds the decode step)
            for _ in eng.generate(ids[:8], GenerationSettings(max_tokens=4, ignore_eos=True)):
                pass

        def first_token(prompt: list[int]) -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                for _ in eng.generate(prompt, GenerationSettings(max_tokens=1, ignore_eos=True)):
                    pass
            return time.perf_counter() - t

        def reset() -> None:
            eng.reset()
    else:
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=CTX, n_batch=512,
                    verbose=False, seed=0)
        ids = llm.tokenize(open(TEXT).read().encode())

        def first_token(prompt: list[int]) -> float:
            t = time.perf_counter()
            for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # reset=True: the cached prefix is kept
                return time.perf_counter() - t
            return time.perf_counter() - t

        def reset() -> None:
            llm.reset()

    def point(n: int) -> float:
        reset()
        if prefix:
            first_token(ids[:prefix])
        return first_token(ids[:prefix + n])

    point(news[0])  # warm-up
    return {str(n): statistics.median(point(n) for _ in range(runs)) for n in news}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--prefix", type=int, default=1500)
    ap.add_argument("--new", default="1,4,8,16,24,40,64,128")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--eager-too", action="store_true",
                    help="also edgellm with every prompt part through the eager model (generate.FUSED_PREFILL off)")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    news = [int(n) for n in args.new.split(",")]
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.prefix, news, args.runs)))
        return
    rows = []
    for f in args.files:
        row = {"file": Path(f).name, "prefix": args.prefix}
        engines = [("edgellm", sys.executable)] + ([("edgellm-eager", sys.executable)] if args.eager_too else [])
        for engine, python in engines + [("llama.cpp", args.peer_python)]:
            out = subprocess.run([python, __file__, "--child", engine, f, "--prefix", str(args.prefix), "--new",
                                  args.new, "--runs", str(args.runs)], capture_output=True, text=True, env=CHILD_ENV)
            if out.returncode != 0:
                raise SystemExit(f"{engine} on {f}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
            row[engine] = json.loads(out.stdout.strip().splitlines()[-1])
        row["ratio"] = {n: row["edgellm"][n] / row["llama.cpp"][n] for n in row["edgellm"]}
        if args.eager_too:
            row["fused_vs_eager"] = {n: row["edgellm"][n] / row["edgellm-eager"][n] for n in row["edgellm"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        write_run(args.json, rows, THREADS, ctx=CTX)


if __name__ == "__main__":
    main()
