"""CUDA decode step: eager vs edgellm's CUDA graph vs torch.compile inside that graph, one process run.

    python benchmarks/compile_cuda.py MODEL [--weights fp,int4] [-n 128] [--out FILE]

Per weight format: prefill a 512-token prompt of GPL-3, then time `-n` greedy decode steps
(Engine.step + argmax + .item(), as generate() does), median of 3 runs after a warm-up, for
  eager      the model op by op (`--no-compile`),
  graph      edgellm's CudaGraphDecodeStep (the default),
  compiled   `--compile inductor`: the same graph capture around torch.compile(model.forward),
             which fuses the elementwise ops (RMSNorm, RoPE, SiLU) between the matmuls (the Triton attention
             kernel stays outside the traced graphs: a graph break per layer); its compile
             time is recorded, since a chat user pays it before the first answer.
Greedy tokens of every mode are compared with eager's (bf16 rounding may flip near-ties: counted).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from edgellm.bench import machine_info
from edgellm.cache import KVCache
from edgellm.generate import Engine
from edgellm.loading import load_model
from edgellm.options import DecodeOptions, Options


def decode(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    engine.reset()
    logits = engine.prefill(prompt)
    tok = torch.argmax(logits).view(1, 1)
    out = [int(tok)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        tok = torch.argmax(engine.step(tok)).view(1, 1)
        out.append(int(tok))  # the host sync generate() has too
    dt = time.perf_counter() - t0
    return (n - 1) / dt, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--weights", default="fp,int4")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--prompt-file", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for weights in args.weights.split(","):
        loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16, max_seq_len=2048, weights=weights)
        prompt = loaded.tokenizer.encode(Path(args.prompt_file).read_text())[:512]
        model = loaded.model
        row = {"weights": weights}
        ref = None
        for mode, compile_mode in (("eager", "off"), ("graph", "auto"), ("compiled", "inductor")):
            cache = KVCache(model.config, 2048, model.dtype, model.device)
            engine = Engine(model, loaded.tokenizer, cache=cache, options=Options(decode=DecodeOptions(compile=compile_mode)))
            t0 = time.perf_counter()
            try:
                decode(engine, prompt, 4)  # compiles and captures the first bucket
            except Exception as e:  # noqa: BLE001 - record why and go on
                row[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(weights, mode, row[mode], file=sys.stderr)
                continue
            setup = time.perf_counter() - t0
            runs = [decode(engine, prompt, args.n) for _ in range(3)]
            speeds = [r[0] for r in runs]
            toks = runs[0][1]
            ref = ref or toks
            same = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(toks))
            row[mode] = {"decode_tok_s": statistics.median(speeds), "runs": speeds, "setup_s": setup,
                         "tokens_equal_to_eager": same}
            print(f"{weights:5s} {mode:9s} {statistics.median(speeds):8.1f} tok/s  setup {setup:6.1f} s  "
                  f"same as eager for {same}/{len(toks)} tokens", flush=True)
        rows.append(row)
    res = {"command": "python " + " ".join(sys.argv), "machine": machine_info(torch.device("cuda")),
           "note": "decode after a 512-token prompt, bf16", "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
