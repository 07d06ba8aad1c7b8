"""Prompt lookup replayed: how many verification passes the engine's real proposer and γ controller would
spend on recorded greedy answers, at fixed per-pass costs. No timing noise, so two proposers compare on the
same answers exactly (the machine's load moves a live lookup run's ratio by ±0.2x).

1. The bundled SmolLM2-135M-Instruct (int4 weights) answers each prompt greedily (`-n` tokens).
2. For each answer, the rounds `Engine.generate` would play with a proposer: the proposer guesses from the
   context, `GammaController.gamma_for` cuts the guess to the γ that pays for its kind, the guesses that
   match the answer are accepted, and the round costs the pass over γ + 1 tokens (`--costs`, ms for
   T = 1, 2, 3, 4, then `--slope` ms per further token: by default this CPU's fused int4 step at ~300
   positions). Speed-up = answer length × cost(1) / the rounds' total cost.
3. Oracle: every round guesses exactly the tokens that will be accepted (the best any controller could do
   with this proposer's guesses).

`--baseline REF` replays the PromptLookupProposer of another git revision beside this one (e.g. HEAD~3), with
this revision's γ controller for both, so the proposers alone differ.

Usage: python benchmarks/lookup_replay.py [-n 128] [--baseline REV] [--out benchmarks/results/lookup-replay.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_record import write_run  # noqa: E402
from speculative import PARAGRAPH, PROMPTS  # noqa: E402

from edgellm.generate import Engine, GenerationSettings  # noqa: E402
from edgellm.loading import bundled_model_path, load_model  # noqa: E402
from edgellm.speculative import GammaController, PromptLookupProposer, VerifyCosts  # noqa: E402

LIBRARY = ("The new library opened last month in the center of town. It have three floors, a cafe and a large "
           "room for childrens books. Many people visits it every day, specially on weekends, when their are "
           "reading events and workshops. The mayor said that the library was the most important project of "
           "his term, and he hope that it will bring more people to the old town.")
MARKET = ("Yesterday I went to the market for buy some vegetables. The weather were nice and the streets was full "
          "of people. I buyed tomatos, onions and a big pumpkin, because my sister want to make a soup. On the "
          "way home I meet an old friend who I didnt see since many years, and we drinked a coffee together.")
SOLAR = ("Solar panels convert sunlight into electricity using photovoltaic cells. Over the last decade their "
         "price has fallen by more than eighty percent, which has made them affordable for many households. In "
         "some countries, homeowners can sell the extra energy they produce back to the grid. However, panels "
         "produce nothing at night, so batteries or other sources are still needed.")
TOTAL = ("def total(items):\n    t = 0\n    for i in range(len(items)):\n        if items[i]['qty'] > 0:\n"
         "            t = t + items[i]['price'] * items[i]['qty']\n    return t\n")
AVERAGE = ("def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)\n\n"
           "print(average([1, 2, 3]))\n")
REPLAY_PROMPTS = {
    "edit": PROMPTS["edit"],
    "edit library": "Correct the grammar in this text:\n\n" + LIBRARY,
    "edit market": "Fix the grammar and spelling mistakes in this text:\n\n" + MARKET,
    "proofread": "Please proofread this paragraph and return the corrected version:\n\n" + MARKET,
    "summarise": "Summarise this paragraph in two sentences:\n\n" + PARAGRAPH,
    "summarise library": "Summarize the following text:\n\n" + LIBRARY,
    "summarise solar": "Summarize this paragraph:\n\n" + SOLAR,
    "formal": "Rewrite this in a more formal tone:\n\n" + LIBRARY,
    "simpler": "Rewrite this paragraph in simpler English:\n\n" + SOLAR,
    "bullets": "Turn this paragraph into a bulleted list of key points:\n\n" + SOLAR,
    "type hints": "Add type hints and a docstring to this Python function:\n\n" + TOTAL,
    "rename": "Rename the variable t to running_total in this code:\n\n" + TOTAL,
    "fix bug": "There is a bug in this code. Find it and show the fixed code:\n\n" + AVERAGE,
    "chat": PROMPTS["chat"],
    "chat photosynthesis": "Explain how photosynthesis works to a ten-year-old.",
    "chat sleep": "Give me three tips for sleeping better.",
    "code": PROMPTS["code"],
}


def proposer_of_revision(rev: str) -> type:
    """PromptLookupProposer as edgellm/speculative.py defines it at git revision `rev`."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:edgellm/speculative.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from .", "from edgellm.")
    path = Path(tempfile.mkdtemp()) / "speculative_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("speculative_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses resolve their annotations through it)
    spec.loader.exec_module(mod)
    return mod.PromptLookupProposer


def replay(make, engine: Engine, prompt: list[int], answer: list[int], cost, hi: int) -> tuple[float, float]:
    """(speed-up with the controller, oracle speed-up) of lookup over `answer` at the per-T costs."""
    plain = len(answer) * cost(1)
    out = []
    for oracle in (False, True):
        proposer = make()
        proposer.bind(engine)
        ctl = GammaController(None, hi=hi, costs=VerifyCosts(c_verify={T: cost(T) for T in range(1, hi + 2)}),
                              kind_prior=proposer.kind_prior, free=True)
        i, spent = 0, 0.0
        while i < len(answer):
            room = len(answer) - i - 1
            guess: list[int] = []
            kind = None
            if room > 0:
                d, _ = proposer.propose(prompt + answer[:i], min(hi, room))
                kind, guess = proposer.kind, d.tolist()
            right = 0
            while right < len(guess) and guess[right] == answer[i + right]:
                right += 1
            if oracle:
                guess = guess[:right]
            elif guess:
                guess = guess[:min(ctl.gamma_for(kind), len(guess))]
            n_ok = min(right, len(guess))
            ctl.update(len(guess), n_ok, 0.0, cost(len(guess) + 1), kind)
            spent += cost(len(guess) + 1)
            i += n_ok + 1
        out.append(plain / spent)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--costs", default="2.45,3.35,3.8,4.2", help="ms of a verification pass for T = 1..4")
    ap.add_argument("--slope", type=float, default=0.45, help="ms per verified token beyond 4")
    ap.add_argument("--baseline", default="", help="git revision whose PromptLookupProposer to replay beside")
    ap.add_argument("--out", default="benchmarks/results/lookup-replay.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base_costs = [float(c) * 1e-3 for c in args.costs.split(",")]

    def cost(T: int) -> float:
        return base_costs[T - 1] if T <= len(base_costs) else base_costs[-1] + args.slope * 1e-3 * (T - len(base_costs))

    loaded = load_model(bundled_model_path(), max_seq_len=1024, weights="int4")
    engine = Engine(loaded.model, loaded.tokenizer, 1024)
    proposers = {"lookup": PromptLookupProposer}
    if args.baseline:
        proposers = {f"lookup@{args.baseline}": proposer_of_revision(args.baseline), **proposers}
    rows = []
    for name, text in REPLAY_PROMPTS.items():
        prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": text}])
        engine.reset()
        answer = list(engine.generate(prompt, GenerationSettings(max_tokens=args.max_tokens)))[-1].tokens
        row = {"prompt": name, "answer_tokens": len(answer)}
        for label, cls in proposers.items():
            row[label], row[label + " oracle"] = replay(cls, engine, prompt, answer, cost, 16)
        rows.append(row)
        print(f"{name:20s} {len(answer):4d} tokens  " + "  ".join(
            f"{k} {v:.3f}x" for k, v in row.items() if k not in ("prompt", "answer_tokens")), flush=True)
    geo = {k: math.exp(sum(math.log(r[k]) for r in rows) / len(rows)) for k in rows[0] if k not in ("prompt", "answer_tokens")}
    print("geometric mean       " + "  ".join(f"{k} {v:.3f}x" for k, v in geo.items()))
    write_run(args.out, rows, args.threads, what="prompt lookup replayed over recorded greedy answers at fixed "
              "verification costs (no timing): speed-up over plain decoding, and the oracle's",
              costs_ms={"T1..4": args.costs, "per further token": args.slope}, weights="int4",
              max_tokens=args.max_tokens, geometric_mean=geo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
