"""Long use in one process, with the bundled model: many `run` generations (each with a fresh engine and
KV cache, as `edgellm run` builds them) and one long chat (many turns, the oldest dropped as the context
fills, the history saved after every answer). Resident memory, open file descriptors and threads are read
as it goes; they should stay flat. Writes benchmarks/results/long-use.json.

    python benchmarks/long_use.py                       # 1000 runs + a 10,000-token chat
    python benchmarks/long_use.py --runs 100 --chat-tokens 2000
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from run_record import write_run  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")


def resources() -> dict:
    import psutil

    p = psutil.Process()
    return {"rss_mib": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds(), "threads": p.num_threads(),
            "py_threads": threading.active_count()}


def sentences(n: int, max_words: int = 52) -> list[str]:
    words = TEXT.read_text().split() if TEXT.is_file() else ("the quick brown fox jumps over the lazy dog " * 50).split()
    out, i = [], 0
    while len(out) < n:
        k = min(max_words, 12 + (len(out) * 7) % 40)
        out.append(" ".join(words[i:i + k]) + "?")
        i = (i + k) % max(1, len(words) - 60)
    return out


def slope_per_100(rows: list[dict], key: str, x: str) -> float:
    """Least-squares growth of `key` per 100 of `x` (after the first sample: warm-up)."""
    pts = [(r[x], r[key]) for r in rows[1:]]
    if len(pts) < 2:
        return 0.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    return 100 * sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else 0.0


def many_runs(args, loaded) -> tuple[list[dict], dict]:
    from edgellm.args import engine_from_args, sampling_from_args
    from edgellm.cli import build_parser, prompt_ids
    from edgellm.generate import Done, GenerationSettings

    prompts = sentences(args.runs, args.max_words)
    rows = []
    t0 = time.perf_counter()
    tokens = 0
    for i, text in enumerate(prompts, 1):
        cli_args = build_parser().parse_args(["run", text, "-n", str(args.max_tokens), "--temperature", "0.7",
                                              "--seed", str(i), "--ctx", str(args.ctx)])
        engine = engine_from_args(cli_args, loaded)  # a fresh engine and KV cache, as each `edgellm run` makes
        settings = GenerationSettings(max_tokens=args.max_tokens, sampling=sampling_from_args(cli_args))
        for ev in engine.generate(prompt_ids(cli_args, loaded.tokenizer, text), settings):
            if isinstance(ev, Done):
                tokens += ev.stats.generated_tokens
        del engine
        if i == 1 or i % args.every == 0 or i == len(prompts):
            rows.append({"part": "run", "runs": i, "generated_tokens": tokens,
                         "seconds": round(time.perf_counter() - t0, 1), **resources()})
            print(rows[-1], flush=True)
    summary = {"runs": len(prompts), "generated_tokens": tokens,
               "rss_mib_first": rows[0]["rss_mib"], "rss_mib_last": rows[-1]["rss_mib"],
               "rss_mib_growth_per_100_runs": round(slope_per_100(rows, "rss_mib", "runs"), 2),
               "fds_first_last": [rows[0]["fds"], rows[-1]["fds"]],
               "threads_first_last": [rows[0]["threads"], rows[-1]["threads"]]}
    return rows, summary


def long_chat(args, loaded) -> tuple[list[dict], dict]:
    from edgellm.args import engine_from_args
    from edgellm.cli import build_parser
    from edgellm.generate import Done
    from edgellm.tui.history import Conversation, Message, load_conversation, save_conversation
    from edgellm.tui.session import ChatSession, ChatSettings

    cli_args = build_parser().parse_args(["run", "x", "--ctx", str(args.chat_ctx)])
    engine = engine_from_args(cli_args, loaded)
    session = ChatSession(engine, loaded.tokenizer, ChatSettings(temperature=0.7, seed=0, max_tokens=args.chat_answer))
    conv = Conversation(system="You are a helpful assistant. Answer briefly.")
    tok = loaded.tokenizer
    rows = []
    total = dropped = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        history = Path(tmp) / "chat.json"
        for turn_no, text in enumerate(sentences(100000, args.max_words), 1):
            conv.messages.append(Message("user", text))
            turn = session.prepare(conv)
            if turn.error:
                raise RuntimeError(turn.error)
            dropped += turn.dropped
            done = None
            for ev in session.generate(turn, threading.Event()):
                if isinstance(ev, Done):
                    done = ev
            session.record_answer(conv, done.text, done.tokens, done.stats)
            save_conversation(conv, history)
            total += len(tok.encode(text)) + done.stats.generated_tokens
            if turn_no == 1 or turn_no % args.every_turns == 0 or total >= args.chat_tokens:
                rows.append({"part": "chat", "turn": turn_no, "chat_tokens": total, "prompt_tokens": len(turn.ids),
                             "reused_tokens": done.stats.reused_tokens, "messages_dropped": dropped,
                             "ttft_s": round(done.stats.ttft_s, 3), "seconds": round(time.perf_counter() - t0, 1),
                             **resources()})
                print(rows[-1], flush=True)
            if total >= args.chat_tokens:
                break
        saved = load_conversation(history)
        assert len(saved.messages) == len(conv.messages)
    summary = {"turns": rows[-1]["turn"], "chat_tokens": total, "context": engine.max_seq_len,
               "messages_dropped": dropped, "rss_mib_first": rows[0]["rss_mib"], "rss_mib_last": rows[-1]["rss_mib"],
               "rss_mib_growth_per_100_turns": round(slope_per_100(rows, "rss_mib", "turn"), 2),
               "fds_first_last": [rows[0]["fds"], rows[-1]["fds"]],
               "threads_first_last": [rows[0]["threads"], rows[-1]["threads"]]}
    return rows, summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per run (default 16)")
    p.add_argument("--ctx", type=int, default=1024, help="context of each run's engine")
    p.add_argument("--every", type=int, default=50, help="read resources every N runs")
    p.add_argument("--chat-tokens", type=int, default=10000, help="stop the chat once it holds this many tokens")
    p.add_argument("--chat-ctx", type=int, default=1024,
                   help="the chat's context (small: old turns get dropped); the model is loaded for max(--ctx, this)")
    p.add_argument("--chat-answer", type=int, default=64, help="max tokens per answer")
    p.add_argument("--every-turns", type=int, default=5)
    p.add_argument("--max-words", type=int, default=52, help="longest prompt / user message, in words")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-m", "--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/long-use.json"))
    args = p.parse_args()

    import torch

    from edgellm.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, max_seq_len=max(args.ctx, args.chat_ctx))
    start = resources()
    rows, summary = [], {}
    if args.runs:
        r, summary["runs"] = many_runs(args, loaded)
        rows += r
    if args.chat_tokens:
        r, summary["chat"] = long_chat(args, loaded)
        rows += r
    write_run(args.out, rows, threads=args.threads,
              model=args.model or "bundled SmolLM2-135M-Instruct Q4_1 (fp32 weights)",
              after_load=start, summary=summary, pid=os.getpid())
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
