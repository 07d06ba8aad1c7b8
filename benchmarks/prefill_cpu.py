"""Prefill on CPU: the C++ int kernels against dequantize + GEMM, by prompt length. The measurements behind
kernels/matmul.py's PREFILL_KERNEL_MAX_M (up to how many rows a quantized linear stays in the kernel).

    python benchmarks/prefill_cpu.py [--threads 2] [-r 5] [--tokens 17,32,64,128,256,512]
                                     [--json benchmarks/results/prefill-cpu.json]
    python benchmarks/prefill_cpu.py --isa avx2 ...   # the AVX2 build of the kernels (on an AVX-512 machine)

The bundled model as int4 (its Q4_1 blocks) and as int8 g32 (quantized from its float weights), one model
forward of N prompt tokens from an empty cache per sample, timed with the linears in the kernel and in
dequantize + GEMM alternately, so the machine's load falls on both alike; median of the repeats. For each
activations variant (int8, int8x2) and each GEMM dtype the CPU offers (fp32; bf16 where it multiplies bf16
natively, for int4 weights, as `edgellm run` does). ratio = GEMM time / kernel time: above 1 the kernel is
faster. A run appends its rows to --json under the kernel build's ISA, replacing that ISA's earlier rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from edgellm.bench import machine_info
    from edgellm.cache import KVCache
    from edgellm.device import set_threads
    from edgellm.kernels import matmul
    from edgellm.kernels.cpu_ext import ExtensionSettings
    from edgellm.loading import load_model
    from edgellm.quant.linear import quantize_linears, set_kernel_options

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--tokens", default="17,32,64,128,256,512")
    ap.add_argument("--json", default=None)
    ap.add_argument("--isa", default=None, choices=("avx2", "scalar"), help="force this build of the kernels")
    args = ap.parse_args()
    set_threads(args.threads)
    sizes = [int(v) for v in args.tokens.split(",")]
    matmul.configure_cpu_extension(ExtensionSettings(isa=args.isa))
    ext = matmul.cpu_extension()
    if ext is None:
        sys.exit("no C++ extension: nothing to compare")
    isa = ext.isa()
    native_bf16 = matmul.native_bf16_gemm()
    ctx = max(sizes)

    int4 = load_model(None, max_seq_len=ctx, weights="int4")  # the bundled Q4_1 blocks, as stored
    int8 = load_model(None, max_seq_len=ctx)
    quantize_linears(int8.model, 8, 32)
    ids = int4.tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text(encoding="utf-8"))
    if len(ids) < ctx:
        ids = (ids * (ctx // max(len(ids), 1) + 1))[:ctx]

    saved_table = matmul.PREFILL_KERNEL_MAX_M

    class EveryRow(dict):  # the table that keeps every prefill in the kernel
        def get(self, key, default=None):
            return 1 << 30

    def forward(model, n: int, kernel: bool) -> float:
        # kernel: all rows in the kernel; else an empty table: rows above CPU_KERNEL_MAX_M to the GEMM
        matmul.PREFILL_KERNEL_MAX_M = EveryRow() if kernel else {}
        cache = KVCache(model.config, ctx, torch.float32, "cpu")
        t = time.perf_counter()
        with torch.no_grad():
            model(torch.tensor([ids[:n]]), cache, 0)
        return time.perf_counter() - t

    configs = [("int4", int4, act, dense) for act in ("int8", "int8x2")
               for dense in (("fp32", "bf16") if native_bf16 else ("fp32",))]
    configs += [("int8", int8, act, "fp32") for act in ("int8", "int8x2")]
    rows = []
    try:
        for weights, loaded, act, dense in configs:
            set_kernel_options(loaded.model, matmul.KernelOptions(activations=act, prefill_bf16=dense == "bf16"))
            for n in sizes:
                forward(loaded.model, n, True), forward(loaded.model, n, False)  # warm
                times = {True: [], False: []}
                for _ in range(args.repeats):
                    for kernel in (True, False):
                        times[kernel].append(forward(loaded.model, n, kernel))
                k_ms, d_ms = (1000 * statistics.median(times[v]) for v in (True, False))
                rows.append({"isa": isa, "weights": weights, "activations": act, "gemm": dense, "tokens": n,
                             "kernel_ms": round(k_ms, 2), "gemm_ms": round(d_ms, 2), "ratio": round(d_ms / k_ms, 3)})
                print(f"{isa:10s} {weights} act {act:6s} gemm {dense}  {n:4d} tokens: kernel {k_ms:7.1f} ms  "
                      f"dequantize+GEMM {d_ms:7.1f} ms  ratio {d_ms / k_ms:.2f}", flush=True)
    finally:
        matmul.PREFILL_KERNEL_MAX_M = saved_table

    if args.json:
        path = Path(args.json)
        record = json.loads(path.read_text()) if path.exists() else {"runs": []}
        record["runs"] = [r for r in record["runs"] if r["isa"] != isa]
        record["runs"].append({
            "isa": isa, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(torch.device("cpu")), "native_bf16_gemm": native_bf16,
            "command": " ".join(["python", "benchmarks/prefill_cpu.py", *sys.argv[1:]]),
            "rows": rows})
        path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
