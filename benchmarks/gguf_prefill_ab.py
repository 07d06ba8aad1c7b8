"""TTFT of a GGUF model under two settings of kernels/gguf_ops.py, in one process, runs interleaved (robust to a
loaded machine).

    python benchmarks/gguf_prefill_ab.py [-m /work/ggufs/random1b.Q4_K_M.gguf] [--tokens 512] [--runs 3]
                                         [--threads 2] [--compare table|gemm|causal|pointwise|rows|amx|amx-attention] [--json FILE]

--compare table: setting A is `--a` (default: the table before the per-256 K-quant kernels, which sent prompts of
more than 64 / 32 rows to dequantize + GEMM), setting B kernels/gguf_ops.py's GGUF_KERNEL_MAX_ROWS as committed,
both with the prompt GEMM off.
--compare causal: A = the prefill's own keys through torch's flash kernel (attention.CPU_CAUSAL_KERNEL = False),
B = through kernels/cpu_attention.cpp.
--compare pointwise: A = RMSNorm and the MLP's gated activation as torch ops (kernels/pointwise.ENABLED = False),
B = one C++ pass each (kernels/cpu_pointwise.cpp).
--compare rows: A = every prompt row through the last layer (model.SKIP_UNUSED_ROWS = False), B = the last layer's
attention output and MLP for the last row only (the others need only their K/V there).
--compare gemm: A = the prompt GEMM off (gguf_ops.PROMPT_GEMM = False: the row kernel up to GGUF_KERNEL_MAX_ROWS,
then dequantize + fp32 GEMM, as before the prompt GEMM; matmul.QUANT_PROMPT_GEMM = False: the tensors loaded as our
int8 / int4 (Q8_0, Q4_0, Q4_1) on the int kernel / GEMM by matmul's table), B = on (gguf_linear_prompt and
quant_linear_prompt above 16 rows).
--compare amx: A = the AMX kernel off (gguf_ops.AMX_GEMM = False: the prompt GEMM takes every prefill), B = on (prefills of
gguf_ops.AMX_MIN_ROWS rows or more on AMX tiles, where the CPU has them).
--compare amx-attention: A = the causal kernel in fp32 (attention.AMX_ATTENTION = False), B = its AMX path.
The prompt is GPL-3 text, as benchmarks/gguf_vs_llamacpp.py's; prompts past edgellm.device.prefill_chunk's rows run in chunks.
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

TEXT = "/usr/share/common-licenses/GPL-3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/work/ggufs/random1b.Q4_K_M.gguf")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--a", default="Q4_K=64,Q5_K=32,Q6_K=32", help="setting A's table, TYPE=ROWS comma list")
    ap.add_argument("--compare", choices=["table", "gemm", "causal", "pointwise", "rows", "amx", "amx-attention"],
                    default="table")
    ap.add_argument("--isa", choices=["avx2", "scalar"], default=None, help="another kernel build than the best")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from edgellm.bench import run_once
    from edgellm.args import engine_from_args, load_from_args
    from edgellm.cli import build_parser
    from edgellm.kernels import gguf_ops

    cli = build_parser().parse_args(["run", "x", "-m", args.model, "--ctx", str(args.tokens + 64), "--threads",
                                     str(args.threads)])
    loaded = load_from_args(cli)
    from edgellm.kernels import matmul
    if args.isa:
        from edgellm.kernels.cpu_ext import ExtensionSettings
        matmul.configure_cpu_extension(ExtensionSettings(isa=args.isa))
    ext = matmul.cpu_extension()
    isa = ext.isa() if ext is not None else None
    if args.isa and isa != args.isa:
        raise SystemExit(f"asked for the {args.isa} build, got {isa}")
    engine = engine_from_args(cli, loaded)
    text = open(TEXT).read()
    while len(loaded.tokenizer.encode(text)) < args.tokens:
        text += "\n" + text
    ids = loaded.tokenizer.encode(text)[:args.tokens]
    assert len(ids) == args.tokens
    table_b = dict(gguf_ops.GGUF_KERNEL_MAX_ROWS)
    table_a = {k: int(v) for k, v in (kv.split("=") for kv in args.a.split(",") if kv)}
    gemm, causal, fused = args.compare == "gemm", args.compare == "causal", args.compare == "pointwise"
    rows, amx, amx_att = args.compare == "rows", args.compare == "amx", args.compare == "amx-attention"
    if args.compare != "table":
        table_a = table_b
    prompt_gemm = gguf_ops.PROMPT_GEMM
    from edgellm import model as model_module
    from edgellm.kernels import attention, pointwise

    def prompt_gemm_on(name: str) -> bool:  # off in both settings of the table comparison, and in A of --compare gemm
        return args.compare != "table" and (not gemm or name == "B")

    def setting(name: str) -> None:
        gguf_ops.GGUF_KERNEL_MAX_ROWS.clear()
        gguf_ops.GGUF_KERNEL_MAX_ROWS.update(table_a if name == "A" else table_b)
        gguf_ops.PROMPT_GEMM = matmul.QUANT_PROMPT_GEMM = prompt_gemm_on(name)
        gguf_ops.AMX_GEMM = not amx or name == "B"
        attention.AMX_ATTENTION = not amx_att or name == "B"
        model_module.SKIP_UNUSED_ROWS = not rows or name == "B"
        attention.CPU_CAUSAL_KERNEL = not causal or name == "B"
        pointwise.ENABLED = not fused or name == "B"

    for name in ("A", "B"):  # warm-up (both paths' buffers)
        setting(name)
        run_once(engine, ids[:64], 1)
    times: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}  # process CPU time of the run (all threads)
    for r in range(args.runs):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            setting(name)
            c0 = time.process_time()
            times[name].append(run_once(engine, ids, 1)[0].ttft_s)
            cpu[name].append(time.process_time() - c0)
            print(name, f"{times[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s CPU", flush=True)
    gguf_ops.GGUF_KERNEL_MAX_ROWS.clear()
    gguf_ops.GGUF_KERNEL_MAX_ROWS.update(table_b)
    gguf_ops.PROMPT_GEMM = matmul.QUANT_PROMPT_GEMM = prompt_gemm
    gguf_ops.AMX_GEMM = attention.AMX_ATTENTION = True
    attention.CPU_CAUSAL_KERNEL = pointwise.ENABLED = model_module.SKIP_UNUSED_ROWS = True
    res = {k: {"median_s": statistics.median(v), "min_s": min(v), "runs_s": v,
               "cpu_median_s": statistics.median(cpu[k]), "cpu_runs_s": cpu[k]} for k, v in times.items()}
    print(f"A {table_a}{' prompt GEMM off' if gemm else ''}{' causal kernel off' if causal else ''}"
          f"{' torch pointwise ops' if fused else ''}{' every row through the last layer' if rows else ''}"
          f"{' AMX kernel off' if amx else ''}{' fp32 attention' if amx_att else ''}: "
          f"{res['A']['median_s']:.2f} s   "
          f"B {table_b}{' prompt GEMM on' if gemm else ''}: {res['B']['median_s']:.2f} s   "
          f"B/A = {res['B']['median_s'] / res['A']['median_s']:.2f} (min {res['B']['min_s'] / res['A']['min_s']:.2f}, "
          f"CPU time {res['B']['cpu_median_s'] / res['A']['cpu_median_s']:.2f})")
    if args.json:
        doc = {"command": " ".join(["python", "benchmarks/gguf_prefill_ab.py", *sys.argv[1:]]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "load_average": os.getloadavg(), "model": args.model, "kernel_isa": isa, "tokens": args.tokens,
               "threads": args.threads, "compare": args.compare,
               "A": {"max_rows": table_a, "prompt_gemm": prompt_gemm_on("A"), "amx": not amx,
                     "amx_attention": not amx_att,
                     "causal_kernel": not causal,
                     "pointwise": not fused, "skip_unused_rows": not rows, **res["A"]},
               "B": {"max_rows": table_b, "prompt_gemm": prompt_gemm_on("B"), "amx": True,
                     "amx_attention": True,
                     "causal_kernel": True,
                     "pointwise": True, "skip_unused_rows": True, **res["B"]}}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
