"""`edgellm serve`: the subcommand (registered by edgellm.cli). The server itself is edgellm.serve,
imported only when the command runs, so other commands do not pay for starlette and pydantic."""
from __future__ import annotations

import argparse
from typing import Any

from .errors import EdgeLLMError


def add_parser(subparsers) -> argparse.ArgumentParser:
    from . import args as core

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="Serve one model to local clients (editors, agents, scripts) over "
                                          "OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models, /health. "
                                          "Requests run one at a time; the sampling options are the defaults of "
                                          "requests that do not set them.")
    core.add_model_options(p)
    core.add_format_options(p, draft=True)
    core.add_quant_options(p)
    core.add_sampling_options(p)
    p.set_defaults(max_tokens=None)  # a request without max_tokens runs to EOS or the context's end
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    g.add_argument("--queue", type=int, default=8, metavar="N",
                   help="requests that may wait behind the running one; more are answered 429 (default 8)")
    g.add_argument("--alias", default=None, help="the model id clients see (default: the model file's name)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short generation that builds the decode step before the first request")
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from . import hugepages
    from .args import engine_from_args, load_from_args, options_from_args, sampling_from_args, show_decode_path
    from .serve import Server
    from .tui.session import ChatSettings

    if args.queue < 0:
        raise EdgeLLMError("--queue must be >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise EdgeLLMError("-n/--max-tokens must be at least 1")
    sampling_from_args(args)  # bad sampling options fail here, before the model loads
    check_port(args.host, args.port)
    defaults = ChatSettings.from_args(args)  # what a request that sets no sampling field gets
    loaded = load_from_args(args)
    engine = engine_from_args(args, loaded)
    engine.idle_work = hugepages.when_idle(engine.model)  # weights onto 2 MiB pages between requests
    show_decode_path(options_from_args(args), engine)
    if args.warmup:
        warm_up(engine)
    model_id = args.alias or loaded.path.name
    server = Server(engine, model_id, defaults, system=args.system, api_key=args.api_key, max_waiting=args.queue)
    print(f"edgellm: serving {model_id} at http://{args.host}:{args.port}/v1"
          + (" (API key required)" if args.api_key else ""), flush=True)
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=3)
    uvicorn.Server(config).run()
    return 0


def check_port(host: str, port: int) -> None:
    """Fail in one line before the model loads if the address cannot be bound (uvicorn would exit
    after the load, with its own message)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except (OSError, OverflowError) as e:
            raise EdgeLLMError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None


def warm_up(engine: Any) -> None:
    """Two tokens, then a clean cache: the decode step is built now, not in the first client's TTFT."""
    from .generate import GenerationSettings

    for _ in engine.generate(engine.tokenizer.encode("Hello"), GenerationSettings(max_tokens=2, ignore_eos=True)):
        pass
    engine.reset()


COMMANDS = {"serve": cmd_serve}
