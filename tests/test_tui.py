"""`edgellm chat` driven through Textual's Pilot on a tiny real model (no mocks of the engine, except
one fake engine that emits draft tokens to check the speculative-decoding display)."""
from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("textual")

from edgellm.generate import Done, GenerationStats, Token  # noqa: E402
from edgellm.tui.app import UI_FPS, ChatApp, StreamBatch  # noqa: E402
from edgellm.tui.history import Conversation, Message, load_conversation, save_conversation  # noqa: E402
from edgellm.tui.session import common_prefix  # noqa: E402
from edgellm.tui.stats import fmt_bytes  # noqa: E402
from edgellm.tui.widgets import AssistantMessage, Notice, StatusBar, UserMessage, printable  # noqa: E402
from tests.tui_helpers import (chat_args, enter_text, restore_threads, run_async, send, tui_model,  # noqa: E402,F401
                               type_text, wait_for)

pytestmark = pytest.mark.usefixtures("restore_threads")

SIZE = (100, 32)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """The chats' folder through $EDGELLM_DATA_DIR, the user-facing default of `edgellm chat --data-dir` (read
    once, by tui/cli.py's parser: chat_args builds it after this)."""
    d = tmp_path / "data"
    monkeypatch.setenv("EDGELLM_DATA_DIR", str(d))
    return d


@pytest.fixture
def model(tui_model):
    return tui_model


def record_prompts(app) -> list[list[int]]:
    """Wrap the engine's generate to remember each prompt it is given."""
    engine = app.session.engine
    prompts: list[list[int]] = []
    original = engine.generate

    def generate(ids, settings=None, stop=None):
        prompts.append(list(ids))
        return original(ids, settings, stop=stop)

    engine.generate = generate
    return prompts


def slow_down(app, seconds: float) -> None:
    """Make each decode step take longer, so that Esc lands mid-answer on any machine."""
    engine = app.session.engine
    step = engine.step

    def slow_step(token):
        time.sleep(seconds)
        return step(token)

    engine.step = slow_step


async def ready(pilot, app) -> None:
    await wait_for(pilot, lambda: app.chat_ready or app.load_error is not None, 60, "the model to load")
    assert app.load_error is None, app.load_error
    await pilot.pause()  # let callbacks scheduled by the mount run before the test acts (or exits)


def record_status(monkeypatch) -> list[tuple[str, str]]:
    """Every (answer line, machine line) the status bar is given."""
    lines: list[tuple[str, str]] = []
    show = StatusBar.show

    def recording_show(self, answer, machine):
        lines.append((answer, machine))
        show(self, answer, machine)

    monkeypatch.setattr(StatusBar, "show", recording_show)
    return lines


@run_async
async def test_answer_streams_and_status_shows_figures(model, data_dir, monkeypatch):
    shown: list[str] = []  # the answer's text after each batched UI update
    append = AssistantMessage.append

    async def recording_append(self, pieces):
        await append(self, pieces)
        shown.append(self.text)

    monkeypatch.setattr(AssistantMessage, "append", recording_append)
    posts: list[float] = []  # when the worker thread posted a batch to the UI
    add = StreamBatch.add

    def recording_add(self, token):
        post = add(self, token)
        if post:
            posts.append(time.perf_counter())
        return post

    monkeypatch.setattr(StreamBatch, "add", recording_add)
    status_lines = record_status(monkeypatch)
    app = ChatApp(chat_args("-m", model, "-n", "24"), memory_probe=lambda: 300 * 2**20)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        slow_down(app, 0.02)  # ≥ 50 tokens/s while the UI takes ≤ 30 updates/s: batches must form
        await type_text(pilot, "Hello there")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen.gen is not None or len(app.conv.messages) == 2, 20, "start")
        await wait_for(pilot, lambda: app.screen.gen is None, 30, "the answer")

        user, answer = app.conv.messages
        assert (user.role, user.content) == ("user", "Hello there")
        assert answer.role == "assistant" and answer.content
        n = answer.stats["generated_tokens"]
        assert n >= 8
        # streamed: several updates, each a growing prefix of the final answer
        assert len(shown) >= 2 and len(set(shown)) >= 2
        assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))
        assert answer.content.startswith(shown[0]) and shown[0] != answer.content
        # batched: posts at most UI_FPS per second (one more update flushes the rest at the end)
        assert 2 <= len(posts) <= n and len(shown) <= len(posts) + 1
        assert min(b - a for a, b in zip(posts, posts[1:])) >= 1 / UI_FPS - 1e-3
        widgets = list(app.screen.query(AssistantMessage))
        assert len(widgets) == 1 and widgets[0].text == answer.content
        assert not app.screen.query_one("#prompt").text  # the input was cleared

        # live figures while streaming: TTFT and tok/s with numbers, no finish reason yet
        live = [a for a, _ in status_lines if re.search(r"TTFT \d+\.\d{3} s · \d+\.\d tok/s", a) and a.endswith("tokens")]
        assert live, status_lines
        status = app.screen.query_one(StatusBar)
        assert re.search(r"TTFT \d+\.\d{3} s · \d+\.\d tok/s · prefill \d+ tok/s", status.answer_text)
        assert status.answer_text.endswith(f"{n} tokens ({answer.stats['finish_reason']})")
        cache = app.session.engine.cache
        used = len(app.session.engine.cached_ids)
        assert f"ctx {app.session.context_tokens(app.conv)}/256" in status.machine_text
        assert f"KV {fmt_bytes(used * cache.bytes_per_token)} / {fmt_bytes(cache.nbytes)}" in status.machine_text
        assert "mem 300.0 MiB · cpu fp32 · 1 thread · weights fp · kv f16" in status.machine_text  # auto: f16 on the CPU


@run_async
async def test_escape_stops_mid_answer_and_keeps_text(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "200"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        slow_down(app, 0.05)
        await enter_text(pilot, "Hello")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen.gen is not None and app.screen.gen.live.tokens >= 3, 20, "3 tokens")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen.gen is None, 20, "the stop")
        answer = app.conv.messages[-1]
        assert answer.stats["finish_reason"] == "stopped"
        assert 3 <= answer.stats["generated_tokens"] < 30
        assert answer.content and app.screen.query_one(AssistantMessage).text == answer.content
        assert "stopped" in str(app.screen.query_one(AssistantMessage).query_one(".footer").render())


@run_async
async def test_second_turn_prefills_only_the_new_tokens(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "16"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        prompts = record_prompts(app)
        await send(pilot, app, "Hello")
        first = app.conv.messages[-1]
        await send(pilot, app, "And again")
        second = app.conv.messages[-1]
        status = app.screen.query_one(StatusBar).answer_text

    ids1, ids2 = prompts
    answer_ids = first.tokens
    assert answer_ids and len(answer_ids) == first.stats["generated_tokens"]
    # What the engine had computed after turn 1: the prompt, then the answer (the last sampled token is
    # fed only if the answer went on, i.e. it ended by EOS).
    fed = ids1 + (answer_ids if first.stats["finish_reason"] == "eos" else answer_ids[:-1])
    assert ids2[:len(fed)] == fed  # turn 2's prompt starts with everything turn 1 computed
    s = second.stats
    assert s["reused_tokens"] == len(fed)
    assert s["prefill_tokens"] == len(ids2) - len(fed)  # only the new tokens
    # the new tokens: turn 1's last answer token if it was not fed, then the template's end of turn 1
    # and the new user message
    tail = app.session.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd again<|im_end|>\n<|im_start|>assistant\n")
    assert ids2[len(ids1) + len(answer_ids):] == tail
    assert s["prefill_tokens"] == len(tail) + len(ids1) + len(answer_ids) - len(fed)
    assert f"{s['prefill_tokens']} new + {s['reused_tokens']} reused" in status


@run_async
async def test_ctrl_n_ctrl_l_ctrl_y(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "8"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+y")  # nothing to copy yet
        await pilot.pause()
        assert app.clipboard == ""
        await send(pilot, app, "Hello")
        await pilot.press("ctrl+y")
        await pilot.pause()
        assert app.clipboard == app.conv.messages[-1].content != ""
        old_path = app.history_path
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.conv.messages == []
        assert not app.screen.query(UserMessage) and not app.screen.query(AssistantMessage)
        assert app.history_path != old_path
        assert len(load_conversation(old_path).messages) == 2  # the old chat stays saved
        await send(pilot, app, "Hi")
        assert [m.role for m in app.conv.messages] == ["user", "assistant"]
        assert len(list(app.screen.query(UserMessage))) == 1
        path = app.history_path
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert app.conv.messages == [] and not app.screen.query(UserMessage)
        assert app.history_path == path and load_conversation(path).messages == []  # same file, emptied
        assert "ctx 0/256" in app.screen.query_one(StatusBar).machine_text


@run_async
async def test_command_palette_sets_sampling_and_system_prompt(model, data_dir):
    from textual.command import CommandList, CommandPalette

    app = ChatApp(chat_args("-m", model, "-n", "8"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("New chat", "Clear chat", "Copy last answer", "Stop generation", "Set system prompt",
                      "Set temperature", "Set top-p", "Set max tokens"):
            assert title in titles
        assert not any(t.startswith("Speculative decoding") for t in titles)  # no --draft: no toggle
        prompt = app.screen.query_one("#prompt")
        # two through the palette itself (Ctrl+P, search, Enter), the others by their callbacks
        by_title = {c.title: c for c in app.get_system_commands(app.screen)}
        for title, value in (("Set top-p", "0.8"), ("Set max tokens", "5")):
            by_title[title].callback()
            await pilot.pause()
            await enter_text(pilot, value)
            await pilot.press("enter")
            await pilot.pause()
        for title, value, expect in (("Set temperature", "0.5", "/temp "), ("Set system prompt", "Be brief", "/system ")):
            await pilot.press("ctrl+p")
            await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), 10, "the palette")
            palette = app.screen
            await enter_text(pilot, title)
            await wait_for(pilot, lambda: palette.query_one(CommandList).option_count > 0, 10, "palette hits")
            await pilot.press("down", "enter")  # highlight the best hit, run it
            await wait_for(pilot, lambda: prompt.text == expect, 10, f"{expect!r} in the prompt")
            assert app.screen.focused is prompt
            await enter_text(pilot, value)
            await pilot.press("enter")
            await pilot.pause()
        s = app.session.settings
        assert (s.temperature, s.top_p, s.max_tokens) == (0.5, 0.8, 5)
        assert app.conv.system == "Be brief"


@run_async
async def test_startup_screen_shows_load_progress_and_thread_default(model, data_dir, monkeypatch):
    import threading

    from edgellm.args import load_from_args
    from edgellm.tui.screens import LoadingScreen

    gate = threading.Event()
    stages: list[str] = []
    stage = LoadingScreen.stage
    monkeypatch.setattr(LoadingScreen, "stage", lambda self, text: (stages.append(text), stage(self, text)))

    def gated_loader(args, on_tensor=None):
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
            on_tensor(name)
            time.sleep(0.1)  # progress posts are limited to 30 a second
        assert gate.wait(20), "the test never opened the gate"
        return load_from_args(args, on_tensor=on_tensor)

    import torch

    args = chat_args("-m", model)
    args.threads = None  # as `edgellm chat` without --threads: torch's choice less one, for the UI
    expect = max(1, torch.get_num_threads() - 1)
    app = ChatApp(args, loader=gated_loader)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen), 10, "the loading screen")
        detail = app.screen.query_one("#loading-detail")
        await wait_for(pilot, lambda: "2 tensors" in str(detail.render()), 10, "load progress")
        assert "model.layers.0.self_attn.q_proj.weight" in str(detail.render())
        assert f"loading {model}" in str(app.screen.query_one("#loading-what").render())
        assert not app.chat_ready
        gate.set()
        await ready(pilot, app)
        assert [s.split(" ")[0] for s in stages] == ["allocating", "warming"]
        engine = app.session.engine  # warmed up, then emptied: the first answer starts from nothing
        assert engine.cached_ids == [] and engine.cache.length == 0
        assert app.args.threads == expect
        # torch applies the count to threads started after it is set: the generation worker's
        seen: list[int] = []
        generate = app.session.engine.generate

        def recording_generate(ids, settings=None, stop=None):
            seen.append(torch.get_num_threads())
            return generate(ids, settings, stop=stop)

        app.session.engine.generate = recording_generate
        app.session.settings.max_tokens = 2
        await send(pilot, app, "Hi")
        assert seen == [expect]
        expect_text = f"cpu fp32 · {expect} thread" + ("s" if expect > 1 else "")
        assert expect_text in app.screen.query_one(StatusBar).machine_text


@run_async
async def test_history_file_option_and_kv_int8(model, data_dir, tmp_path):
    """--history-file PATH keeps the chat there and reopens it; --kv int8 shows in the status bar with
    the quantized cache's bytes."""
    path = tmp_path / "mine" / "chat.json"
    app = ChatApp(chat_args("-m", model, "-n", "6", "--kv", "int8", "--history-file", str(path)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        assert app.history_path == path and not path.exists()  # no file for an empty chat
        await send(pilot, app, "Hello")
        cache = app.session.engine.cache
        machine = app.screen.query_one(StatusBar).machine_text
        assert cache.kind == "int8" and "weights fp · kv int8" in machine
        assert f"KV {fmt_bytes(cache.length * cache.bytes_per_token)} / {fmt_bytes(cache.nbytes)}" in machine
        answer = app.conv.messages[-1].content
    assert [m.content for m in load_conversation(path).messages] == ["Hello", answer]
    assert not (data_dir / "chats").exists()  # nothing written to the default folder

    app = ChatApp(chat_args("-m", model, "-n", "6", "--history-file", str(path)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        assert [m.content for m in app.conv.messages] == ["Hello", answer]
        assert app.screen.query_one(AssistantMessage).text == answer


def test_chat_accepts_every_run_option():
    from edgellm.cli import _load_extensions, build_parser

    _load_extensions()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    run, chat = sub.choices["run"], sub.choices["chat"]
    run_only = {"--raw", "--truncate", "--json"}  # one-shot prompt options
    missing = {o for o in run._option_string_actions if o not in chat._option_string_actions} - run_only
    assert not missing
    args = parser.parse_args(["chat", "-m", "M", "--weights", "int4", "--kv", "int8", "--draft", "lookup",
                              "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05",
                              "--repeat-penalty", "1.1", "--seed", "3", "-n", "64", "--show-drafts", "--resume"])
    assert (args.weights, args.kv, args.draft, args.temperature, args.top_p, args.max_tokens) == (
        "int4", "int8", "lookup", 0.7, 0.9, 64)
    assert args.show_drafts and args.resume


@run_async
async def test_history_saved_atomically_and_resumed(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "10", "--system", "You are terse."))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Hello")
        answer = app.conv.messages[-1].content
        path = app.history_path
    files = list((data_dir / "chats").iterdir())
    assert files == [path]  # one chat file, no temp file left behind
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved["system"] == "You are terse."
    assert [(m["role"], m["content"]) for m in saved["messages"]] == [("user", "Hello"), ("assistant", answer)]
    assert saved["messages"][1]["stats"]["generated_tokens"] >= 1

    app = ChatApp(chat_args("-m", model, "-n", "10", "--resume"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        assert app.history_path == path and app.conv.system == "You are terse."
        assert [m.content for m in app.conv.messages] == ["Hello", answer]
        assert str(app.screen.query_one(UserMessage).render()) == "Hello"
        assert app.screen.query_one(AssistantMessage).text == answer
        prompts = record_prompts(app)
        await send(pilot, app, "More")
    text = app.session.tokenizer.decode(prompts[0], skip_special=False)
    assert "You are terse." in text and "Hello" in text and "More" in text
    assert len(load_conversation(path).messages) == 4


def test_save_is_atomic(tmp_path, monkeypatch):
    import os

    from edgellm.errors import OutputError

    path = tmp_path / "chat.json"
    save_conversation(Conversation(messages=[Message("user", "first")]), path)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OutputError, match="chat.json"):
        save_conversation(Conversation(messages=[Message("user", "second")]), path)
    assert load_conversation(path).messages[0].content == "first"  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]  # and the temp file is gone


@run_async
async def test_full_context_drops_oldest_turns_keeps_system(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "24", "--ctx", "110", "--system", "Be brief."))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        prompts = record_prompts(app)
        for text in ("Hello", "Tell me more", "And more"):
            await send(pilot, app, text)
        assert app.conv.context_start > 0
        assert any("context full" in str(n.render()) for n in app.screen.query(Notice))
        dropped = [w for w in app.screen.query(UserMessage) if w.has_class("dropped")]
        assert dropped
        last = app.session.tokenizer.decode(prompts[-1], skip_special=False)
        assert "Be brief." in last and "And more" in last and "Hello" not in last
        assert all(len(p) + 1 <= 110 for p in prompts)
        # a message that cannot fit at all: a notice, not sent, not kept, the chat goes on
        before = list(app.conv.messages)
        await enter_text(pilot, "lazy dog " * 80)
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen.gen is None and app.conv.messages == before and len(prompts) == 3
        assert "needs" in str(list(app.screen.query(Notice))[-1].render())
        await send(pilot, app, "Short")
        assert app.conv.messages[-2].content == "Short" and app.conv.messages[-1].role == "assistant"


@run_async
async def test_slash_commands_change_settings(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "40"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        for line in ("/temp 0.7", "/top_p 0.9", "/max 3", "/seed 5", "/system Be kind", "/temp abc", "/top_p 2",
                     "/nonsense"):
            await enter_text(pilot, line)
            await pilot.press("enter")
            await pilot.pause()
        s = app.session.settings
        assert (s.temperature, s.top_p, s.max_tokens, s.seed) == (0.7, 0.9, 3, 5)
        assert app.conv.system == "Be kind"
        assert any(str(n.render()) == "system: Be kind" for n in app.screen.query(Notice))
        errors = [n.message for n in app._notifications if n.severity == "error"]
        assert len(errors) == 3 and "unknown command /nonsense" in errors[-1]
        assert not app.conv.messages  # none of the commands went to the model
        await send(pilot, app, "Hi")
        assert app.conv.messages[-1].stats["generated_tokens"] <= 3
        await enter_text(pilot, "/draft on")
        await pilot.press("enter")
        await pilot.pause()
        assert app.session.settings.draft  # unchanged: no draft model here, an error notification instead


@run_async
async def test_newline_keys_do_not_send(model, data_dir):
    app = ChatApp(chat_args("-m", model, "-n", "4"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await type_text(pilot, "one")
        await pilot.press("ctrl+j")
        await type_text(pilot, "two")
        await pilot.press("shift+enter")
        await type_text(pilot, "three")
        assert app.screen.query_one("#prompt").text == "one\ntwo\nthree"
        assert app.conv.messages == []
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.conv.messages) == 2 and app.screen.gen is None, 20, "the answer")
        assert app.conv.messages[0].content == "one\ntwo\nthree"
        assert str(app.screen.query_one(UserMessage).render()) == "one\ntwo\nthree"


@run_async
async def test_load_error_is_shown_and_exits_with_code_2(tmp_path, data_dir):
    from edgellm.errors import EdgeLLMError
    from edgellm.loading import resolve_model

    missing = tmp_path / "no-such-model"
    with pytest.raises(EdgeLLMError) as cli_error:
        resolve_model(missing)
    app = ChatApp(chat_args("-m", str(missing)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None, 20, "the error")
        assert app.load_error == str(cli_error.value)
        shown = str(app.screen.query_one("#loading-what").render())
        assert shown == f"edgellm: error: {cli_error.value}"
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 2


# ------------------------------------------------------------------------------------------------
# Speculative decoding display, with an engine that emits draft-flagged tokens
# ------------------------------------------------------------------------------------------------
class FakeDraftEngine:
    """Emits T D D T D D D T ... like a speculative engine: 3 rounds, 6 of 8 drafts accepted."""

    PATTERN = [("The", False), (" cat", True), (" sat", True), (" on", False), (" the", True),
               (" mat", True), (" and", True), (" slept", False), (".", True), (" Zzz", True)]

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_seq_len = 256
        self.cached_ids: list[int] = []
        self.draft = object()  # a proposer, as far as the app is concerned

    def generate(self, ids, settings=None, stop=None):
        for i, (text, from_draft) in enumerate(self.PATTERN):
            time.sleep(0.04)  # slower than the UI's batches, so the live figures show
            yield Token(100 + i, text, 0.04 * (i + 1), from_draft)
        stats = GenerationStats(prompt_tokens=len(ids), prefill_tokens=len(ids), generated_tokens=len(self.PATTERN),
                                ttft_s=0.01, decode_tok_s=100.0, prefill_tok_s=1000.0, finish_reason="eos",
                                draft_proposed=8, draft_accepted=6)
        yield Done(stats, "".join(t for t, _ in self.PATTERN), [100 + i for i in range(len(self.PATTERN))])


@run_async
async def test_show_drafts_colours_accepted_tokens_and_status_shows_acceptance(model, data_dir, monkeypatch):
    status_lines = record_status(monkeypatch)
    app = ChatApp(chat_args("-m", model, "--draft", "self", "--show-drafts"),
                  engine_factory=lambda args, loaded: FakeDraftEngine(loaded.tokenizer))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Hi")
        # while streaming: how many of the tokens so far came from drafts
        live = [re.search(r"(\d+)/(\d+) tokens from drafts", a) for a, _ in status_lines]
        live = [(int(m[1]), int(m[2])) for m in live if m]
        assert live and all(d == sum(f for _, f in FakeDraftEngine.PATTERN[:n]) for d, n in live)
        widget = app.screen.query_one(AssistantMessage)
        text = widget._styled
        drafted = "".join(text.plain[s.start:s.end] for s in text.spans if s.style)
        assert drafted == "".join(t for t, d in FakeDraftEngine.PATTERN if d)
        status = app.screen.query_one(StatusBar)
        # 6/8 accepted; rounds = target-chosen tokens after the first = 2 → 3.00 accepted per round
        assert "draft 75% accepted, 3.00 per round" in status.answer_text
        assert "draft self" in status.machine_text
        # an 80-column terminal: the bar grows and breaks lines between fields, so every figure shows
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        shown = str(status.render()).splitlines()
        assert len(shown) == status.size.height > 2 and all(len(line) <= 78 for line in shown)
        for field in (status.answer_text + " · " + status.machine_text).split(" · "):
            assert any(field in line for line in shown), field
        await enter_text(pilot, "/draft off")
        await pilot.press("enter")
        await pilot.pause()
        assert app.session.engine.draft is None and "draft off" in status.machine_text
        assert not app.session.settings.draft
        # the palette offers the opposite of the current state
        toggle = [c for c in app.get_system_commands(app.screen) if c.title.startswith("Speculative decoding")]
        assert [c.title for c in toggle] == ["Speculative decoding: turn on"]
        await toggle[0].callback()
        await pilot.pause()
        assert app.session.engine.draft is not None and "draft self" in status.machine_text
        await enter_text(pilot, "/draft off")
        await pilot.press("enter")
        await enter_text(pilot, "/draft on")
        await pilot.press("enter")
        await pilot.pause()
        assert app.session.engine.draft is not None and app.session.settings.draft


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0


@run_async
async def test_real_speculative_engine_with_show_drafts(model, data_dir):
    """The real engine with prompt-lookup drafts: the status shows acceptance, and the coloured text
    covers exactly the tokens the engine flagged as accepted drafts."""
    # a fixed γ: adaptive lookup may verify no guess at all on a short chat answer (γ 0 where guesses do not pay)
    app = ChatApp(chat_args("-m", model, "-n", "60", "--draft", "lookup", "--draft-tokens", "2", "--show-drafts"))
    flagged: list[str] = []
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        engine = app.session.engine
        original = engine.generate

        def generate(ids, settings=None, stop=None):
            for ev in original(ids, settings, stop=stop):
                if isinstance(ev, Token) and ev.from_draft:
                    flagged.append(ev.text)
                yield ev

        engine.generate = generate
        await send(pilot, app, "Hello")
        stats = app.conv.messages[-1].stats
        assert stats["draft_proposed"] > 0, "prompt lookup proposed nothing on this answer"
        pct = 100 * stats["draft_accepted"] / stats["draft_proposed"]
        assert f"draft {pct:.0f}% accepted" in app.screen.query_one(StatusBar).answer_text
        text = app.screen.query_one(AssistantMessage)._styled
        drafted = "".join(text.plain[s.start:s.end] for s in text.spans if s.style)
        assert flagged and drafted == printable("".join(flagged))
