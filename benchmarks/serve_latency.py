"""`edgellm serve`: time to first token of a chat's second turn, warm (the first turn's KV prefix kept
by the server) against cold (the same request after another conversation took the cache).

Starts the real server on a free port and talks to it with the official openai client, streaming: the
client-side TTFT is from sending the request to the first content delta; the server's own figures come
from the final chunk's `timings` (prompt_n computed, cache_n reused, prompt_ms).

    python benchmarks/serve_latency.py [--system-tokens 400] [-r 5] [--threads 2] [--json results/serve-cpu.json]
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GPL = Path("/usr/share/common-licenses/GPL-3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed answer: client TTFT (s), its text, and the server's timings."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    timings: dict = {}
    for c in client.chat.completions.create(model="any", messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True):
        if c.choices and c.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            parts.append(c.choices[0].delta.content)
        timings = (c.model_extra or {}).get("timings") or timings
    return {"ttft_s": ttft or time.perf_counter() - t0, "text": "".join(parts), "timings": timings}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system-tokens", type=int, default=400, help="about this many tokens of system prompt")
    p.add_argument("-r", "--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args()

    import httpx
    import openai

    from run_record import write_run

    words = GPL.read_text().split()
    system_text = " ".join(words[: int(args.system_tokens * 0.75)])  # ~0.75 words per token in this text
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", "--port", str(port),
                             "--threads", str(args.threads), "--ctx", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        rows = []
        for r in range(args.repeat + 1):  # the first round warms the server up and is not kept
            conv = [{"role": "system", "content": f"Conversation {r}. Answer questions about this text.\n{system_text}"},
                    {"role": "user", "content": "What is this text about?"}]
            first = ask(client, conv, 16)
            turn2 = conv + [{"role": "assistant", "content": first["text"]},
                            {"role": "user", "content": "Who publishes it?"}]
            warm = ask(client, turn2, 16)
            ask(client, [{"role": "system", "content": f"Other {r}."}, {"role": "user", "content": "Hi"}], 1)
            cold = ask(client, turn2, 16)
            assert warm["text"] == cold["text"], "the kept prefix changed the answer"
            if r:
                rows.append({"warm": {"ttft_s": warm["ttft_s"], **warm["timings"]},
                             "cold": {"ttft_s": cold["ttft_s"], **cold["timings"]}})
            print(f"round {r}: prompt {warm['timings']['prompt_n'] + warm['timings']['cache_n']} tokens · "
                  f"warm TTFT {warm['ttft_s'] * 1e3:.0f} ms ({warm['timings']['cache_n']} cached) · "
                  f"cold TTFT {cold['ttft_s'] * 1e3:.0f} ms ({cold['timings']['cache_n']} cached)", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)

    def med(kind: str, key: str) -> float:
        return statistics.median(row[kind][key] for row in rows)

    summary = {"prompt_tokens": rows[0]["warm"]["prompt_n"] + rows[0]["warm"]["cache_n"],
               "warm_cache_n": rows[0]["warm"]["cache_n"], "cold_cache_n": rows[0]["cold"]["cache_n"],
               "warm_ttft_ms_median": med("warm", "ttft_s") * 1e3, "cold_ttft_ms_median": med("cold", "ttft_s") * 1e3,
               "warm_prompt_ms_median": med("warm", "prompt_ms"), "cold_prompt_ms_median": med("cold", "prompt_ms")}
    summary["ttft_speedup"] = summary["cold_ttft_ms_median"] / summary["warm_ttft_ms_median"]
    print(f"median client TTFT of the second turn ({summary['prompt_tokens']} prompt tokens): "
          f"warm {summary['warm_ttft_ms_median']:.0f} ms, cold {summary['cold_ttft_ms_median']:.0f} ms "
          f"({summary['ttft_speedup']:.1f}x)")
    if args.json:
        write_run(args.json, rows, args.threads, model="bundled SmolLM2-135M-Instruct Q4_1", summary=summary,
                  note="second turn of a chat, streamed through the openai client; warm = the first turn's KV "
                       "prefix kept by the server, cold = the same request after another conversation took the cache")


if __name__ == "__main__":
    main()
