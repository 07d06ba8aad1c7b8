"""Prefill time per KV-cache format, with both attention paths of a quantized cache's prefill, side by side.

    python benchmarks/prefill_kv.py [--threads 2] [--weights int4] [--kv fp,int8,int4]
                                    [--tokens 2048,6144] [-r 1] [--json FILE]

The bundled model with `--weights`, loaded once; for each prompt length and KV format, Engine.prefill of that
many GPL-3 tokens (repeated if the text is shorter) into a fresh cache, after one short warm-up prefill.
An int8/int4 cache is timed twice in the same process: "flash" (each dequantized tile through torch's fused
CPU flash kernel, kernels/attention.py `_flash_rows`, the default from FLASH_MIN_ROWS query rows on) and
"bmm" (the scores / softmax / P·V tile sequence, FLASH_MIN_ROWS set out of reach). The fp cache runs
F.scaled_dot_product_attention either way.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = "/usr/share/common-licenses/GPL-3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--kv", default="fp,int8,int4")
    ap.add_argument("--tokens", default="2048,6144")
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    import torch

    import edgellm.kernels.attention as attention
    from edgellm.cache import KVCache
    from edgellm.generate import Engine
    from edgellm.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None, weights=args.weights)
    text_ids = loaded.tokenizer.encode(Path(TEXT).read_text(encoding="utf-8"), add_bos=False)
    default_rows = attention.FLASH_MIN_ROWS
    rows = []
    print("| tokens | kv | prefill attention | seconds | tok/s |")
    print("|---:|---|---|---:|---:|")
    for n in (int(t) for t in args.tokens.split(",")):
        ids = (text_ids * (n // len(text_ids) + 1))[:n]
        for kv in args.kv.split(","):
            for path in (["sdpa"] if kv == "fp" else ["flash", "bmm"]):
                attention.FLASH_MIN_ROWS = 10**9 if path == "bmm" else default_rows
                cache = KVCache(loaded.model.config, n + 64, loaded.model.dtype, "cpu", kv_format=kv)
                engine = Engine(loaded.model, loaded.tokenizer, max_seq_len=n + 64, cache=cache)
                times = []
                with torch.inference_mode():
                    engine.prefill(ids[:256])
                    for _ in range(args.reps):
                        engine.reset()
                        t0 = time.perf_counter()
                        engine.prefill(ids)
                        times.append(time.perf_counter() - t0)
                best = min(times)
                rows.append({"tokens": n, "kv": kv, "path": path, "seconds": round(best, 3),
                             "tokens_per_s": round(n / best, 1), "all_seconds": [round(t, 3) for t in times]})
                print(f"| {n} | {kv} | {path} | {best:.2f} | {n / best:.0f} |", flush=True)
    attention.FLASH_MIN_ROWS = default_rows
    if args.json:
        from run_record import write_run  # benchmarks/, this script's folder

        write_run(args.json, rows, args.threads, weights=args.weights)


if __name__ == "__main__":
    main()
