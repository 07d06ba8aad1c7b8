"""The prefill's own-keys attention on the CPU: kernels/cpu_attention.cpp (`ext.flash_causal`) against torch's fused
flash kernel with is_causal (what kernels/attention.py `_flash_rows` called before), in one process, calls
interleaved.

    python benchmarks/prefill_attention.py [--threads 2] [--tokens 128,512] [--reps 20] [--json FILE]

Per model shape (query heads, KV heads, head dim: SmolLM2-135M, Llama-3.2-1B, Qwen2-1.5B, Llama-3-8B) and chunk
length T (a prefill runs in chunks of edgellm.device.prefill_chunk rows, 256 or 512; these are the chunk's rows against its own keys): q
[Hq, T, D] scaled, K/V [Hkv, T, D]; torch's kernel gets K/V repeated over the group as _flash_rows gave them. Best
of --reps per path; GFLOP/s counts the causal triangle (2 T^2 D Hq multiply-adds), the work either path must do.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "qwen2-1.5b": (12, 2, 128),
          "llama-3-8b": (32, 8, 128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from edgellm.kernels import matmul

    torch.set_num_threads(args.threads)
    ext = matmul.cpu_extension()
    if ext is None or not ext.flash_causal_fast():
        raise SystemExit("this build of the CPU kernels has no flash_causal (needs AVX2 + FMA)")
    torch_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    rows = []
    for name, (hq, hkv, d) in SHAPES.items():
        for t in (int(x) for x in args.tokens.split(",")):
            gen = torch.Generator().manual_seed(t + hq)
            q = torch.randn(hq, t, d, generator=gen) * d ** -0.5
            k, v = torch.randn(2, hkv, t, d, generator=gen)
            kr, vr = k.repeat_interleave(hq // hkv, 0)[None], v.repeat_interleave(hq // hkv, 0)[None]
            calls = {"ours": lambda: ext.flash_causal(q, k, v),
                     "torch": lambda: torch_op(q[None], kr, vr, 0.0, True, scale=1.0)}
            best = {key: float("inf") for key in calls}
            for f in calls.values():
                f()
            for _ in range(args.reps):
                for key, f in calls.items():
                    t0 = time.perf_counter()
                    f()
                    best[key] = min(best[key], time.perf_counter() - t0)
            err = (ext.flash_causal(q, k, v)[0] - torch_op(q[None], kr, vr, 0.0, True, scale=1.0)[0][0]).abs().max()
            flop = 2 * t * t * d * hq  # 2 T^2/2 D multiply-adds per head, QK^T and PV
            row = {"shape": name, "hq": hq, "hkv": hkv, "head_dim": d, "tokens": t,
                   "ours_ms": best["ours"] * 1e3, "torch_ms": best["torch"] * 1e3,
                   "speedup": best["torch"] / best["ours"], "ours_gflops": flop / best["ours"] / 1e9,
                   "torch_gflops": flop / best["torch"] / 1e9, "max_abs_diff": float(err)}
            rows.append(row)
            print(f"{name:13s} T={t:4d}: ours {row['ours_ms']:7.2f} ms ({row['ours_gflops']:5.0f} GFLOP/s)  "
                  f"torch {row['torch_ms']:7.2f} ms ({row['torch_gflops']:5.0f})  x{row['speedup']:.2f}  "
                  f"max diff {row['max_abs_diff']:.1e}", flush=True)
    if args.json:
        from benchmarks.run_record import write_run

        write_run(args.json, rows, args.threads, kernel_isa=ext.isa())


if __name__ == "__main__":
    main()
