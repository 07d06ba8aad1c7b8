"""Conversations on disk: one JSON file per chat under the user data dir, written atomically.

`edgellm chat --resume` reopens the newest file; `--history-file PATH` names the file instead.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgellm.atomic import write_text_atomic
from edgellm.errors import EdgeLLMError, OutputError

FORMAT_VERSION = 1


@dataclass
class Message:
    role: str  # user | assistant
    content: str
    stats: dict[str, Any] | None = None  # the generation stats of an assistant answer
    # The exact token ids the model produced for this answer (not saved): the next turn's prompt is
    # built from them so the KV prefix matches token for token (text → ids does not round-trip).
    tokens: list[int] | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.stats:
            d["stats"] = self.stats
        return d


@dataclass
class Conversation:
    system: str = ""
    messages: list[Message] = field(default_factory=list)
    model: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    # Messages before this index no longer fit the context and are not sent to the model.
    context_start: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "id": self.id, "created": self.created, "updated": self.updated,
                "model": self.model, "system": self.system, "context_start": self.context_start,
                "messages": [m.to_json() for m in self.messages]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Conversation":
        messages = [Message(role=str(m["role"]), content=str(m["content"]), stats=m.get("stats"))
                    for m in d.get("messages", [])]
        for m in messages:
            if m.role not in ("user", "assistant"):
                raise ValueError(f"unknown message role {m.role!r}")
        return cls(system=str(d.get("system") or ""), messages=messages, model=str(d.get("model", "")),
                   id=str(d.get("id") or uuid.uuid4().hex[:12]), created=float(d.get("created", time.time())),
                   updated=float(d.get("updated", time.time())),
                   context_start=min(int(d.get("context_start", 0)), len(messages)))

    def last_answer(self) -> Message | None:
        return next((m for m in reversed(self.messages) if m.role == "assistant"), None)


def history_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Where chats are kept: DATA_DIR/chats (`edgellm chat --data-dir`, default $EDGELLM_DATA_DIR), else the
    platform's user data dir."""
    root = data_dir
    if not root:
        import platformdirs

        root = platformdirs.user_data_dir("edgellm", appauthor=False)
    return Path(root) / "chats"


def new_history_path(conv: Conversation, data_dir: str | os.PathLike | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(conv.created))
    return history_dir(data_dir) / f"{stamp}-{conv.id}.json"


def latest_history_path(data_dir: str | os.PathLike | None = None) -> Path | None:
    folder = history_dir(data_dir)
    if not folder.is_dir():
        return None
    files = [p for p in folder.glob("*.json") if p.is_file()]
    return max(files, key=lambda p: (p.stat().st_mtime, p.name), default=None)


def save_conversation(conv: Conversation, path: Path) -> None:
    """Write to a temp file in the same folder, then rename over the old one: a crash, a kill or a full
    disk never leaves a half-written chat behind."""
    conv.updated = time.time()
    data = json.dumps(conv.to_json(), ensure_ascii=False, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{path}: cannot save the chat ({e.strerror or e})") from e
    write_text_atomic(path, data)


def load_conversation(path: Path) -> Conversation:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return Conversation.from_json(data)
    except FileNotFoundError as e:
        raise EdgeLLMError(f"{path}: no such chat history file") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EdgeLLMError(f"{path}: not a readable edgellm chat ({str(e).splitlines()[0]})") from e
