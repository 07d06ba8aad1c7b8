"""`edgellm chat`: the Textual chat app.

The model loads in a worker thread behind a startup screen; answers stream from `Engine.generate` in
another worker thread, which hands tokens to the UI in batches (at most 30 posts a second) so that
redraws never slow a fast model down.
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message as TMessage
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header

from edgellm.errors import EdgeLLMError

from .history import (Conversation, Message, history_dir, latest_history_path, load_conversation,
                      new_history_path, save_conversation)
from .screens import LoadingScreen
from .session import ChatSession, ChatSettings, Turn, with_settings
from .stats import AnswerFigures, LiveFigures, machine_line
from .widgets import AssistantMessage, Notice, PromptArea, StatusBar, UserMessage

UI_FPS = 30  # most stream updates posted to the UI per second
WELCOME = ("Type a message and press Enter · Shift+Enter or Ctrl+J: new line · Esc: stop · "
           "Ctrl+N: new chat · Ctrl+L: clear · Ctrl+Y: copy answer · /help: commands")
HELP = """`/system TEXT` system prompt (empty: none) · `/temp X` temperature · `/top_p X` · `/top_k N` · `/min_p X`
`/repeat X` repeat penalty · `/seed N|none` · `/max N` max tokens per answer · `/draft on|off` speculative decoding
`/new` new chat · `/clear` clear this chat · `/copy` copy the last answer · `/help`"""


class StreamBatch:
    """Tokens the worker thread has produced and the UI has not shown yet.

    The worker posts an update only when the UI has finished drawing the previous one, and spaces
    updates by at least 1/UI_FPS s and 3× the last update's cost (post → drawn): however slow the
    layout gets (long chats, big Markdown), the UI takes at most about a third of a core and never
    builds a backlog, so a fast model is not slowed down by redraws."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: list[Any] = []
        self._posted_at = 0.0
        self._in_flight = False
        self.interval = 1.0 / UI_FPS
        self.posts = 0

    def add(self, token: Any) -> bool:
        """Queue a token; True when the caller should post an update to the UI now."""
        now = time.perf_counter()
        with self._lock:
            self._tokens.append(token)
            if self._in_flight or now - self._posted_at < self.interval:
                return False
            self._in_flight = True
            self._posted_at = now
            self.posts += 1
            return True

    def take(self) -> list[Any]:
        with self._lock:
            out, self._tokens = self._tokens, []
        return out

    def drawn(self) -> None:
        """The UI has shown the last update (called after its refresh)."""
        with self._lock:
            cost = time.perf_counter() - self._posted_at
            self.interval = min(0.5, max(1.0 / UI_FPS, 3 * cost))
            self._in_flight = False


class Generation:
    """One answer in flight, and where it belongs."""

    def __init__(self, conv: Conversation, path: Path, turn: Turn, widget: AssistantMessage) -> None:
        self.conv, self.path, self.turn, self.widget = conv, path, turn, widget
        self.stop = threading.Event()
        self.batch = StreamBatch()
        self.live = LiveFigures(prefill_tokens=len(turn.ids) - turn.expected_reuse,
                                reused_tokens=turn.expected_reuse)


class Streamed(TMessage):
    def __init__(self, gen: Generation) -> None:
        super().__init__()
        self.gen = gen


class Finished(TMessage):
    def __init__(self, gen: Generation, done: Any = None, error: str | None = None) -> None:
        super().__init__()
        self.gen, self.done, self.error = gen, done, error


class ChatScreen(Screen):
    AUTO_FOCUS = "#prompt"  # not the conversation (the first focusable widget), whatever mounts first
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+l", "clear_chat", "Clear", priority=True),
        Binding("ctrl+y", "copy_answer", "Copy answer", priority=True),
        Binding("f12", "app.screenshot_here", "Screenshot", show=False),
    ]

    def __init__(self, chat_app: "ChatApp") -> None:
        super().__init__(id="chat-screen")
        self.chat = chat_app
        self.gen: Generation | None = None
        self.ready = False  # on_mount done: conversation shown, prompt focused
        self.figures = AnswerFigures()
        self.ctx_tokens = 0
        self._message_widgets: list[Widget] = []  # one per conv.messages entry
        self._kv_sizes: tuple[int, int] | None = None

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        yield VerticalScroll(id="chat")
        yield PromptArea(id="prompt", soft_wrap=True, show_line_numbers=False,
                         placeholder="Ask anything…  (Enter: send · Shift+Enter/Ctrl+J: new line)")
        yield StatusBar(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#chat").anchor()
        await self.show_conversation()
        self.query_one(PromptArea).focus()
        self.set_interval(1.0, self.refresh_status)
        # ready once the screen has been refreshed: the Header's title update (scheduled on its mount) has
        # run by then, so a test or a quick quit never tears the header down under it (Textual 8 raises)
        self.call_after_refresh(self._set_ready)

    def _set_ready(self) -> None:
        self.ready = True

    @property
    def conv(self) -> Conversation:
        return self.chat.conv

    @property
    def session(self) -> ChatSession:
        return self.chat.session

    async def show_conversation(self) -> None:
        """(Re)build the message list from the conversation."""
        log = self.query_one("#chat", VerticalScroll)
        await log.remove_children()
        self._message_widgets = []
        await log.mount(Notice(WELCOME, classes="welcome"))
        if self.conv.system:
            await log.mount(Notice(Text(f"system: {self.conv.system}"), classes="system"))
        for m in self.conv.messages:
            w = UserMessage(m.content) if m.role == "user" else AssistantMessage(
                m.content, stats=m.stats, show_drafts=self.chat.show_drafts)
            self._message_widgets.append(w)
        if self._message_widgets:
            await log.mount_all(self._message_widgets)
        self._mark_dropped()
        last = self.conv.last_answer()
        self.figures = AnswerFigures.from_stats(last.stats) if last and last.stats else AnswerFigures()
        self.ctx_tokens = self.session.context_tokens(self.conv)
        self.refresh_status()
        log.scroll_end(animate=False)

    def _mark_dropped(self) -> None:
        for i, w in enumerate(self._message_widgets):
            w.set_class(i < self.conv.context_start, "dropped")

    async def notice(self, text: str, kind: str = "info") -> None:
        log = self.query_one("#chat", VerticalScroll)
        await log.mount(Notice(Text(text), classes=kind))
        log.scroll_end(animate=False)

    # -- status bar --------------------------------------------------------------------------
    def refresh_status(self) -> None:
        engine = self.session.engine
        cache = getattr(engine, "cache", None)
        if self._kv_sizes is None:  # fixed at creation; the properties sum over layers each call
            self._kv_sizes = (getattr(cache, "bytes_per_token", 0) or 0, getattr(cache, "nbytes", 0) or 0)
        kv_per_token, kv_total = self._kv_sizes
        ctx = self.ctx_tokens
        if self.gen is not None:
            ctx = len(self.gen.turn.ids) + self.gen.live.tokens
        draft = self.chat.draft_name
        if draft != "none" and not self.session.settings.draft:
            draft = "off"
        machine = machine_line(
            ctx_used=ctx, ctx_max=engine.max_seq_len,
            kv_used=getattr(cache, "length", 0) * kv_per_token, kv_total=kv_total,
            memory=self.chat.memory_probe(), device=self.chat.device_name, dtype=self.chat.dtype_name,
            threads=self.chat.threads if self.chat.device_name == "cpu" else None,
            weights=self.chat.weights_name, kv=self.chat.kv_name, draft=draft)
        self.query_one(StatusBar).show(self.figures.line(), machine)

    # -- sending -----------------------------------------------------------------------------
    async def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if text.startswith("/"):
            event.area.clear()
            await self.run_slash(text)
            return
        if self.gen is not None:
            self.app.notify("an answer is still being written (Esc stops it)", severity="warning")
            return
        event.area.clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        conv = self.conv
        conv.messages.append(Message("user", text))
        user = UserMessage(text)
        self._message_widgets.append(user)
        log = self.query_one("#chat", VerticalScroll)
        await log.mount(user)
        turn = self.session.prepare(conv)
        if turn.error:
            conv.messages.pop()
            self._message_widgets.pop()
            await user.remove()
            await self.notice(turn.error, "error")
            return
        if turn.dropped:
            self._mark_dropped()
            kept = " (the system prompt is kept)" if conv.system else ""
            await self.notice(f"context full: the {turn.dropped} oldest messages are no longer sent to the model"
                              + kept, "warning")
        if turn.max_tokens < self.session.settings.max_tokens:
            await self.notice(f"only room for {turn.max_tokens} more tokens in the context", "warning")
        self.chat.save()
        widget = AssistantMessage(show_drafts=self.chat.show_drafts, classes="streaming")
        await log.mount(widget)
        widget.start_stream()
        widget.set_footer("…")
        log.scroll_end(animate=False)
        self.gen = Generation(conv, self.chat.history_path, turn, widget)
        self.figures = AnswerFigures(streaming=True, prefill_tokens=self.gen.live.prefill_tokens,
                                     reused_tokens=self.gen.live.reused_tokens)
        self.refresh_status()
        self._generate(self.gen)

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate(self, gen: Generation) -> None:
        from edgellm.generate import Done

        try:
            for ev in self.session.generate(gen.turn, gen.stop):
                if isinstance(ev, Done):
                    self.post_message(Finished(gen, done=ev))
                    return
                if gen.batch.add(ev):
                    self.post_message(Streamed(gen))
            self.post_message(Finished(gen, error="the engine ended without a result"))
        except Exception as e:  # shown in the chat: a failed answer must not take the app down
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.post_message(Finished(gen, error=msg))

    async def _apply_batch(self, gen: Generation) -> None:
        tokens = gen.batch.take()
        if not tokens:
            return
        for t in tokens:
            gen.live.add(t.id, t.t, getattr(t, "from_draft", False))
        if gen.conv is self.conv:
            await gen.widget.append([(t.text, getattr(t, "from_draft", False)) for t in tokens])

    async def on_streamed(self, message: Streamed) -> None:
        gen = message.gen
        await self._apply_batch(gen)
        if gen is self.gen and gen.live.tokens:
            live = gen.live
            drafting = getattr(self.session.engine, "draft", None) is not None
            self.figures = AnswerFigures(ttft_s=live.ttft, tok_s=live.tok_s, prefill_tokens=live.prefill_tokens,
                                         reused_tokens=live.reused_tokens, generated=live.tokens, streaming=True,
                                         live_drafted=live.draft_tokens if drafting else None)
            self.refresh_status()
        self.call_after_refresh(gen.batch.drawn)

    async def on_finished(self, message: Finished) -> None:
        gen = message.gen
        await self._apply_batch(gen)
        current = gen.conv is self.conv
        if message.done is not None:
            done = message.done
            msg = self.session.record_answer(gen.conv, done.text, done.tokens, done.stats)
            if current:
                await gen.widget.finish(done.text, msg.stats)
                self.figures = AnswerFigures.from_stats(done.stats, gen.live)
                self._message_widgets.append(gen.widget)
        else:
            if gen.widget.text:  # keep what was written before the failure
                self.session.record_answer(gen.conv, gen.widget.text, [], None)
                if current:
                    self._message_widgets.append(gen.widget)
            if current:
                await gen.widget.finish(gen.widget.text, None, footer="failed")
                await self.notice(f"generation failed: {message.error}", "error")
                self.figures = AnswerFigures()
        if current:
            gen.widget.remove_class("streaming")
        if current or gen.path != self.chat.history_path:
            self.chat.save(gen.conv, gen.path)
        self.gen = None
        self.ctx_tokens = self.session.context_tokens(self.conv)
        self.refresh_status()

    # -- actions -----------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.gen is not None:
            self.gen.stop.set()

    async def action_new_chat(self) -> None:
        """Start a new conversation in a new file; the current one stays saved."""
        self.action_stop()
        self.chat.new_conversation(new_file=True)
        await self.show_conversation()
        self.app.notify("new chat")

    async def action_clear_chat(self) -> None:
        """Empty this conversation (same file, same system prompt)."""
        self.action_stop()
        self.chat.new_conversation(new_file=False)
        self.chat.save()
        await self.show_conversation()

    def action_copy_answer(self) -> None:
        last = self.conv.last_answer()
        if last is None:
            self.app.notify("no answer to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(last.content)
        self.app.notify(f"copied the last answer ({len(last.content)} characters)")

    def prefill_prompt(self, text: str) -> None:
        area = self.query_one(PromptArea)
        area.text = text
        area.move_cursor(area.document.end)
        area.focus()

    # -- / commands --------------------------------------------------------------------------
    async def run_slash(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        fields = {"temp": ("temperature", float), "temperature": ("temperature", float), "top_p": ("top_p", float),
                  "top_k": ("top_k", int), "min_p": ("min_p", float), "repeat": ("repeat_penalty", float),
                  "max": ("max_tokens", int), "max_tokens": ("max_tokens", int), "seed": ("seed", int)}
        try:
            if name == "help":
                await self.notice(HELP, "help")
            elif name == "system":
                self.conv.system = arg
                self.chat.save()
                await self.show_conversation()
                self.app.notify("system prompt set" if arg else "system prompt removed")
            elif name in fields:
                key, kind = fields[name]
                if not arg:
                    self.app.notify(f"{key} = {getattr(self.session.settings, key)}")
                    return
                value = None if (key == "seed" and arg.lower() == "none") else kind(arg)
                self.session.settings = with_settings(self.session.settings, **{key: value})
                self.app.notify(f"{key} = {value}")
            elif name == "draft":
                if arg not in ("on", "off"):
                    raise ValueError("use /draft on or /draft off")
                if not self.session.has_draft:
                    raise ValueError("speculative decoding is off: start edgellm chat with --draft self|lookup|MODEL")
                if self.gen is not None:
                    raise ValueError("wait for the answer to finish")
                self.session.set_draft(arg == "on")
                self.app.notify(f"speculative decoding {arg}")
                self.refresh_status()
            elif name == "new":
                await self.action_new_chat()
            elif name == "clear":
                await self.action_clear_chat()
            elif name == "copy":
                self.action_copy_answer()
            else:
                raise ValueError(f"unknown command /{name} (try /help)")
        except ValueError as e:
            self.app.notify(str(e), severity="error")


class ChatApp(App):
    """The chat: a startup screen while the model loads, then the conversation."""

    CSS_PATH = "chat.tcss"
    TITLE = "edgellm"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True),
                Binding("ctrl+c", "help_quit", show=False, system=True)]

    def __init__(self, args: argparse.Namespace, *, loader: Callable | None = None,
                 engine_factory: Callable | None = None, memory_probe: Callable[[], int | None] | None = None):
        super().__init__()
        self.args = args
        self._loader = loader
        self._engine_factory = engine_factory
        self.memory_probe = memory_probe or _process_rss
        self.show_drafts = bool(args.show_drafts)
        self.draft_name = str(args.draft or "none")
        self.weights_name = str(args.weights or "auto")
        self.kv_name = str(args.kv or "auto")
        self.device_name = self.dtype_name = "?"
        self.threads: int | None = args.threads
        self.loaded: Any = None
        self.session: ChatSession | None = None
        self.conv = Conversation(system=args.system or "")
        self.history_path: Path = Path()
        self.load_error: str | None = None
        self.resume_note: str | None = None
        self._stop_all = threading.Event()

    # -- startup -----------------------------------------------------------------------------
    def on_mount(self) -> None:
        name = str(self.args.model) if self.args.model else "the bundled SmolLM2-135M-Instruct"
        self.push_screen(LoadingScreen(name))
        try:
            with_settings(ChatSettings.from_args(self.args))  # bad sampling flags fail before the load
            self._open_history()
        except ValueError as e:
            self.fail(str(e))
            return
        except EdgeLLMError as e:
            self.fail(str(e))
            return
        self._load()

    def _open_history(self) -> None:
        explicit = self.args.history_file
        path = Path(explicit).expanduser() if explicit else None
        if self.args.resume and path is None:
            path = latest_history_path(self.args.data_dir)
            if path is None:
                self.resume_note = f"no saved chat in {history_dir(self.args.data_dir)} to resume: starting a new one"
        if path is not None and path.exists():
            self.conv = load_conversation(path)
            if self.args.system:
                self.conv.system = self.args.system
            self.history_path = path
        else:
            if self.args.resume and path is not None:
                self.resume_note = f"{path}: no saved chat there yet: starting a new one"
            self.history_path = path or new_history_path(self.conv, self.args.data_dir)

    # The load worker talks to the UI by messages only: posting never blocks, so a worker still
    # running while the app shuts down cannot deadlock against it (call_from_thread would wait).
    class LoadProgress(TMessage):
        def __init__(self, count: int = 0, name: str = "", stage: str = "") -> None:
            super().__init__()
            self.count, self.name, self.stage = count, name, stage

    class LoadDone(TMessage):
        def __init__(self, loaded: Any = None, engine: Any = None, error: str | None = None) -> None:
            super().__init__()
            self.loaded, self.engine, self.error = loaded, engine, error

    @work(thread=True, group="load", exit_on_error=False)
    def _load(self) -> None:
        from edgellm import hugepages
        from edgellm.args import engine_from_args, load_from_args

        count = 0
        last = 0.0

        def on_tensor(name: str) -> None:
            nonlocal count, last
            if self._stop_all.is_set():
                raise _Cancelled()
            count += 1
            now = time.perf_counter()
            if now - last >= 1.0 / UI_FPS:
                last = now
                self.post_message(self.LoadProgress(count, name))

        if self.args.threads is None:
            self.args.threads = chat_threads()
        self.threads = self.args.threads
        try:
            loaded = (self._loader or load_from_args)(self.args, on_tensor=on_tensor)
            self.post_message(self.LoadProgress(stage="allocating the KV cache …"))
            engine = (self._engine_factory or engine_from_args)(self.args, loaded)
            if hasattr(engine, "idle_work"):  # (an Engine; tests hand in stand-ins)
                engine.idle_work = hugepages.when_idle(engine.model)  # weights onto 2 MiB pages while the user types
            self.post_message(self.LoadProgress(stage="warming up (the first run also builds the CPU kernels) …"))
            warm_up(engine, loaded.tokenizer, self._stop_all)
        except _Cancelled:
            return
        except EdgeLLMError as e:
            self.post_message(self.LoadDone(error=str(e)))
        except (ValueError, OSError, RuntimeError, MemoryError) as e:
            if not self._stop_all.is_set():
                self.post_message(self.LoadDone(error=str(e).splitlines()[0] if str(e) else type(e).__name__))
        else:
            self.post_message(self.LoadDone(loaded, engine))

    def _loading_screen(self) -> LoadingScreen | None:
        return self.screen if isinstance(self.screen, LoadingScreen) else None

    def on_chat_app_load_progress(self, message: LoadProgress) -> None:
        if (s := self._loading_screen()) is not None:
            if message.stage:
                s.stage(message.stage)
            else:
                s.progress(message.count, message.name)

    async def on_chat_app_load_done(self, message: LoadDone) -> None:
        if self._stop_all.is_set():
            return
        if message.error is not None:
            self.fail(message.error)
        else:
            await self._on_loaded(message.loaded, message.engine)

    def fail(self, message: str) -> None:
        """A load error: the CLI's one line, in the app; any key exits with code 2."""
        self.load_error = message
        if (s := self._loading_screen()) is not None:
            s.show_error(message)
        else:
            self.exit(return_code=2)

    async def _on_loaded(self, loaded: Any, engine: Any) -> None:
        self.loaded = loaded
        model = loaded.model
        self.device_name = str(getattr(model, "device", "cpu"))
        self.dtype_name = _dtype_name(getattr(model, "dtype", None))
        if self.weights_name == "auto" and getattr(loaded, "runs_as", None):  # say what "as stored" turned out to be
            kinds = sorted(loaded.runs_as, key=lambda k: -loaded.runs_as[k])
            self.weights_name = "fp" if all(k in ("f32", "f16", "bf16") for k in kinds) else "+".join(kinds)
        if self.kv_name == "auto" and getattr(getattr(engine, "cache", None), "kv_format", None):
            self.kv_name = engine.cache.kv_format  # what "auto" turned out to be (f16 on the CPU)
        settings = ChatSettings.from_args(self.args)
        self.session = ChatSession(engine, loaded.tokenizer, settings)
        name = Path(str(loaded.path)).name
        self.sub_title = name
        self.conv.model = self.conv.model or name
        await self.switch_screen(ChatScreen(self))
        if self.resume_note:
            self.notify(self.resume_note, severity="warning")
        elif self.conv.messages:
            self.notify(f"resumed {len(self.conv.messages)} messages from {self.history_path}")

    @property
    def chat_ready(self) -> bool:
        return isinstance(self.screen, ChatScreen) and self.screen.ready

    # -- conversation ------------------------------------------------------------------------
    def new_conversation(self, new_file: bool) -> None:
        old = self.conv
        self.conv = Conversation(system=old.system, model=old.model)
        if new_file:
            self.history_path = new_history_path(self.conv, self.args.data_dir)
        else:
            self.conv.id = old.id
            self.conv.created = old.created

    def save(self, conv: Conversation | None = None, path: Path | None = None) -> None:
        conv = conv or self.conv
        if not conv.messages and not (path or self.history_path).exists():
            return  # an empty chat is not worth a file
        try:
            save_conversation(conv, path or self.history_path)
        except EdgeLLMError as e:
            self.notify(str(e), severity="error", timeout=8)

    # -- palette and exit --------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if not isinstance(screen, ChatScreen):
            return
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", screen.action_new_chat)
        yield SystemCommand("Clear chat", "Empty this conversation (Ctrl+L)", screen.action_clear_chat)
        yield SystemCommand("Copy last answer", "Copy to the clipboard (Ctrl+Y)", screen.action_copy_answer)
        yield SystemCommand("Stop generation", "Stop the answer being written (Esc)", screen.action_stop)
        for title, help_text, prefix in (
                ("Set system prompt", "/system TEXT", "/system "),
                ("Set temperature", "/temp X (0 = greedy)", "/temp "),
                ("Set top-p", "/top_p X", "/top_p "),
                ("Set max tokens", "/max N: the longest answer", "/max ")):
            yield SystemCommand(title, help_text, lambda p=prefix: screen.prefill_prompt(p))
        if self.session is not None and self.session.has_draft:
            on = self.session.settings.draft
            yield SystemCommand("Speculative decoding: " + ("turn off" if on else "turn on"), "/draft on|off",
                                lambda: screen.run_slash("/draft " + ("off" if on else "on")))

    def action_screenshot_here(self) -> None:
        """F12: save an SVG of the screen in the current folder (or where --screenshot says)."""
        target = self.args.screenshot
        if target:
            path = self.save_screenshot(filename=Path(target).name, path=str(Path(target).parent or "."))
        else:
            path = self.save_screenshot(path=".")
        self.notify(f"screenshot saved: {path}")

    async def action_quit(self) -> None:
        self.shutdown()
        self.exit()

    def shutdown(self) -> None:
        """Stop the workers so the process can exit at once."""
        self._stop_all.set()
        screen = next((s for s in self.screen_stack if isinstance(s, ChatScreen)), None)
        if screen is not None and screen.gen is not None:
            screen.gen.stop.set()

    def on_unmount(self) -> None:
        self.shutdown()


class _Cancelled(Exception):
    pass


def warm_up(engine: Any, tokenizer: Any, stop: threading.Event) -> None:
    """Generate two tokens and forget them, behind the startup screen: the first answer's TTFT then
    measures the answer, not one-time work (building the C++ kernels, first-call allocations)."""
    if not (hasattr(engine, "reset") and hasattr(engine, "generate")):
        return
    from edgellm.generate import GenerationSettings

    ids = tokenizer.encode("Hello") or [0]
    for _ in engine.generate(ids, GenerationSettings(max_tokens=2), stop=stop):
        pass
    engine.reset()


def chat_threads() -> int:
    """Torch threads for the chat when --threads is not given: torch's own choice less one, so the
    UI thread has a core to draw on. Torch's threads wait for each other at every op; when the UI
    takes one of their cores they stall (2-core machine, bundled model: 0.6 tok/s with 2 threads
    against 4.9 with 1 while another process ran; with 2 threads `edgellm run` made 2.8)."""
    import torch

    return max(1, torch.get_num_threads() - 1)


def _process_rss() -> int | None:
    try:
        from edgellm.device import process_rss

        return process_rss()
    except Exception:
        return None


def _dtype_name(dtype: Any) -> str:
    names = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}
    return names.get(str(dtype), str(dtype).replace("torch.", ""))
