"""llama.cpp (llama-cpp-python) on one GGUF, in a child process of `edgellm bench --against llama.cpp`: its peak RSS
is then its own (ours stays ours), and its load and runs are not slowed by our process. Imports nothing of edgellm
and no torch, so the child's memory is llama.cpp's and Python's alone.

    python -m edgellm.llama_cpp_peer < job.json

job: {"path", "prompts": {context: [token ids]}, "n", "reps", "warmup", "threads", "n_ctx", "gpu"}. Prints "tick"
after every run (the parent's progress bar), then one line "result {json}": per context, each measured run's TTFT
and the times of its tokens, and the process's peak RSS. Failures print "missing <why>" (llama_cpp does not import)
or "error <why>" and exit non-zero.
"""
from __future__ import annotations

import json
import sys
import time

# VmHWM: per address space, so it starts at this exec (ru_maxrss would keep the forking parent's)
from edgellm.rss import process_peak_rss


def run(job: dict) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=job["path"], n_threads=job["threads"], n_threads_batch=job["threads"],
                          n_ctx=job["n_ctx"], n_batch=512, n_gpu_layers=-1 if job["gpu"] else 0, seed=0,
                          verbose=False)

    def once(ids: list[int]) -> dict:
        llm.reset()  # no prefix reuse: a full prefill, as ours
        t0 = time.perf_counter()
        times = []
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter() - t0)
            if len(times) >= job["n"]:
                break
        print("tick", flush=True)
        return {"ttft_s": times[0], "token_times_s": times}

    contexts = {}
    for c, ids in job["prompts"].items():
        for _ in range(job["warmup"]):
            once(ids)
        contexts[c] = [once(ids) for _ in range(job["reps"])]
    return {"contexts": contexts, "peak_rss_bytes": process_peak_rss()}


def main() -> int:
    job = json.load(sys.stdin)
    try:
        result = run(job)
    except ImportError as e:
        print("missing", e, flush=True)
        return 2
    except Exception as e:  # noqa: BLE001 — reported to the parent, which keeps its own rows
        print("error", f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)
        return 1
    print("result", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
