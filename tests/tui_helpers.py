"""Shared helpers for the chat-app tests (not a test module)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tui_model(tmp_path_factory) -> str:
    """A tiny real llama (GQA) HF folder with a ChatML template, built once per session."""
    folder = tmp_path_factory.getbasetemp() / "tui-model" / "llama_gqa"
    if not (folder / "config.json").is_file():
        write_tiny_llama(folder)
    return str(folder)


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """tests/fixtures/tiny.py's llama_gqa layout (config, safetensors, tokenizer, ChatML template), written
    with torch and safetensors directly: importing transformers would cost the chat tests ~5 s."""
    import torch
    from safetensors.torch import save_file

    from tests.fixtures.tiny import CHAT_TEMPLATE, hf_config, tokenizer_json

    folder.mkdir(parents=True, exist_ok=True)
    tok_json = tokenizer_json()
    cfg = hf_config("llama_gqa", len(json.loads(tok_json)["model"]["vocab"]))
    cfg["model_type"] = "llama"
    dim, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = dim // cfg["num_attention_heads"]
    kv_dim = head_dim * cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:  # spread-out weights, as in tiny.py (std 0.02 gives flat logits)
        return torch.randn(*shape, generator=g) * 0.15

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    t = {"model.embed_tokens.weight": w(vocab, dim), "model.norm.weight": norm(), "lm_head.weight": w(vocab, dim)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": w(dim, dim), p + "self_attn.k_proj.weight": w(kv_dim, dim),
                  p + "self_attn.v_proj.weight": w(kv_dim, dim), p + "self_attn.o_proj.weight": w(dim, dim),
                  p + "mlp.gate_proj.weight": w(ffn, dim), p + "mlp.up_proj.weight": w(ffn, dim),
                  p + "mlp.down_proj.weight": w(dim, ffn)})
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (folder / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}), encoding="utf-8")
    return folder


def chat_args(*argv: str) -> argparse.Namespace:
    """Parse `edgellm chat ARGV` with the real subcommand parser. One torch thread unless ARGV says
    otherwise: the tiny model gains nothing from two, and on a busy 2-core machine two threads wait
    on each other (measured: 17 vs 230 tok/s). `restore_threads` puts the setting back."""
    from edgellm.tui import cli as tui_cli

    parser = argparse.ArgumentParser(prog="edgellm")
    sub = parser.add_subparsers(dest="command", required=True)
    tui_cli.add_parser(sub)
    if "--threads" not in argv:
        argv = (*argv, "--threads", "1")
    return parser.parse_args(["chat", *argv])


@pytest.fixture(autouse=False)
def restore_threads():
    """The app sets torch's thread count at load (--threads): restore it for the tests that follow."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def type_text(pilot, text: str) -> None:
    """Real key presses, one per character (each costs Textual's wait-for-idle, ≥ 40 ms)."""
    keys = ["space" if c == " " else c for c in text]
    await pilot.press(*keys)


async def enter_text(pilot, text: str) -> None:
    """Put text into the focused input as typing would, at once (for tests about what text does,
    not about the keys)."""
    from textual.widgets import Input, TextArea

    focused = pilot.app.focused
    if isinstance(focused, TextArea):
        focused.insert(text)
    elif isinstance(focused, Input):
        focused.insert_text_at_cursor(text)
    else:
        raise AssertionError(f"no text input has the focus ({focused!r})")
    await pilot.pause()


async def send(pilot, app, text: str, timeout: float = 30.0) -> None:
    """Enter a message, press Enter and wait for the answer to finish."""
    await enter_text(pilot, text)
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
