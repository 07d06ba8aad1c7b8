"""The AMX prefill kernel of GGUF linears (`ext.gguf_linear_amx`, `gguf_ops.method` "amx": weights dequantized to bf16
a panel at a time in cache, AMX tiles) against the int8 prompt GEMM it replaces from `gguf_ops.AMX_MIN_ROWS` rows on,
and against the simpler way to reach AMX (the whole weight dequantized to bf16, then torch's bf16 GEMM, which oneDNN
runs on AMX tiles), per type, shape and M, the parts laid out as a loaded model holds them (x8 where the type has it):

    python benchmarks/gguf_amx_gemm.py [--threads 2] [--m 32,64,...] [--types Q4_K,Q6_K,Q8_0] [--json FILE]

Wall time, the paths alternating, median of --reps. The AMX kernel runs where `ext.gguf_amx_available()` (Intel Xeon
since Sapphire Rapids); elsewhere the script compares the other two.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from run_record import write_run  # noqa: E402  (benchmarks/, this script's folder)

SHAPES = {"1b": [(2048, 2048), (8192, 2048), (2048, 8192)], "smollm2": [(576, 576), (1536, 576), (576, 1536)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", default="32,64,96,128,192,256,512")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--shapes", default="1b,smollm2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    from edgellm.kernels import gguf_ops, matmul
    from edgellm.quant.gguf_linear import GGUFLinear, GGUFPart, repack_for_cpu
    from tests.test_gguf_kernels import make_weights

    torch.set_num_threads(args.threads)
    ext = matmul.cpu_extension()
    assert ext is not None and hasattr(ext, "gguf_linear_prompt"), "the C++ kernels did not build"
    amx = hasattr(ext, "gguf_amx_available") and ext.gguf_amx_available()
    if not amx:
        print("note: no AMX kernel here (gguf_amx_available() is False): the prompt GEMM against dequantize + torch")

    def timed(f) -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    rows = []
    for name in args.types.split(","):
        for shape in args.shapes.split(","):
            for n, k in SHAPES[shape]:
                qt = Q[name]
                if k % GGML_QUANT_SIZES[qt][0]:
                    continue  # (a K-quant's rows are whole 256-value blocks: not along SmolLM2's 576)
                raw = torch.from_numpy(make_weights(qt, n, k, seed=1))
                lin = GGUFLinear(repack_for_cpu([GGUFPart(raw, int(qt), n)], k), k)
                parts = [(p.raw, p.type, p.rows, p.out_index) for p in lin.gguf_parts]
                wbuf = torch.empty(n, k, dtype=torch.bfloat16)
                for m in (int(v) for v in args.m.split(",")):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    prompt = lambda: ext.gguf_linear_prompt(x, parts, n)  # noqa: E731
                    fused = lambda: ext.gguf_linear_amx(x, parts, n)  # noqa: E731
                    deq = lambda: ext.gguf_dequantize(lin.raw0, lin.part_types[0], n, k, wbuf)  # noqa: E731
                    gemm = lambda: F.linear(x.to(torch.bfloat16), wbuf).float()  # noqa: E731
                    paths = (prompt, fused, deq, gemm) if amx else (prompt, deq, gemm)
                    for f in paths:
                        f()
                    times: list[list[float]] = [[] for _ in paths]
                    for _ in range(args.reps):
                        for f, t in zip(paths, times):
                            t.append(timed(f))
                    med = [statistics.median(t) for t in times]
                    p, (d, g), a = med[0], med[-2:], (med[1] if amx else None)
                    ops = 2.0 * m * n * k
                    row = {"type": name, "layout": "+".join(sorted({str(t) for t in lin.part_types})), "n": n, "k": k,
                           "m": m, "prompt_ms": p * 1e3, "prompt_gops": ops / p / 1e9,
                           "amx_ms": None if a is None else a * 1e3, "amx_gflops": None if a is None else ops / a / 1e9,
                           "speedup_amx": None if a is None else p / a, "dequant_bf16_ms": d * 1e3,
                           "torch_bf16_gemm_ms": g * 1e3, "torch_bf16_gemm_gflops": ops / g / 1e9,
                           "dequant_plus_torch_ms": (d + g) * 1e3, "speedup_dequant_plus_torch": p / (d + g)}
                    rows.append(row)
                    print(f"{name} {n}x{k} M={m}: prompt GEMM {p * 1e3:.2f} ms ({row['prompt_gops']:.0f} GOP/s) | "
                          + ("" if a is None else f"AMX kernel {a * 1e3:.2f} ms ({row['amx_gflops']:.0f} GFLOP/s) "
                                                  f"= x{row['speedup_amx']:.2f} | ")
                          + f"dequantize to bf16 {d * 1e3:.2f} + torch bf16 GEMM {g * 1e3:.2f} ms "
                          f"= x{row['speedup_dequant_plus_torch']:.2f}", flush=True)
    if args.json:
        write_run(args.json, rows, args.threads, kernel_isa=ext.isa(), amx_kernel=amx, torch=torch.__version__,
                  timing="wall, median of reps, paths alternating", amx_min_rows=gguf_ops.AMX_MIN_ROWS)

if __name__ == "__main__":
    main()
