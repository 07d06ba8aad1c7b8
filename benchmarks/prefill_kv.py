"""Prefill time per KV-cache format, with both attention paths of each, side by side.

    python benchmarks/prefill_kv.py [--threads 2] [--weights int4] [--kv fp,int8,int4]
                                    [--tokens 512,2048,6144] [-r 3] [--json FILE]

The bundled model with `--weights`, loaded once; for each prompt length and KV format, Engine.prefill of that
many GPL-3 tokens (repeated if the text is shorter) into a fresh cache, after one short warm-up prefill, the
two paths interleaved rep by rep (best of -r each). "flash" is the default from FLASH_MIN_ROWS query rows on
(kernels/attention.py `_flash_rows`): torch's fused CPU flash kernel, the cached prefix without a mask (a
dequantized tile at a time for int8/int4), the chunk's own keys with is_causal. The other path is what runs
with FLASH_MIN_ROWS set out of reach: "sdpa" for the fp cache (one F.scaled_dot_product_attention call over
the whole cache with a boolean causal mask), "bmm" for a quantized one (scores / softmax / P·V tiles).
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
    ap.add_argument("--tokens", default="512,2048,6144")
    ap.add_argument("-r", "--reps", type=int, default=3)
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
            paths = ["flash", "sdpa" if kv == "fp" else "bmm"]
            cache = KVCache(loaded.model.config, n + 64, loaded.model.dtype, "cpu", kv_format=kv)
            engine = Engine(loaded.model, loaded.tokenizer, max_seq_len=n + 64, cache=cache)
            times: dict[str, list[float]] = {p: [] for p in paths}
            with torch.inference_mode():
                engine.prefill(ids[:256])
                for _ in range(args.reps):  # the two paths interleaved, so the machine's load falls on both
                    for path in paths:
                        attention.FLASH_MIN_ROWS = default_rows if path == "flash" else 10**9
                        engine.reset()
                        t0 = time.perf_counter()
                        engine.prefill(ids)
                        times[path].append(time.perf_counter() - t0)
            for path in paths:
                best = min(times[path])
                rows.append({"tokens": n, "kv": kv, "path": path, "seconds": round(best, 3),
                             "tokens_per_s": round(n / best, 1), "all_seconds": [round(t, 3) for t in times[path]]})
                print(f"| {n} | {kv} | {path} | {best:.2f} | {n / best:.0f} |", flush=True)
    attention.FLASH_MIN_ROWS = default_rows
    if args.json:
        from run_record import write_run  # benchmarks/, this script's folder

        write_run(args.json, rows, args.threads, weights=args.weights)


if __name__ == "__main__":
    main()
