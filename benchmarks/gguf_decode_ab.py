"""Decode speed (and TTFT) of a GGUF model with Q5_0 / Q5_1 as stored against the r8 layout (kernels/cpu_gguf.cpp),
both models loaded in one process, runs interleaved (robust to a loaded machine).

    python benchmarks/gguf_decode_ab.py [-m /work/ggufs/SmolLM2-135M-Instruct.Q5_0.gguf] [--runs 6] [--threads 2]
                                        [--tokens 128] [--json FILE]

A = quant/gguf_linear.REGROUP_Q5 False (the blocks as stored), B = True (the default). Decode: the chat prompt of
benchmarks/gguf_vs_llamacpp.py, then --tokens tokens, tok/s per run; TTFT: 512 tokens of GPL-3 text.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = "/usr/share/common-licenses/GPL-3"
CHAT = "Tell me a random fun fact about the Roman Empire"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/work/ggufs/SmolLM2-135M-Instruct.Q5_0.gguf")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from edgellm.args import engine_from_args, load_from_args
    from edgellm.bench import run_once
    from edgellm.cli import build_parser
    from edgellm.quant import gguf_linear

    engines, loaded = {}, None
    for regroup in (False, True):
        gguf_linear.REGROUP_Q5 = regroup
        cli = build_parser().parse_args(["run", "x", "-m", args.model, "--ctx", "1024", "--threads", str(args.threads)])
        loaded = load_from_args(cli)
        engines[regroup] = engine_from_args(cli, loaded)
    gguf_linear.REGROUP_Q5 = True
    tok = loaded.tokenizer
    chat = tok.encode_chat([{"role": "user", "content": CHAT}])
    text = tok.encode(Path(TEXT).read_text())[:512]
    for e in engines.values():
        run_once(e, chat, 8)  # warm-up: first touch of the weights
    decode = {False: [], True: []}
    ttft = {False: [], True: []}
    for r in range(args.runs):
        for regroup in ((False, True) if r % 2 == 0 else (True, False)):
            decode[regroup].append(run_once(engines[regroup], chat, args.tokens)[0].decode_tok_s)
            ttft[regroup].append(run_once(engines[regroup], text, 1)[0].ttft_s)
    result = {}
    for regroup, name in ((False, "stored"), (True, "r8")):
        result[name] = {"decode_tok_s": statistics.median(decode[regroup]), "ttft_512_s": statistics.median(ttft[regroup]),
                        "decode_runs": decode[regroup], "ttft_runs": ttft[regroup]}
        print(f"{name:6s} decode {result[name]['decode_tok_s']:7.1f} tok/s   TTFT(512) {result[name]['ttft_512_s']:.3f} s")
    ratio = result["r8"]["decode_tok_s"] / result["stored"]["decode_tok_s"]
    print(f"decode r8 / stored x{ratio:.2f}   TTFT r8 / stored x{result['r8']['ttft_512_s'] / result['stored']['ttft_512_s']:.2f}")
    if args.json:
        out = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
               "file": args.model, "runs_as": loaded.runs_as_text(), "decode_ratio": ratio, **result}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
