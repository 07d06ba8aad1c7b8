"""CPU weight-only matmul kernels at SmolLM2-135M's decode shapes, against fp32 and torch's int kernels.

    python benchmarks/kernels_cpu.py [--threads 2] [--rounds 7] [--out benchmarks/results/kernels-cpu.json]

Per token the model runs 30 x (fused QKV 960x576, O 576x576, fused gate+up 3072x576, down 576x1536) plus the
LM head 49152x576. Each method is timed per call from Python (so the figures include the call overhead the
model pays), methods interleaved round-robin and the median round kept, because the machine is shared.
"int-dot" is approach (a): x rounded to int8 per 32-block, integer dot products (llama.cpp's way);
"float-fma" is approach (b): weights dequantized to fp32 in registers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgellm.kernels.cpu_ext import get_extension  # noqa: E402

# (name, N = out features, K = in features, calls per token)
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]
LLAMA_CPP_MS_PER_TOKEN = 7.1  # llama.cpp Q4_1 decode on this machine class, ~140 tok/s (DESIGN.md)
INT_DOT, FLOAT_FMA = 1, 2


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def time_calls(fn: Callable[[], object], seconds: float = 0.02) -> tuple[int, float]:
    """(calls per measurement, first estimate in s) so one measurement lasts ~`seconds`."""
    fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-7)
    return max(1, min(2000, int(seconds / one))), one


def bench_round_robin(methods: dict[str, Callable[[], object]], rounds: int,
                      stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Median (or `stat`) over `rounds` of the mean microseconds per call, methods interleaved within each round."""
    plan = {name: time_calls(fn)[0] for name, fn in methods.items()}
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            n = plan[name]
            t = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t) / n * 1e6)
    return {name: stat(v) for name, v in samples.items()}


COLD_BYTES = 64 << 20  # each method cycles through weight copies totalling >= this: past the 36 MB L3


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    c = codes.view(n, k // 32, 2, 16)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def make_method(method: str, n: int, k: int, gen: torch.Generator, ext):
    """(bytes of weights per copy, factory: () -> (x -> y) over a fresh random copy of the weights)."""
    g = 32
    empty = torch.empty(0, dtype=torch.float16)

    def codes4():
        return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)

    def scales(cols=k // g):
        return (torch.rand(n, cols, generator=gen) * 0.01).half()

    def mins():
        return (-torch.rand(n, k // g, generator=gen) * 0.05).half()

    def codes8():
        return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)

    if method == "fp32 F.linear":
        def f():
            w = torch.randn(n, k, generator=gen)
            return lambda x: F.linear(x, w)
    elif method == "torch int4 g32":
        def f():
            t4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4().to(torch.int32), 2)
            sz = torch.rand(k // g, n, 2, generator=gen)
            return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4, g, sz)
    elif method == "torch int8 per-ch":
        def f():
            c, s = codes8(), torch.rand(n, generator=gen)
            return lambda x: torch.ops.aten._weight_int8pack_mm(x, c, s)
    elif method.startswith("int4"):
        asym = "asym" in method
        variant = FLOAT_FMA if "float-fma" in method else INT_DOT

        def f():
            p, s, m = int4_pack(codes4()), scales(), (mins() if asym else empty)
            return lambda x: ext.int4_gemm_variant(x, p, s, m, g, variant)
    elif method.startswith("int8"):
        per_ch = "per-ch" in method
        variant = FLOAT_FMA if "float-fma" in method else INT_DOT
        gs = k if per_ch else g

        def f():
            c, s = codes8(), scales(k // gs)
            return lambda x: ext.int8_gemm_variant(x, c, s, gs, variant)
    else:
        raise ValueError(method)
    return weight_bytes(method, n, k), f


def cold(method: str, n: int, k: int, gen: torch.Generator, ext) -> Callable[[torch.Tensor], Callable[[], object]]:
    """x -> a zero-argument call that uses the next weight copy each time, so weights come from DRAM, as in
    the model (84 MB of int4 weights per token do not fit the caches)."""
    nbytes, factory = make_method(method, n, k, gen, ext)
    return cycling([factory() for _ in range(max(1, -(-COLD_BYTES // int(nbytes))))])


def cycling(copies: list[Callable[[torch.Tensor], object]]) -> Callable[[torch.Tensor], Callable[[], object]]:
    """x -> a zero-argument call that applies the next of `copies` to x each time."""
    def bind(x: torch.Tensor) -> Callable[[], object]:
        state = [0]

        def call():
            i = state[0] = (state[0] + 1) % len(copies)
            return copies[i](x)

        return call

    return bind


def weight_bytes(method: str, n: int, k: int) -> float:
    nk = n * k
    return {
        "fp32 F.linear": 4 * nk,
        "torch int4 g32": nk / 2 + (k // 32) * n * 2 * 4,
        "torch int8 per-ch": nk + 4 * n,
        "int4 asym g32 int-dot": nk / 2 + 2 * 2 * nk / 32,
        "int4 asym g32 float-fma": nk / 2 + 2 * 2 * nk / 32,
        "int4 sym g32 int-dot": nk / 2 + 2 * nk / 32,
        "int8 g32 int-dot": nk + 2 * nk / 32,
        "int8 g32 float-fma": nk + 2 * nk / 32,
        "int8 per-ch int-dot": nk + 2 * n,
    }[method]


METHODS = ["fp32 F.linear", "torch int4 g32", "torch int8 per-ch", "int4 asym g32 int-dot", "int4 asym g32 float-fma",
           "int4 sym g32 int-dot", "int8 g32 int-dot", "int8 g32 float-fma", "int8 per-ch int-dot"]
MULTI_M_METHODS = ["fp32 F.linear", "int4 asym g32 int-dot", "int4 asym g32 float-fma"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--multi-m", default="1,2,4,8,16", help="M values for the small-batch (verification) table")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels-cpu.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    ext = get_extension()
    if ext is None:
        sys.exit("the CPU kernel extension is unavailable (the build failed: see the warning above)")
    gen = torch.Generator().manual_seed(0)
    ms = [int(v) for v in args.multi_m.split(",") if v]
    load_before = load_average()
    if load_before and load_before[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load_before[0]} - other processes share the CPU, timings will be noisy",
              file=sys.stderr)

    m1: dict[str, dict[str, dict[str, float]]] = {}
    per_token_us: dict[str, float] = {}
    multi_us: dict[int, dict[str, float]] = {m: {} for m in ms}
    for name, n, k, count in SHAPES:
        binders = {meth: cold(meth, n, k, gen, ext) for meth in METHODS}
        # ---- M = 1: every method
        x = torch.randn(1, k, generator=gen)
        us = bench_round_robin({meth: b(x) for meth, b in binders.items()}, args.rounds)
        m1[name] = {meth: {"us": round(t, 2), "GBps": round(weight_bytes(meth, n, k) / t / 1e3, 2)}
                    for meth, t in us.items()}
        for meth, t in us.items():
            per_token_us[meth] = per_token_us.get(meth, 0.0) + count * t
        # ---- small M (speculative verification)
        for m in ms:
            x = torch.randn(m, k, generator=gen)
            us = bench_round_robin({meth: binders[meth](x) for meth in MULTI_M_METHODS}, max(3, args.rounds // 2))
            for meth, t in us.items():
                multi_us[m][meth] = multi_us[m].get(meth, 0.0) + count * t
        del binders
    methods = list(per_token_us)

    print(f"\nM = 1, {args.threads} threads, {cpu_model()}, kernels {ext.isa()}: median us per call (GB/s of weights)")
    head = f"{'method':26s}" + "".join(f"{name + f' {n}x{k}':>22s}" for name, n, k, _ in SHAPES) + f"{'ms/token':>10s}"
    print(head)
    for meth in methods:
        row = f"{meth:26s}"
        for name, *_ in SHAPES:
            r = m1[name][meth]
            row += f"{r['us']:>13.1f} ({r['GBps']:5.1f})"
        row += f"{per_token_us[meth] / 1e3:>10.2f}"
        print(row)
    print(f"{'llama.cpp whole model':26s}" + " " * 22 * len(SHAPES) + f"{LLAMA_CPP_MS_PER_TOKEN:>10.2f}")

    multi = {str(m): {meth: round(t / 1e3, 3) for meth, t in multi_us[m].items()} for m in ms}
    print("\nWhole-model matmul ms per forward of M tokens (speculative verification), int4 = Q4_1 layout")
    print(f"{'M':>4s}" + "".join(f"{meth:>26s}" for meth in multi[str(ms[0])]))
    for m in ms:
        print(f"{m:>4d}" + "".join(f"{v:>26.2f}" for v in multi[str(m)].values()))

    result = {
        "benchmark": "kernels-cpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
                    "kernels_isa": ext.isa()},
        "threads": args.threads,
        "load_average_before_after": [load_before, load_average()],
        "torch": torch.__version__,
        "model": "SmolLM2-135M decode shapes: 30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) "
                 "+ lm_head 49152x576",
        "note": "median of round-robin rounds, microseconds per call from Python (includes call overhead), "
                "weights cycled through copies of >= 64 MB so they come from DRAM as in the model; "
                "GBps = weight bytes / time; ms_per_token sums the matmuls only (no attention, norms, sampling)",
        "m1_us": m1,
        "m1_ms_per_token": {meth: round(v / 1e3, 3) for meth, v in per_token_us.items()},
        "llama_cpp_ms_per_token_whole_model": LLAMA_CPP_MS_PER_TOKEN,
        "multi_m_ms_per_forward": multi,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
