"""Kernel-level rate of the GGUF prompt GEMM (`ext.gguf_linear_prompt`, kernels/cpu_gguf.cpp "prompt GEMM") against
the paths it replaces, single thread, CPU time (robust to a busy second core):

    python benchmarks/gguf_prompt_gemm.py [--isa avx2|scalar] [--m 8,16,...] [--json FILE]

Per type (GGUF Q4_K, Q6_K, Q8_0 ... or our own int8 / int4 / int4-asym, group 32: `ext.quant_linear_prompt`) and
shape (N x K: Llama-3.2-1B's 2048 x 2048 projection, 8192 x 2048 gate/up, 2048 x 8192 down; --shapes smollm2: the
135M model's 576 x 576, 1536 x 576, 576 x 1536) and M: the prompt GEMM, the row kernel (GGUF `gguf_linear`, M <= 128;
ours: the int kernel `int{4,8}_gemm_variant`, which took prefills of up to 512 rows before the prompt GEMM), and
dequantize into a reused buffer + torch fp32 F.linear; best of --reps. GOP/s = 2 M N K / time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {"1b": [(2048, 2048), (8192, 2048), (2048, 8192)], "smollm2": [(576, 576), (1536, 576), (576, 1536)]}
OURS = {"int8": (8, True), "int4": (4, True), "int4-asym": (4, False)}  # our formats, group 32


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=None, choices=[None, "avx2", "scalar"])
    ap.add_argument("--m", default="16,32,64,128,512")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default="1b", choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q

    from edgellm.kernels import matmul
    from edgellm.kernels.cpu_ext import ExtensionSettings
    from tests.test_gguf_kernels import make_weights

    torch.set_num_threads(1)
    matmul.configure_cpu_extension(ExtensionSettings(isa=args.isa))
    ext = matmul.cpu_extension()
    assert ext is not None and hasattr(ext, "gguf_linear_prompt"), "the C++ kernels did not build"

    def best(f) -> float:
        f()
        t_best = float("inf")
        for _ in range(args.reps):
            t = time.process_time()
            f()
            t_best = min(t_best, time.process_time() - t)
        return t_best

    def our_weights(name: str, n: int, k: int):
        from edgellm.quant.groups import quantize

        bits, sym = OURS[name]
        w = torch.from_numpy(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32))
        qt = quantize(w, bits, 32, symmetric=sym, search=False)
        mins = qt.mins if qt.mins is not None else torch.empty(0, dtype=torch.float16)
        if bits == 8:
            kernel = lambda x: ext.int8_gemm_variant(x, qt.codes, qt.scales, 32, 0)  # noqa: E731
        else:
            kernel = lambda x: ext.int4_gemm_variant(x, qt.codes, qt.scales, mins, 32, 0)  # noqa: E731
        return (lambda x: ext.quant_linear_prompt(x, qt.codes, qt.scales, mins, 32, bits), kernel,
                lambda buf: ext.dequant_out(qt.codes, qt.scales, mins, 32, bits, buf), 512)

    def gguf_weights(name: str, n: int, k: int):
        qt = Q[name]
        raw = torch.from_numpy(make_weights(qt, n, k, seed=1))
        parts = [(raw, int(qt), n, None)]
        return (lambda x: ext.gguf_linear_prompt(x, parts, n), lambda x: ext.gguf_linear(x, parts, n),
                lambda buf: ext.gguf_dequantize(raw, int(qt), n, k, buf), 128)

    rows = []
    for name in args.types.split(","):
        for n, k in SHAPES[args.shapes]:
            prompt, kernel, dequantize, kernel_max_m = (our_weights if name in OURS else gguf_weights)(name, n, k)
            wbuf = torch.empty(n * k)
            for m in (int(v) for v in args.m.split(",")):
                x = torch.from_numpy(np.random.default_rng(m).standard_normal((m, k)).astype(np.float32))
                ops = 2.0 * m * n * k
                t_p = best(lambda: prompt(x))
                t_d = best(lambda: dequantize(wbuf))
                w = wbuf.view(n, k)
                t_l = best(lambda: torch.nn.functional.linear(x, w))
                t_r = best(lambda: kernel(x)) if m <= kernel_max_m else None
                row = {"type": name, "n": n, "k": k, "m": m, "prompt_ms": t_p * 1e3, "prompt_gops": ops / t_p / 1e9,
                       "dequant_ms": t_d * 1e3, "fp32_linear_ms": t_l * 1e3, "fp32_linear_gflops": ops / t_l / 1e9,
                       "dequant_plus_linear_ms": (t_d + t_l) * 1e3,
                       "row_kernel_ms": None if t_r is None else t_r * 1e3,
                       "speedup_vs_dequant_linear": (t_d + t_l) / t_p,
                       "speedup_vs_row_kernel": None if t_r is None else t_r / t_p}
                rows.append(row)
                print(f"{name} {n}x{k} M={m}: prompt GEMM {t_p * 1e3:.2f} ms ({row['prompt_gops']:.0f} GOP/s) | "
                      f"dequantize {t_d * 1e3:.2f} + fp32 F.linear {t_l * 1e3:.2f} ms "
                      f"({row['fp32_linear_gflops']:.0f} GFLOP/s) = x{row['speedup_vs_dequant_linear']:.2f} | "
                      f"row kernel {'-' if t_r is None else f'{t_r * 1e3:.2f} ms'}", flush=True)
    if args.json:
        doc = {"command": " ".join(["python", "benchmarks/gguf_prompt_gemm.py", *sys.argv[1:]]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "isa": ext.isa(),
                           "load_average": os.getloadavg()},
               "threads": 1, "timing": "best of reps, process CPU time", "torch": torch.__version__,
               "results": rows}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
