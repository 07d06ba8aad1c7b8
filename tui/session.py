"""The chat logic under the app, free of Textual: conversation → prompt ids (kept KV prefix, dropped
old turns when the context is full) → the engine's event stream.

The prompt is re-rendered with the chat template every turn, but each earlier answer is spliced in as
the exact token ids the model produced: text → ids does not round-trip (a model can emit a
non-canonical BPE split), and any difference would make the engine recompute the rest of the chat.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from edgellm.generate import GenerationSettings
from edgellm.sampling import SamplingSettings

from .history import Conversation, Message

MARKER = "\u27e6edgellm-answer-{}\u27e7"  # stands in for an answer while the template is rendered


@dataclass
class ChatSettings:
    """What the user can change while chatting (flags at start, `/` commands later)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    draft: bool = True  # use the draft proposer the engine was built with (if any)

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)

    @classmethod
    def from_args(cls, args: Any) -> "ChatSettings":
        return cls(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   repeat_penalty=args.repeat_penalty, seed=args.seed, max_tokens=args.max_tokens,
                   stop=list(args.stop or []))


@dataclass
class Turn:
    """One prepared answer: the prompt ids and how the context was fitted."""

    ids: list[int]
    max_tokens: int
    dropped: int = 0  # messages dropped from the front of the context for this turn
    expected_reuse: int = 0  # tokens of the prompt already in the KV cache
    error: str | None = None  # the prompt cannot fit at all


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatSession:
    """A conversation bound to an engine: builds prompts and streams answers."""

    def __init__(self, engine: Any, tokenizer: Any, settings: ChatSettings | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings or ChatSettings()
        # A draft proposer the engine was built with, kept so `/draft off` then `on` can restore it.
        self._draft = getattr(engine, "draft", None)

    # -- speculative decoding on/off ---------------------------------------------------------
    @property
    def has_draft(self) -> bool:
        return self._draft is not None

    def set_draft(self, on: bool) -> None:
        """Between answers only. Turning it back on resets the proposer: its own state (a draft
        model's KV cache) did not follow the answers written without it."""
        self.settings.draft = on
        if not hasattr(self.engine, "draft"):
            return
        if on and self.engine.draft is None and self._draft is not None and hasattr(self._draft, "reset"):
            self._draft.reset()
        self.engine.draft = self._draft if on else None

    # -- prompt ------------------------------------------------------------------------------
    def messages_for(self, conv: Conversation, start: int | None = None) -> list[dict[str, str]]:
        start = conv.context_start if start is None else start
        out = [{"role": "system", "content": conv.system}] if conv.system else []
        out += [{"role": m.role, "content": m.content} for m in conv.messages[start:]]
        return out

    def encode(self, conv: Conversation, start: int | None = None) -> list[int]:
        """The prompt ids for conv.messages[start:] (+ the system prompt), ending with the assistant cue."""
        start = conv.context_start if start is None else start
        messages = self.messages_for(conv, start)
        if not self.tokenizer.chat_template:
            return self._encode_plain(messages)
        ids = self._encode_spliced(messages, conv.messages[start:])
        return ids if ids is not None else self.tokenizer.encode_chat(messages)

    def _encode_spliced(self, messages: list[dict[str, str]], source: list[Message]) -> list[int] | None:
        offset = len(messages) - len(source)
        answers = [(offset + i, m) for i, m in enumerate(source) if m.role == "assistant" and m.tokens]
        if not answers:
            return None
        masked = [dict(m) for m in messages]
        for k, (i, _) in enumerate(answers):
            masked[i]["content"] = MARKER.format(k)
        rendered = self.tokenizer.render_chat(masked)
        parts: list[str] = []
        rest = rendered
        for k in range(len(answers)):
            before, sep, rest = rest.partition(MARKER.format(k))
            if not sep:
                return None
            parts.append(before)
        parts.append(rest)
        # The template must paste answers verbatim (no trim, no rewriting), else fall back to text.
        plain = parts[0] + "".join(m.content + p for (_, m), p in zip(answers, parts[1:]))
        if plain != self.tokenizer.render_chat(messages):
            return None
        ids = self.tokenizer.encode(parts[0], add_bos=False)
        for (_, m), text in zip(answers, parts[1:]):
            ids += m.tokens
            ids += self.tokenizer.encode(text, add_bos=False)
        return ids

    def _encode_plain(self, messages: list[dict[str, str]]) -> list[int]:
        """Models without a chat template: a plain transcript."""
        names = {"system": "", "user": "User: ", "assistant": "Assistant: "}
        text = "".join(f"{names[m['role']]}{m['content']}\n\n" for m in messages) + "Assistant:"
        return self.tokenizer.encode(text)

    def prepare(self, conv: Conversation) -> Turn:
        """Fit the conversation (ending with the user's new message) into the context: drop the oldest
        turns (never the system prompt or the new message) until prompt + max_tokens fits."""
        limit = self.engine.max_seq_len
        want = self.settings.max_tokens
        start = conv.context_start
        ids = self.encode(conv, start)
        dropped = 0
        last_user = max(i for i, m in enumerate(conv.messages) if m.role == "user")
        while len(ids) + want > limit:
            nxt = next((i for i in range(start + 1, last_user + 1) if conv.messages[i].role == "user"), None)
            if nxt is None:
                break
            dropped += nxt - start
            start = nxt
            ids = self.encode(conv, start)
        conv.context_start = start
        room = limit - len(ids)
        if room < 1:
            return Turn(ids, 0, dropped, error=f"this message needs {len(ids)} tokens but the context holds "
                                               f"{limit} (start edgellm chat with a larger --ctx)")
        reuse = common_prefix(ids, list(self.engine.cached_ids))
        return Turn(ids, min(want, room), dropped, expected_reuse=min(reuse, len(ids) - 1))

    def context_tokens(self, conv: Conversation) -> int:
        """Tokens the conversation occupies in the context (prompt of the next turn, without the new message)."""
        if not conv.messages and not conv.system:
            return 0
        return len(self.encode(conv))

    # -- generation --------------------------------------------------------------------------
    def generate(self, turn: Turn, stop: threading.Event) -> Iterator[Any]:
        s = self.settings
        settings = GenerationSettings(max_tokens=turn.max_tokens, sampling=s.sampling(), stop_strings=list(s.stop))
        return self.engine.generate(turn.ids, settings, stop=stop)

    def record_answer(self, conv: Conversation, text: str, tokens: list[int], stats: Any) -> Message:
        """Append the finished answer; keep its ids for the next prompt unless a stop string cut it
        (then the ids run past the text)."""
        keep = stats is not None and stats.finish_reason != "stop"
        d = stats.to_dict() if stats is not None and hasattr(stats, "to_dict") else None
        msg = Message("assistant", text, stats=d, tokens=list(tokens) if keep else None)
        conv.messages.append(msg)
        return msg


def with_settings(settings: ChatSettings, **changes: Any) -> ChatSettings:
    """A copy with changes, validated by building the sampler settings (ValueError if invalid)."""
    new = replace(settings, **changes)
    new.sampling()
    if new.max_tokens < 1:
        raise ValueError("max tokens must be at least 1")
    return new
