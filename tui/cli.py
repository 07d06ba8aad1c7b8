"""`edgellm chat`: the subcommand that opens the Textual app (registered by edgellm.cli)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    from edgellm import args as core

    p = subparsers.add_parser("chat", help="chat with a model in the terminal (live TTFT, tok/s, drafts)",
                              description="Chat in the terminal. Enter sends, Shift+Enter or Ctrl+J adds a line, "
                                          "Esc stops an answer, Ctrl+N starts a new chat, /help lists commands.")
    core.add_model_options(p)
    core.add_format_options(p, draft=True)  # --weights, --kv, --draft, --draft-tokens, --show-drafts
    core.add_quant_options(p)  # --per-channel, --sym/--asym, --embeddings, --fast, --calibrate
    core.add_sampling_options(p)
    g = p.add_argument_group("chat")
    g.add_argument("--resume", action="store_true", help="reopen the last chat (or the one --history-file names)")
    g.add_argument("--history-file", type=Path, default=None, metavar="PATH",
                   help="keep this chat in PATH (reopened if it exists); default: a new file under the data dir")
    # the two locations a user sets once for every chat are also read from the environment, here only
    g.add_argument("--data-dir", default=os.environ.get("EDGELLM_DATA_DIR") or None, metavar="DIR",
                   help="where chats are kept (DIR/chats; default $EDGELLM_DATA_DIR, else the user data dir)")
    g.add_argument("--screenshot", default=os.environ.get("EDGELLM_SCREENSHOT") or None, metavar="FILE.svg",
                   help="where F12 saves a screenshot (default $EDGELLM_SCREENSHOT, else the current folder)")
    return p


def cmd_chat(args: argparse.Namespace) -> int:
    from .app import ChatApp

    app = ChatApp(args)
    app.run()
    if app.load_error:
        # Printed again after the screen is restored, so the message stays in the terminal.
        print(f"edgellm: error: {app.load_error}", file=sys.stderr)
        return 2
    return app.return_code or 0


COMMANDS = {"chat": cmd_chat}
