"""Where one fused CPU decode step's time goes, per KV-cache format and context position.

    python benchmarks/kv_step_split.py [--threads 2] [--weights int4] [--kv fp,int8,int4]
                                       [--positions 256,2048,6000] [-r 30] [--paths int,tiles] [--json FILE]

The bundled model with `--weights`, loaded once; for each KV format a cache of max(positions) + 64
slots, and r one-token steps at each position (after 5 unmeasured ones), timed by the step's own C++ clocks (matmuls,
attention, the rest) and by the wall clock around the call. The cache content is whatever the buffers
hold (the step reads every slot below the position all the same), so the figures are the step's cost,
not a quality measurement. With the bandwidth measured by `edgellm bench` it shows how far attention
at a long context is from reading the cache at memory speed.

An int8/int4 cache is measured with both attention paths of an AVX-512 VNNI build, side by side:
"int" (VPDPBUSD scores on the codes, values dequantized in registers) and "tiles" (the AVX2 tiles every
other x86 build runs, DecodeTuning(int_attention=False)). On a build without VNNI both rows run the tiles.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def split_for(loaded, kv: str, positions: list[int], reps: int, path: str = "int") -> list[dict]:
    """`loaded`: edgellm.loading.LoadedModel (one load serves every KV format: only the cache differs)."""
    import torch

    from edgellm.cache import KVCache
    from edgellm.generate import Engine
    from edgellm.options import DecodeOptions, DecodeTuning, Options

    slots = max(positions) + 64
    cache = KVCache(loaded.model.config, slots, loaded.model.dtype, "cpu", kv_format=kv)
    options = Options(decode=DecodeOptions(tuning=DecodeTuning(int_attention=path != "tiles")))
    engine = Engine(loaded.model, loaded.tokenizer, max_seq_len=slots, cache=cache, options=options)
    step = engine.compiled_step()
    if step is None:
        raise SystemExit("the fused CPU decode step is not available here (no C++ extension)")
    token = torch.full((1, 1), 42, dtype=torch.long)
    rows = []
    with torch.inference_mode():
        for pos in positions:
            for _ in range(5):
                step(token, pos)
            step.plan.set_profile(True)
            t0 = time.perf_counter()
            for _ in range(reps):
                step(token, pos)
            wall = (time.perf_counter() - t0) / reps
            prof = step.plan.profile()
            step.plan.set_profile(False)
            n = max(1, prof["steps"])
            rows.append({"kv": kv, "path": path if kv != "fp" else "fp32 tiles", "position": pos,
                         "wall_ms": round(wall * 1e3, 3),
                         "matmul_ms": round(prof["matmul_s"] / n * 1e3, 3),
                         "attention_ms": round(prof["attention_s"] / n * 1e3, 3),
                         "other_ms": round(prof["other_s"] / n * 1e3, 3),
                         "kv_bytes_read": cache.bytes_per_token * pos})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--kv", default="fp,int8,int4")
    ap.add_argument("--positions", default="256,2048,6000")
    ap.add_argument("-r", "--reps", type=int, default=30)
    ap.add_argument("--paths", default="int,tiles", help="attention paths of an int8/int4 cache: int, tiles")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    import torch

    from edgellm.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None, weights=args.weights)
    positions = [int(p) for p in args.positions.split(",")]
    rows = []
    print("| kv | attention path | position | step ms | matmul ms | attention ms | other ms | KV MB read |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kv in args.kv.split(","):
        for path in (["int"] if kv == "fp" else args.paths.split(",")):
            for r in split_for(loaded, kv, positions, args.reps, path):
                rows.append(r)
                print(f"| {r['kv']} | {r['path']} | {r['position']} | {r['wall_ms']:.2f} | {r['matmul_ms']:.2f} | "
                      f"{r['attention_ms']:.2f} | {r['other_ms']:.2f} | {r['kv_bytes_read'] / 1e6:.1f} |", flush=True)
    if args.json:
        from run_record import write_run  # benchmarks/, this script's folder

        write_run(args.json, rows, args.threads, weights=args.weights)


if __name__ == "__main__":
    main()
