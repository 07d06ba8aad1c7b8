"""Decode speed (and TTFT) of a GGUF model with its Q5_0 / Q5_1 tensors in each layout (quant/gguf_linear.Q5_LAYOUT:
"stored", "r8" = each row's runs of 8 blocks regrouped, kernels/cpu_gguf.cpp, "x8" = 8 rows interleaved,
kernels/cpu_gguf_x8.cpp, the default), or with --switch IQ4_NL_LAYOUT its IQ4_NL tensors (stored | x8), the models
loaded in one process, runs interleaved (robust to a loaded machine).

    python benchmarks/gguf_decode_ab.py [-m /work/ggufs/SmolLM2-135M-Instruct.Q5_0.gguf] [--layouts r8 x8]
                                        [--switch Q5_LAYOUT|IQ4_NL_LAYOUT] [--runs 6] [--threads 2] [--tokens 128]
                                        [--json FILE]

Decode: the chat prompt of benchmarks/gguf_vs_llamacpp.py, then --tokens tokens, tok/s per run; TTFT: 512 tokens of
GPL-3 text. Ratios are against the first layout named.
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
    ap.add_argument("--layouts", nargs="+", default=["r8", "x8"], choices=["stored", "r8", "x8"])
    ap.add_argument("--switch", default="Q5_LAYOUT", choices=["Q5_LAYOUT", "IQ4_NL_LAYOUT"],
                    help="which of quant/gguf_linear's layout switches the layouts set (IQ4_NL: stored | x8)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from edgellm.args import engine_from_args, load_from_args
    from edgellm.bench import run_once
    from edgellm.cli import build_parser
    from edgellm.quant import gguf_linear

    if args.switch == "IQ4_NL_LAYOUT" and "r8" in args.layouts:
        raise SystemExit("IQ4_NL has no r8 layout: --layouts stored x8")
    engines, loaded, default = {}, None, getattr(gguf_linear, args.switch)
    for layout in args.layouts:
        setattr(gguf_linear, args.switch, layout)
        cli = build_parser().parse_args(["run", "x", "-m", args.model, "--ctx", "1024", "--threads", str(args.threads)])
        loaded = load_from_args(cli)
        engines[layout] = engine_from_args(cli, loaded)
    setattr(gguf_linear, args.switch, default)
    tok = loaded.tokenizer
    chat = tok.encode_chat([{"role": "user", "content": CHAT}])
    text = tok.encode(Path(TEXT).read_text())[:512]
    for e in engines.values():
        run_once(e, chat, 8)  # warm-up: first touch of the weights
    decode = {k: [] for k in args.layouts}
    ttft = {k: [] for k in args.layouts}
    for r in range(args.runs):
        for layout in (args.layouts if r % 2 == 0 else args.layouts[::-1]):
            decode[layout].append(run_once(engines[layout], chat, args.tokens)[0].decode_tok_s)
            ttft[layout].append(run_once(engines[layout], text, 1)[0].ttft_s)
    result, base = {}, args.layouts[0]
    for name in args.layouts:
        result[name] = {"decode_tok_s": statistics.median(decode[name]), "ttft_512_s": statistics.median(ttft[name]),
                        "decode_runs": decode[name], "ttft_runs": ttft[name]}
        print(f"{name:6s} decode {result[name]['decode_tok_s']:7.1f} tok/s   TTFT(512) {result[name]['ttft_512_s']:.3f} s")
    ratios = {}
    for name in args.layouts[1:]:
        ratios[name] = {"decode": result[name]["decode_tok_s"] / result[base]["decode_tok_s"],
                        "ttft_512": result[name]["ttft_512_s"] / result[base]["ttft_512_s"],
                        "decode_per_run": [a / b for a, b in zip(decode[name], decode[base])]}
        print(f"decode {name} / {base} x{ratios[name]['decode']:.2f} (per run "
              f"{' '.join(f'{v:.2f}' for v in ratios[name]['decode_per_run'])})   "
              f"TTFT {name} / {base} x{ratios[name]['ttft_512']:.2f}")
    if args.json:
        out = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
               "file": args.model, "switch": args.switch, "runs_as": loaded.runs_as_text(), "ratios_vs_" + base: ratios, **result}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
