"""The chat's widgets: messages, the prompt box, the status bar."""
from __future__ import annotations

import re

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Markdown, Static, TextArea

from .stats import message_footer

# C0/C1 controls (except tab and newline) would move the terminal cursor; a random or badly quantized
# model can emit them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    return _CONTROL.sub("\ufffd", text)


class PromptArea(TextArea):
    """Multi-line input: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter insert a new line."""

    NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter", "newline")

    class Submitted(Message):
        def __init__(self, area: "PromptArea", text: str) -> None:
            super().__init__()
            self.area = area
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)


class UserMessage(Static):
    def __init__(self, text: str, **kwargs) -> None:
        super().__init__(Text(printable(text)), **kwargs)
        self.border_title = "you"


class Notice(Static):
    """A one-line note in the conversation (dropped turns, stopped answers, errors)."""


class AssistantMessage(Vertical):
    """An answer: Markdown (code blocks and all) that grows as tokens stream in. With --show-drafts it
    is coloured text instead, tokens from accepted drafts in the draft colour (Leviathan et al.)."""

    def __init__(self, text: str = "", stats: dict | None = None, show_drafts: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "assistant"
        self.text = text
        self.stats = stats
        self.show_drafts = show_drafts
        self._styled = Text(printable(text))
        self._stream = None

    def compose(self) -> ComposeResult:
        if self.show_drafts:
            yield Static(self._styled, classes="body")
        else:
            yield Markdown(printable(self.text), classes="body")
        yield Static(message_footer(self.stats) if self.stats else "", classes="footer")

    def start_stream(self) -> None:
        if not self.show_drafts:
            self._stream = Markdown.get_stream(self.query_one(Markdown))

    async def append(self, pieces: list[tuple[str, bool]]) -> None:
        """Add streamed text: (text, from_draft) pieces."""
        text = "".join(p for p, _ in pieces)
        self.text += text
        if self.show_drafts:
            for piece, from_draft in pieces:
                self._styled.append(printable(piece), style="bold #4fc1ff" if from_draft else None)
            self.query_one(".body", Static).update(self._styled)
        elif self._stream is not None:
            await self._stream.write(printable(text))

    async def finish(self, text: str, stats: dict | None, footer: str | None = None) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if text != self.text:  # the final text wins (e.g. a tail the detokenizer held back until the end)
            if self.show_drafts:  # keep the colours of what was streamed when the text only grew
                grown = text.startswith(self.text)
                self._styled = self._styled + Text(printable(text[len(self.text):])) if grown else Text(printable(text))
                self.query_one(".body", Static).update(self._styled)
            else:
                await self.query_one(Markdown).update(printable(text))
        self.text = text
        self.stats = stats
        self.query_one(".footer", Static).update(footer if footer is not None else message_footer(stats or {}))

    def set_footer(self, text: str) -> None:
        self.query_one(".footer", Static).update(text)


class StatusBar(Widget):
    """The current answer's figures, then the context, memory and formats (dim). Each is a list of
    fields joined by " · "; a line too long for the terminal breaks between fields, never inside one,
    and the bar grows to fit (so an 80-column terminal still shows every figure)."""

    SEP = " · "
    answer_text = ""
    machine_text = ""

    def show(self, answer: str, machine: str) -> None:
        if (answer, machine) == (self.answer_text, self.machine_text):
            return
        width = self.content_region.width
        before = len(self._lines(width))
        self.answer_text, self.machine_text = answer, machine
        # a relayout only when the height changes: a plain refresh is much cheaper while streaming
        self.refresh(layout=len(self._lines(width)) != before)

    def _lines(self, width: int) -> list[tuple[str, bool]]:
        """(line, dim) pairs for a content width."""
        out: list[tuple[str, bool]] = []
        for text, dim in ((self.answer_text, False), (self.machine_text, True)):
            out += [(line, dim) for line in pack_fields(text.split(self.SEP) if text else [""], self.SEP, width)]
        return out

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self._lines(width))

    def render(self) -> Text:
        lines = self._lines(self.content_region.width)
        out = Text(no_wrap=True, overflow="ellipsis")
        for i, (line, dim) in enumerate(lines):
            out.append(line, style="dim" if dim else "")
            if i < len(lines) - 1:
                out.append("\n")
        return out


def pack_fields(fields: list[str], sep: str, width: int) -> list[str]:
    """Greedy line filling: fields joined by sep, a new line where the next field would not fit;
    a field wider than the line is cut with an ellipsis."""
    if width <= 0:
        return [sep.join(fields)]
    lines: list[str] = []
    line = ""
    for f in fields:
        if len(f) > width:
            f = f[:max(width - 1, 0)] + "…"
        if line and len(line) + len(sep) + len(f) <= width:
            line += sep + f
        else:
            if line:
                lines.append(line)
            line = f
    lines.append(line)
    return lines
