"""Whole-model CPU decode and TTFT of edgellm on the bundled SmolLM2-135M, beside llama.cpp on the same GGUF.

    python benchmarks/decode_cpu.py [--threads 2] [--formats fp,int8,int4] [-n 128] [-r 3]
                                    [--llama auto|off] [--out benchmarks/results/decode-cpu.json]

Per weight format, in a fresh process (so memory figures are its own):
  decode tok/s: 128 greedy tokens after a short chat prompt (the prompt of the llama.cpp peer script), EOS
      ignored, tokens 2..n over the time from the first to the last one, median of r runs; with the fused C++
      decode step (the default) and with the eager torch graph (`--no-fused` / `--compile off`'s path) for comparison;
  TTFT: a 512-token prompt (the start of /usr/share/common-licenses/GPL-3), cache reset, median of r runs;
  memory: resident set after loading and its peak after the prefills (int4 prefill dequantizes one layer at a
      time into a reused buffer: no float copy of the model is kept);
  the step's split (C++ timers): matmuls / attention / the rest of the step / Python around it.
llama.cpp (llama-cpp-python in /tmp/peer, the shared /work/shared/peers/bench_llamacpp.py: same GGUF, same
thread count, same two tests) runs between edgellm's int4 measurements, which are taken twice (before and
after it) because this machine is shared and its load drifts: ratios use the int4 run nearest in time.

"int8" requantizes the float weights to int8 groups of 32 (round to nearest; the GGUF's Q4_1 blocks would
otherwise be kept as they are, and its Q8_0 embedding/LM head is the same format), "int4" keeps the GGUF's
Q4_1 blocks exactly (asymmetric int4, groups of 32) and its Q8_0 LM head, as llama.cpp does.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHORT_PROMPT = ("<|im_start|>user\nTell me a random fun fact about the Roman Empire<|im_end|>\n"
                "<|im_start|>assistant\n")  # bench_llamacpp.py's decode prompt
TEXT = Path("/usr/share/common-licenses/GPL-3")
PEER_PY = Path("/tmp/peer/bin/python")
PEER_SCRIPT = Path("/work/shared/peers/bench_llamacpp.py")


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------ one format
def load(fmt: str):
    import torch

    from edgellm.loading import load_model

    if fmt == "int8":
        from edgellm.quant.linear import quantize_linears

        loaded = load_model(None, weights="fp", max_seq_len=2048)
        quantize_linears(loaded.model, 8, 32, search=False)
        return loaded
    return load_model(None, weights=fmt, max_seq_len=2048, dtype=torch.float32)


def decode_once(engine, ids: list[int], n: int) -> tuple[float, float]:
    """(decode tok/s, wall seconds per token from the first to the last token)."""
    from edgellm.generate import Done, GenerationSettings

    engine.reset()
    done = [e for e in engine.generate(ids, GenerationSettings(max_tokens=n, ignore_eos=True))
            if isinstance(e, Done)][0]
    st = done.stats
    return st.decode_tok_s, st.decode_s / max(1, len(st.token_latencies_s))


def ttft_once(engine, ids: list[int]) -> float:
    from edgellm.generate import Done, GenerationSettings

    engine.reset()
    done = [e for e in engine.generate(ids, GenerationSettings(max_tokens=1, ignore_eos=True))
            if isinstance(e, Done)][0]
    return done.stats.ttft_s


def run_format(fmt: str, n: int, reps: int, threads: int, eager: bool) -> dict:
    import torch

    from edgellm.bench import weight_bytes
    from edgellm.generate import Engine

    torch.set_num_threads(threads)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    loaded = load(fmt)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_bytes()
    tok = loaded.tokenizer
    engine = Engine(loaded.model, tok, max_seq_len=2048)
    short = tok.backend.encode(SHORT_PROMPT, add_special_tokens=False).ids
    long = tok.encode(TEXT.read_text(encoding="utf-8"))[:512]
    mem_bytes, read_bytes = weight_bytes(loaded.model)
    out: dict = {"format": fmt, "load_s": round(load_s, 2), "weight_bytes": mem_bytes,
                 "weight_bytes_read_per_token": read_bytes, "short_prompt_tokens": len(short),
                 "fused_decode_available": engine.compiled_step() is not None}
    with torch.inference_mode():
        decode_once(engine, short, 16)  # warm-up: builds the extension's plan, faults pages in
        runs = [decode_once(engine, short, n) for _ in range(reps)]
        out["decode_tok_s"] = [round(r[0], 2) for r in runs]
        out["decode_tok_s_median"] = round(statistics.median(r[0] for r in runs), 2)
        if eager:
            engine.compile_mode = "off"
            decode_once(engine, short, 8)
            er = [decode_once(engine, short, n) for _ in range(max(1, reps - 1))]
            engine.compile_mode = "auto"
            out["eager_decode_tok_s"] = [round(r[0], 2) for r in er]
            out["eager_decode_tok_s_median"] = round(statistics.median(r[0] for r in er), 2)
        ttfts = [ttft_once(engine, long) for _ in range(reps)]
        out["ttft_512_s"] = [round(t, 3) for t in ttfts]
        out["ttft_512_s_median"] = round(statistics.median(ttfts), 3)
        out["prefill_tok_s"] = round(512 / out["ttft_512_s_median"], 1)
        # where a decoded token's time goes (C++ timers inside the fused step; the rest is Python around it)
        fused = engine.compiled_step()
        if fused is not None:
            fused.plan.set_profile(True)
            tok_s, per_tok = decode_once(engine, short, n)
            prof = fused.plan.profile()
            fused.plan.set_profile(False)
            steps = max(1, prof["steps"])
            split = {k: prof[k] / steps for k in ("matmul_s", "attention_s", "other_s")}
            split["python_and_sampling_s"] = max(0.0, per_tok - sum(split.values()))
            total = sum(split.values())
            out["step_split_ms"] = {k.removesuffix("_s") + "_ms": round(v * 1e3, 3) for k, v in split.items()}
            out["step_split_fraction"] = {k.removesuffix("_s"): round(v / total, 3) for k, v in split.items()}
    out["rss_before_load_bytes"] = rss0
    out["rss_after_load_bytes"] = rss_loaded
    out["rss_peak_bytes"] = peak_rss_bytes()
    return out


# ------------------------------------------------------------------------------------------------ driver
def child(args: argparse.Namespace, fmt: str) -> dict:
    cmd = [sys.executable, __file__, "--single", fmt, "-n", str(args.n), "-r", str(args.reps),
           "--threads", str(args.threads)] + (["--eager"] if args.eager else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{fmt} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_cpp(gguf: Path, threads: int) -> dict | None:
    if not (PEER_PY.exists() and PEER_SCRIPT.exists()):
        return None
    if subprocess.run([str(PEER_PY), "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        return None
    if threads != 2:
        print("note: the peer script runs llama.cpp with 2 threads", file=sys.stderr)
    t0 = time.time()
    proc = subprocess.run([str(PEER_PY), str(PEER_SCRIPT), str(gguf)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"llama.cpp run failed: {proc.stderr[-500:]}", file=sys.stderr)
        return None
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.time() - t0, 1)
    try:
        import importlib.metadata as md

        res["llama_cpp_python"] = subprocess.run(
            [str(PEER_PY), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
            text=True).stdout.strip() or md.version("llama-cpp-python")
    except Exception:  # noqa: BLE001
        pass
    return res


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# Decode and TTFT on CPU — bundled SmolLM2-135M-Instruct (Q4_1 GGUF), {doc['threads']} threads", "",
             "```", doc["command"], "```", "",
             f"{m['cpu']} · {m['cores_logical']} cores · torch {m['torch']} · {m['date']} · load average before/after "
             f"{doc['load_average_before']} / {doc['load_average_after']} · memory bandwidth (triad/copy, 256 MiB) "
             f"{doc['bandwidth_gbs']:.1f} GB/s", "",
             "| run | decode tok/s (fused) | decode tok/s (eager) | roofline tok/s | % roofline | TTFT 512 s | "
             "prefill tok/s | × llama.cpp decode | llama.cpp TTFT ÷ ours | weights MiB | RSS after load MiB | "
             "peak RSS MiB |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    ll = doc.get("llama_cpp")
    for r in doc["runs"]:
        dec, ttft = r["decode_tok_s_median"], r["ttft_512_s_median"]
        xd = f"{dec / ll['decode_tok_s_median']:.2f}" if ll else "–"
        xt = f"{ll['ttft_512_s_median'] / ttft:.2f}" if ll else "–"
        lines.append(f"| {r['label']} | {dec:.1f} | {r.get('eager_decode_tok_s_median', float('nan')):.1f} | "
                     f"{r['roofline_tok_s']:.0f} | {100 * dec / r['roofline_tok_s']:.0f}% | {ttft:.2f} | "
                     f"{r['prefill_tok_s']:.0f} | {xd} | {xt} | {r['weight_bytes'] / 2**20:.0f} | "
                     f"{r['rss_after_load_bytes'] / 2**20:.0f} | {r['rss_peak_bytes'] / 2**20:.0f} |")
    if ll:
        lines.append(f"| llama.cpp {ll.get('llama_cpp_python', '')} | {ll['decode_tok_s_median']:.1f} | | | | "
                     f"{ll['ttft_512_s_median']:.2f} | {ll['prefill_tok_s']:.0f} | 1.00 | 1.00 | | | |")
    lines += ["", "Where a decoded token's time goes (fused step, C++ timers; ms per token, fraction):", "",
              "| run | matmul | attention | rest of the step | Python + sampling around it |", "|---|--:|--:|--:|--:|"]
    for r in doc["runs"]:
        if "step_split_ms" in r:
            s, f = r["step_split_ms"], r["step_split_fraction"]
            lines.append(f"| {r['label']} | {s['matmul_ms']:.2f} ({f['matmul']:.0%}) | {s['attention_ms']:.2f} "
                         f"({f['attention']:.0%}) | {s['other_ms']:.2f} ({f['other']:.0%}) | "
                         f"{s['python_and_sampling_ms']:.2f} ({f['python_and_sampling']:.0%}) |")
    lines += ["", doc["note"], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="fp,int8,int4")
    ap.add_argument("-n", type=int, default=128, help="tokens decoded per run")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--llama", choices=("auto", "off"), default="auto")
    ap.add_argument("--eager", action="store_true", default=True, help="also time the eager decode (default)")
    ap.add_argument("--no-eager", dest="eager", action="store_false")
    ap.add_argument("--single", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode-cpu.json"))
    args = ap.parse_args()
    if args.single:
        print(json.dumps(run_format(args.single, args.n, args.reps, args.threads, args.eager)))
        return

    import torch

    from edgellm.bench import machine_info, measure_bandwidth, roofline_tok_s
    from edgellm.loading import bundled_model_path

    torch.set_num_threads(args.threads)
    load_before = [round(v, 2) for v in os.getloadavg()]
    bw = measure_bandwidth(torch.device("cpu"))
    formats = [f for f in args.formats.split(",") if f]
    plan = formats + (["llama.cpp", "int4"] if args.llama == "auto" and "int4" in formats else [])
    runs, ll = [], None
    for i, fmt in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] {fmt} ...", file=sys.stderr, flush=True)
        if fmt == "llama.cpp":
            ll = llama_cpp(bundled_model_path(), args.threads)
            print(f"    {ll}", file=sys.stderr, flush=True)
            continue
        r = child(args, fmt)
        r["label"] = fmt if fmt not in [x["format"] for x in runs] else f"{fmt} (after llama.cpp)"
        # decode moves every weight once plus the K/V of the mean context (fp32 cache, 30 x 2 x 3 x 64 x 4 B)
        kv = 30 * 2 * 3 * 64 * 4 * (r["short_prompt_tokens"] + args.n / 2)
        r["roofline_tok_s"] = round(roofline_tok_s(bw["bandwidth_gbs"], r["weight_bytes_read_per_token"] + kv), 1)
        print(f"    decode {r['decode_tok_s_median']} tok/s (eager {r.get('eager_decode_tok_s_median')}), "
              f"TTFT {r['ttft_512_s_median']} s", file=sys.stderr, flush=True)
        runs.append(r)
    doc = {
        "benchmark": "decode-cpu",
        "command": " ".join(["python", "benchmarks/decode_cpu.py", *sys.argv[1:]]),
        "machine": machine_info(torch.device("cpu")),
        "threads": args.threads,
        "load_average_before": load_before,
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "bandwidth_gbs": round(bw["bandwidth_gbs"], 2),
        "model": "bundled SmolLM2-135M-Instruct.Q4_1.gguf",
        "runs": runs,
        "llama_cpp": ll,
        "note": ("decode: 128 greedy tokens after the peer script's short chat prompt, EOS ignored; TTFT: the first "
                 "512 tokens of GPL-3, cache reset; medians of the runs; 'eager' = the model's torch graph per "
                 "token (what the fused C++ step replaces); the machine is shared (see the load averages), so "
                 "compare ratios within this file only. int8 = float weights requantized to int8 g32; int4 = the "
                 "GGUF's Q4_1 blocks as they are; both with the Q8_0 LM head."),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if ll:
        near = [r for r in runs if r["format"] == "int4"]
        doc["ratios_vs_llama_cpp"] = {
            r["label"]: {"decode": round(r["decode_tok_s_median"] / ll["decode_tok_s_median"], 2),
                         "ttft": round(r["ttft_512_s_median"] / ll["ttft_512_s_median"], 2)} for r in runs}
        doc["int4_runs_bracketing_llama_cpp"] = [r["label"] for r in near]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)
    md = out.with_suffix(".md")
    md.write_text(markdown(doc), encoding="utf-8")
    print(markdown(doc))
    print(f"wrote {out} and {md}", file=sys.stderr)


if __name__ == "__main__":
    main()
