"""Shared helpers for the chat-app tests (not a test module)."""
from __future__ import annotations

import argparse
import time

import pytest


@pytest.fixture(scope="session")
def tui_model(tmp_path_factory) -> str:
    """A tiny real llama (GQA) HF folder with a ChatML template, built once per session."""
    from tests.fixtures.tiny import make_hf_model

    folder = tmp_path_factory.getbasetemp() / "tui-model" / "llama_gqa"
    if not (folder / "config.json").is_file():
        make_hf_model(folder, "llama_gqa")
    return str(folder)


def chat_args(*argv: str) -> argparse.Namespace:
    """Parse `edgellm chat ARGV` with the real subcommand parser."""
    from edgellm.tui import cli as tui_cli

    parser = argparse.ArgumentParser(prog="edgellm")
    sub = parser.add_subparsers(dest="command", required=True)
    tui_cli.add_parser(sub)
    return parser.parse_args(["chat", *argv])


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def type_text(pilot, text: str) -> None:
    keys = ["space" if c == " " else c for c in text]
    await pilot.press(*keys)


async def send(pilot, app, text: str, timeout: float = 30.0) -> None:
    """Type a message, press Enter and wait for the answer to finish."""
    await type_text(pilot, text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.screen.gen is not None or _answered(app), 10, "generation start")
    await wait_for(pilot, lambda: app.screen.gen is None, timeout, "answer")


def _answered(app) -> bool:
    return bool(app.conv.messages) and app.conv.messages[-1].role == "assistant"


def run_async(fn):
    """Run an async test function with asyncio.run (no pytest async plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper
