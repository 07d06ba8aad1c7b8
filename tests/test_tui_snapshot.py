"""Snapshots of the chat app (pytest-textual-snapshot) at fixed content: a reopened chat with a code
answer and its stored stats, and the load-error screen. No live timings: the figures come from the
history file and the memory reading is fixed. Update with `pytest --snapshot-update` after a
deliberate change, and look at the SVG diff before committing it."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pytest_textual_snapshot")

from edgellm.tui.app import ChatApp  # noqa: E402
from edgellm.tui.widgets import AssistantMessage  # noqa: E402
from tests.tui_helpers import chat_args, restore_threads, tui_model, wait_for  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("restore_threads")

SIZE = (100, 34)
ANSWER = """Reverse a copy with slicing, or in place with `list.reverse()`:

```python
items = [1, 2, 3]
print(items[::-1])  # [3, 2, 1]
items.reverse()
```

Both run in **O(n)**."""
STATS = {"prompt_tokens": 38, "prefill_tokens": 38, "reused_tokens": 0, "generated_tokens": 42, "ttft_s": 0.094,
         "prefill_s": 0.094, "prefill_tok_s": 404.3, "decode_s": 1.065, "decode_tok_s": 38.5,
         "peak_memory_bytes": 0, "finish_reason": "eos", "draft_proposed": 0, "draft_accepted": 0}


def fixed_chat(path):
    path.write_text(json.dumps({
        "version": 1, "id": "snapshot", "created": 0, "updated": 0, "model": "llama_gqa", "system": "",
        "messages": [{"role": "user", "content": "How do I reverse a list in Python?"},
                     {"role": "assistant", "content": ANSWER, "stats": STATS}]}), encoding="utf-8")


def test_chat_screen(snap_compare, tui_model, tmp_path, monkeypatch):
    history = tmp_path / "chat.json"
    fixed_chat(history)
    app = ChatApp(chat_args("-m", tui_model, "--history-file", str(history), "--data-dir", str(tmp_path / "data")),
                  memory_probe=lambda: 412 * 2**20)

    async def run_before(pilot):
        await wait_for(pilot, lambda: app.chat_ready and app.screen.query(AssistantMessage), 60, "the chat")
        await pilot.pause()
        app.clear_notifications()
        prompt = app.screen.query_one("#prompt")
        prompt.cursor_blink = False
        prompt.insert("And how do I sort it?")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_load_error_screen(snap_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = ChatApp(chat_args("-m", "no-such-model.gguf", "--data-dir", str(tmp_path / "data")))

    async def run_before(pilot):
        await wait_for(pilot, lambda: app.load_error is not None, 30, "the error")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(100, 20), run_before=run_before)
