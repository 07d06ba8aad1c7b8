"""edgellm vs Hugging Face transformers on the same weights, same process, same threads.

Decode tok/s (128 greedy tokens after a short chat prompt) and TTFT for a 512-token prompt from
/usr/share/common-licenses/GPL-3, on the bundled SmolLM2-135M-Instruct (fp32, CPU).
Usage: python benchmarks/foundation_vs_transformers.py [--threads 2] [-r 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from edgellm.generate import Engine, GenerationSettings
from edgellm.loading import bundled_model_path, load_model

TEXT = Path("/usr/share/common-licenses/GPL-3")


def edgellm_run(engine, ids, n):
    engine.reset()
    done = list(engine.generate(ids, GenerationSettings(max_tokens=n, ignore_eos=True)))[-1]
    return done.stats.ttft_s, done.stats.decode_tok_s


def hf_run(model, ids, n):
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(x, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        ttft = time.perf_counter() - t0
        past = out.past_key_values
        t1 = time.perf_counter()
        for _ in range(n - 1):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        decode = (n - 1) / (time.perf_counter() - t1)
    return ttft, decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/foundation-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    path = bundled_model_path()
    lm = load_model(path, max_seq_len=2048)
    engine = Engine(lm.model, lm.tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    chat = lm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story about a lighthouse keeper."}])
    long_ids = lm.tokenizer.encode(TEXT.read_text())[:512]
    rows = {"edgellm": {"ttft_512_s": [], "decode_tok_s": []}, "transformers": {"ttft_512_s": [], "decode_tok_s": []}}
    edgellm_run(engine, chat, 8), hf_run(hf, chat, 8)  # warm-up
    for _ in range(args.repeats):  # interleaved so both see the same machine load
        rows["edgellm"]["ttft_512_s"].append(edgellm_run(engine, long_ids, 1)[0])
        rows["transformers"]["ttft_512_s"].append(hf_run(hf, long_ids, 1)[0])
        rows["edgellm"]["decode_tok_s"].append(edgellm_run(engine, chat, args.n)[1])
        rows["transformers"]["decode_tok_s"].append(hf_run(hf, chat, args.n)[1])
    summary = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rows.items()}
    result = {
        "what": "edgellm vs transformers, bundled SmolLM2-135M-Instruct fp32 (weights dequantized from Q4_1)",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "median": summary, "runs": rows,
        "ratio_edgellm_over_transformers": {
            "decode_tok_s": summary["edgellm"]["decode_tok_s"] / summary["transformers"]["decode_tok_s"],
            "ttft_512_speedup": summary["transformers"]["ttft_512_s"] / summary["edgellm"]["ttft_512_s"]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"], indent=2), json.dumps(result["ratio_edgellm_over_transformers"]))


if __name__ == "__main__":
    main()
