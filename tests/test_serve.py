"""`edgellm serve`: the real server, started on a free port with the bundled SmolLM2-135M, spoken to
with the official `openai` client and with raw HTTP. The reference for every answer is `edgellm run`
on the same prompt and settings."""
from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest

from edgellm import cli
from edgellm.args import engine_from_args

KEY = "sk-test-edgellm"
CTX = 2048  # the session's bundled model (tests/conftest.py) is loaded with this context
THREADS = "2"
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=120)

    def post(self, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=data, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_for(self, cond, what: str, timeout: float = 30.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = self.health()
            if cond(h):
                return h
            time.sleep(0.05)
        raise AssertionError(f"server never reached: {what} (last /health: {h})")

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if needle in line]


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled):
    """The server, started at once; the CLI's reference answers are computed while it loads."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    port = free_port()
    with open(log, "w") as out:
        # --weights fp, as the session's bundled fixture: the float model's greedy answers do not hinge on
        # int8-rounded activations (with the Q4_1 file as stored, "What is the capital of France?" starts with a
        # near-tie between "The" and "L'" that the prompt's prefill split can tip)
        proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", "--port", str(port), "--ctx", str(CTX),
                                 "--weights", "fp", "--threads", THREADS, "--api-key", KEY, "--queue", "2"],
                                stdout=out, stderr=subprocess.STDOUT)
    running = Running(proc, f"http://127.0.0.1:{port}", log)
    try:
        running.ref = reference_answers(bundled)
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{running.url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < end, f"the server did not start:\n{log.read_text()}"
            time.sleep(0.2)
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def edgellm_run(bundled, *args: str) -> dict:
    """`edgellm run --json` in this process (cli.main, all of it but the model load, which is the session's
    bundled model: the same file, loaded with the CLI's defaults and the server's context)."""
    out = io.StringIO()
    # cli.main appends the extension parsers to a module-level list: start from an empty one each time
    with mock.patch.object(cli, "EXTENSIONS", []), mock.patch.object(cli, "load_from_options", lambda o: bundled), \
            contextlib.redirect_stdout(out):
        assert cli.main(["run", *args, "--json", "--ctx", str(CTX), "--weights", "fp"]) == 0
    return json.loads(out.getvalue())


def reference_answers(bundled) -> dict:
    """The CLI's answers: greedy chat, greedy raw completion, seeded sampling."""
    assert bundled.model.rope_len == CTX
    return {"chat": edgellm_run(bundled, QUESTION, "-n", "24"),
            "raw": edgellm_run(bundled, "The capital of France is", "--raw", "-n", "12"),
            "sampled": edgellm_run(bundled, "Write a haiku about the sea.", "-n", "20", "--temperature", "0.9",
                                   "--top-p", "0.95", "--top-k", "40", "--seed", "7")}


@pytest.fixture(scope="module")
def reference(server):
    return server.ref


# ------------------------------------------------------------------------------------------------
# Answers: the same text as edgellm run, whole or streamed
# ------------------------------------------------------------------------------------------------
def test_chat_greedy_matches_run_whole_and_streamed(server, reference):
    ref = reference["chat"]
    client = server.client()
    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.prompt_tokens == ref["prompt_tokens"]
    assert r.usage.completion_tokens == len(ref["tokens"])
    assert r.usage.total_tokens == ref["prompt_tokens"] + len(ref["tokens"])
    assert r.choices[0].finish_reason == ("length" if len(ref["tokens"]) == 24 else "stop")
    t = r.model_extra["timings"]
    assert t["predicted_n"] == len(ref["tokens"]) and t["prompt_n"] + t["cache_n"] == ref["prompt_tokens"]
    assert t["predicted_per_second"] > 0 and t["ttft_ms"] > 0

    chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 3  # streamed token by token, not in one piece
    assert "".join(deltas) == ref["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["timings"]["predicted_n"] == len(ref["tokens"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["tokens"])
    # the same prompt again: everything but the last prompt token comes from the KV cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == ref["prompt_tokens"] - 1


def test_completion_greedy_matches_run_raw(server, reference):
    ref = reference["raw"]
    client = server.client()
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=12, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.usage.prompt_tokens == ref["prompt_tokens"] and r.usage.completion_tokens == len(ref["tokens"])
    stream = client.completions.create(model="any", prompt="The capital of France is", max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref["text"]


def test_stop_strings_and_seeded_sampling(server, reference):
    ref = reference["chat"]
    cut = ref["text"].index(" Paris")  # the greedy answer names the capital
    client = server.client()
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=24, temperature=0, stop=[" Paris", "zzz"])
    assert r.choices[0].message.content == ref["text"][:cut]
    assert r.choices[0].finish_reason == "stop"

    sampled = reference["sampled"]
    body = dict(model="any", messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=20,
                temperature=0.9, top_p=0.95, seed=7, extra_body={"top_k": 40})
    texts = [client.chat.completions.create(**body).choices[0].message.content for _ in range(2)]
    assert texts == [sampled["text"], sampled["text"]]
    other = client.chat.completions.create(**{**body, "seed": 8}).choices[0].message.content
    assert other != sampled["text"]


def test_prefix_reuse_shows_in_timings(server):
    client = server.client()
    system = {"role": "system", "content": "You are a terse geography tutor. Answer in one short sentence."}
    turn1 = [system, {"role": "user", "content": QUESTION}]
    a1 = client.chat.completions.create(model="any", messages=turn1, max_tokens=16, temperature=0)
    p1, c1 = a1.usage.prompt_tokens, a1.usage.completion_tokens
    # the cache holds the prompt and the answer (but the last token when the answer ran out of room)
    kept = p1 + c1 - (a1.choices[0].finish_reason == "length")
    turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "And of Germany?"}]
    warm = client.chat.completions.create(model="any", messages=turn2, max_tokens=16, temperature=0)
    tw = warm.model_extra["timings"]
    assert tw["cache_n"] == kept == warm.usage.prompt_tokens_details.cached_tokens
    assert tw["prompt_n"] == warm.usage.prompt_tokens - kept < 20  # only the new turn is computed

    # another conversation takes the cache; the same second turn then starts cold, with the same answer
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hi."}], max_tokens=2)
    cold = client.chat.completions.create(model="any", messages=turn2, max_tokens=16, temperature=0)
    tc = cold.model_extra["timings"]
    assert tc["cache_n"] < 10 and tc["prompt_n"] == cold.usage.prompt_tokens - tc["cache_n"]
    assert cold.choices[0].message.content == warm.choices[0].message.content


def test_models_health_and_auth(server):
    assert server.health()["status"] == "ok"  # no key needed
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    for key in (None, "wrong"):
        with pytest.raises(openai.AuthenticationError):
            server.client(key).models.list()
        r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/v1/models", headers={"X-Api-Key": KEY}, timeout=10)
    assert r.status_code == 200


def test_port_in_use_is_one_line_before_the_model_loads(capsys):
    with socket.socket() as taken, mock.patch.object(cli, "EXTENSIONS", []), \
            mock.patch("edgellm.args.load_from_args", side_effect=AssertionError("loaded")):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgellm: error: cannot listen on 127.0.0.1:") and "in use" in err


def test_default_bind_is_localhost():
    with mock.patch.object(cli, "EXTENSIONS", []):
        cli._load_extensions()
        args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8080, None)


# ------------------------------------------------------------------------------------------------
# Bad requests: a 4xx with an OpenAI error body, and the server goes on
# ------------------------------------------------------------------------------------------------
LONG = "word " * (CTX + 50)
CHAT = "/v1/chat/completions"
BAD = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"\xff\xfe", 400, None),
    (CHAT, [1, 2], 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content.0.type"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "seed": "x"}, 400, "seed"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop.0"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ("/v1/nothing", {}, 404, None),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server):
    for path, body, status, param in BAD:
        r = server.post(path, body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], (body, err)
        if param is not None:
            assert err["param"] == param, (body, err)
    long = server.post(CHAT, {"messages": [{"role": "user", "content": LONG}]}).json()["error"]
    assert long["code"] == "context_length_exceeded" and "context holds 2048" in long["message"]
    assert httpx.put(f"{server.url}/health", timeout=10).status_code == 405
    huge = server.post(CHAT, b" " * (32 * 2**20 + 1))  # past the 32 MiB cap: refused, not parsed
    assert huge.status_code == 413 and "larger than 32 MiB" in huge.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):  # the official client sees a 400 too
        server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": LONG}])
    assert server.log_lines("Traceback") == []  # no 500 among them
    # unknown fields are ignored (llama-server's rule); the server still answers
    ok = server.post(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_prompt": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


# ------------------------------------------------------------------------------------------------
# One at a time: a client that leaves stops its generation; a full queue answers 429
# ------------------------------------------------------------------------------------------------
LONG_ANSWER = {"messages": [{"role": "user", "content": "Count from one to one thousand."}], "max_tokens": 400,
               "ignore_eos": True, "temperature": 0}


@contextlib.contextmanager
def streaming(server, body):
    """A streaming request, open until the block ends (then the client hangs up); yields its data lines."""
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server.url}{CHAT}", content=json.dumps({**body, "stream": True}),
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            yield (line for line in r.iter_lines() if line.startswith("data: "))


def test_client_disconnect_stops_generation(server):
    before = len(server.log_lines("(client disconnected)"))
    with streaming(server, LONG_ANSWER) as lines:
        for _ in range(4):
            next(lines)
    server.wait_for(lambda h: h["running"] == 0, "the stream's generation stopped", timeout=20)
    line = server.log_lines("(client disconnected)")[before]
    generated = int(line.split(" + ")[1].split()[0])
    assert generated < 200  # stopped at once, far short of the 400 asked for

    # a whole (non-streamed) answer whose client times out stops too
    with pytest.raises(httpx.ReadTimeout):
        server.post(CHAT, LONG_ANSWER, timeout=httpx.Timeout(120, read=1.0))
    server.wait_for(lambda h: h["running"] == 0, "the whole answer's generation stopped", timeout=20)
    assert len(server.log_lines("(client disconnected)")) == before + 2
    r = server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
    assert r.usage.completion_tokens <= 2


def test_queue_runs_in_order_and_answers_429_when_full(server):
    results: dict[str, float] = {}

    def ask(name: str) -> None:
        r = server.post(CHAT, {"messages": [{"role": "user", "content": f"Say {name}."}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        results[name] = time.monotonic()

    with streaming(server, LONG_ANSWER) as lines:
        next(lines)
        server.wait_for(lambda h: h["running"] == 1, "A runs")
        # a waiting client that gives up leaves the queue at once
        with pytest.raises(httpx.ReadTimeout):
            server.post(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, timeout=httpx.Timeout(60, read=0.5))
        server.wait_for(lambda h: h["waiting"] == 0, "the impatient request left the queue")
        assert server.health()["running"] == 1
        threads = []
        for name, waiting in (("B", 1), ("C", 2)):
            threads.append(threading.Thread(target=ask, args=(name,)))
            threads[-1].start()
            server.wait_for(lambda h: h["waiting"] == waiting, f"{name} waits")
        with pytest.raises(openai.RateLimitError) as e:  # queue 2: B and C wait, D is refused
            server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": "D"}])
        assert e.value.body["code"] == "queue_full"
        assert not results  # nothing ran while A held the model
    for t in threads:
        t.join(120)
    assert sorted(results, key=results.get) == ["B", "C"]
    assert server.health() == {"status": "ok", "running": 0, "waiting": 0}


# ------------------------------------------------------------------------------------------------
# Speculative decoding behind the API: the same greedy text, draft counts in the timings
# ------------------------------------------------------------------------------------------------
def test_draft_counts_in_timings_and_same_greedy_text(bundled):
    """The app in process (Starlette's TestClient) on the session's model with --draft lookup."""
    import argparse

    from starlette.testclient import TestClient

    from edgellm.serve import Server
    from edgellm.tui.session import ChatSettings

    prompt = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."
    plain = edgellm_run(bundled, prompt, "-n", "24")
    args = argparse.Namespace(kv="fp", draft="lookup", draft_tokens=None, compile="auto")
    server = Server(engine_from_args(args, bundled), "bundled", ChatSettings(max_tokens=None))
    with TestClient(server.app()) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                    "max_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == plain["text"]
    t = body["timings"]
    assert t["draft"] == "lookup" and t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    assert t["draft_acceptance_rate"] == pytest.approx(t["draft_n_accepted"] / t["draft_n"])
