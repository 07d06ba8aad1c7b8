"""What `--activations` costs per decode step: the CPU kernels' int8 / int8x2 / fp32 activations, side by side.

    python benchmarks/activations_cpu.py [--threads 2] [--weights int8,int4] [--position 256] [-r 12]
                                         [--json benchmarks/results/activations-cpu.json]

The bundled model with each `--weights`, loaded once; its fused decode step timed at one position (a float
KV cache holding that many prompt tokens; the step's K/V is written and then dropped by truncating the cache),
40 steps per sample, the activation modes interleaved sample by sample in the same process
(one engine per mode on the same cache, each with its KernelOptions(activations=...)), so the machine's load falls on every mode alike. Prints and records the
median ms per step of each mode and its ratio to int8. The quality side of the same choice is in
benchmarks/results/kl-vs-llamacpp.md.
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

MODES = ("int8", "int8x2", "fp32")
STEPS = 40


def main() -> None:
    import torch

    from edgellm.cache import KVCache
    from edgellm.device import set_threads
    from edgellm.generate import Engine
    from edgellm.kernels import matmul
    from edgellm.loading import load_model
    from edgellm.options import Options

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--position", type=int, default=256)
    ap.add_argument("-r", "--repeats", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    set_threads(args.threads)
    rows = []
    for weights in args.weights.split(","):
        loaded = load_model(None, max_seq_len=args.position + 64, weights=weights)
        cache = KVCache(loaded.config, args.position + 64, torch.float32, "cpu")
        engines = {m: Engine(loaded.model, loaded.tokenizer, cache=cache,
                             options=Options(kernel=matmul.KernelOptions(activations=m))) for m in MODES}
        engine = engines["int8"]
        if engine.compiled_step() is None:
            sys.exit("the fused CPU step is not available (no C++ extension?): nothing to measure")
        engine.prefill([100 + i % 1000 for i in range(args.position)])
        token = torch.tensor([[42]])
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                engine = engines[mode]
                for _ in range(3):  # warm
                    engine.step(token)
                    cache.truncate(args.position)
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    engine.step(token)
                    cache.truncate(args.position)
                samples[mode].append((time.perf_counter() - t0) / STEPS * 1e3)
        med = {m: statistics.median(v) for m, v in samples.items()}
        row = {"weights": weights, "position": args.position, "ms_per_step": med,
               "vs_int8": {m: med[m] / med["int8"] for m in MODES}, "samples_ms": samples}
        print(f"{weights}: " + ", ".join(f"{m} {med[m]:.3f} ms ({med[m] / med['int8']:.2f}x)" for m in MODES), flush=True)
        rows.append(row)
    if args.json:
        from run_record import write_run  # benchmarks/, this script's folder

        write_run(args.json, rows, args.threads, steps_per_sample=STEPS, repeats=args.repeats)


if __name__ == "__main__":
    main()
