"""`edgellm run | chat | quantize | bench | perplexity | info` — one vocabulary everywhere."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Callable

from .errors import EdgeLLMError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn
    return register


# The options every command shares live in args.py, which the commands import directly.
from .args import (add_format_options, add_model_options, add_quant_options, add_sampling_options,  # noqa: E402
                   debug_requested, engine_from_options, load_from_options, options_from_args, sampling_from_args,
                   show_decode_path)


def prompt_ids(args: argparse.Namespace, tokenizer, text: str) -> list[int]:
    if args.raw or not tokenizer.chat_template:
        return tokenizer.encode(text)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return tokenizer.encode_chat(messages)


def stats_line(stats) -> str:
    s = (f"TTFT {stats.ttft_s:.3f} s · prefill {stats.prefill_tok_s:.1f} tok/s · "
         f"decode {stats.decode_tok_s:.1f} tok/s · {stats.prompt_tokens} prompt + "
         f"{stats.generated_tokens} generated tokens ({stats.finish_reason})")
    if stats.draft_proposed:
        s += (f" · draft {stats.draft}: {stats.draft_accepted}/{stats.draft_proposed} accepted "
              f"({stats.acceptance_rate:.0%}), {stats.mean_accepted_length:.2f} per round, γ {stats.draft_gamma}")
    elif stats.draft:
        s += f" · draft {stats.draft}: nothing proposed"
    return s


DRAFT_STYLE, RESET_STYLE = "\x1b[1;96m", "\x1b[0m"  # the TUI's draft colour, near enough: bold bright cyan


# ------------------------------------------------------------------------------------------------
# edgellm run
# ------------------------------------------------------------------------------------------------
@command("run")
def cmd_run(args: argparse.Namespace) -> int:
    from .generate import Done, GenerationSettings

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.max_tokens < 1:
        raise EdgeLLMError("-n/--max-tokens must be at least 1")
    options = options_from_args(args)
    loaded = load_from_options(options)
    tok = loaded.tokenizer
    ids = prompt_ids(args, tok, text)
    engine = engine_from_options(options, loaded, kv=args.kv, draft=args.draft, draft_tokens=args.draft_tokens)
    show_decode_path(options, engine)
    if args.truncate and len(ids) >= engine.max_seq_len:
        ids = ids[-(engine.max_seq_len - 1):]  # keep the end: the question is usually last
    settings = GenerationSettings(max_tokens=args.max_tokens, sampling=sampling_from_args(args),
                                  stop_strings=args.stop)
    out: list[int] = []
    pieces: list[str] = []
    done = None
    show_drafts = args.show_drafts and engine.draft is not None and not args.json
    try:
        for ev in engine.generate(ids, settings):
            if isinstance(ev, Done):
                done = ev
                break
            if ev.id >= 0:
                out.append(ev.id)
            pieces.append(ev.text)
            if not args.json:
                # --show-drafts: text of tokens the target accepted from the draft, in colour
                draft_text = show_drafts and ev.from_draft and ev.text
                sys.stdout.write(f"{DRAFT_STYLE}{ev.text}{RESET_STYLE}" if draft_text else ev.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if args.json:
            print(json.dumps({"text": "".join(pieces), "tokens": out, "prompt_tokens": len(ids),
                              "interrupted": True}))
        else:
            sys.stdout.write("\n")
            print(f"interrupted after {len(out)} tokens", file=sys.stderr)
        return 130
    if args.json:
        stats = done.stats.to_dict()
        print(json.dumps({"text": done.text, "tokens": done.tokens, "prompt_tokens": len(ids),
                          "model": str(loaded.path), "stats": stats}))
    else:
        sys.stdout.write("\n")
        if show_drafts:
            print(f"{DRAFT_STYLE}coloured{RESET_STYLE}: tokens from accepted drafts", file=sys.stderr)
        print(stats_line(done.stats), file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# edgellm info
# ------------------------------------------------------------------------------------------------
@command("info")
def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    options = options_from_args(args)
    loaded = load_from_options(options)
    cfg = loaded.config
    model = loaded.model
    weight_bytes = sum(t.nbytes for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())
    from .cache import KV_FORMATS, KVCache, resolve_kv_format
    from .prefill_path import fused_prefill_rows, prefill_path

    kv = resolve_kv_format(args.kv, model.dtype, model.device)
    kv_per_token = KVCache(cfg, 1, model.dtype, "meta", kv_format=kv).bytes_per_token
    decode_path, step = probe_decode_path(loaded, options, args.kv)
    kv_all = {f: KVCache(cfg, 1, model.dtype, "meta", kv_format=f).bytes_per_token for f in KV_FORMATS}
    ctx = model.rope_len
    rows = [
        ("model", str(loaded.path)), ("format", loaded.source_format), ("architecture", cfg.arch),
        ("parameters", f"{cfg.num_parameters() / 1e6:.1f} M"), ("layers", str(cfg.n_layers)),
        ("hidden size", str(cfg.dim)), ("heads (q / kv)", f"{cfg.n_heads} / {cfg.n_kv_heads}"),
        ("head dim", str(cfg.head_dim)), ("ffn size", str(cfg.intermediate_size)),
        ("vocab", str(cfg.vocab_size)), ("context (model)", str(cfg.max_position_embeddings)),
        ("rope", f"theta {cfg.rope_theta:g}" + (f", {cfg.rope_scaling['rope_type']} scaling" if cfg.rope_scaling else "")),
        ("tied embeddings", str(cfg.tie_embeddings)),
        ("tensor types", ", ".join(f"{k}×{v}" for k, v in sorted(loaded.tensor_types.items()))),
        ("weights run as", f"{loaded.runs_as_text()} (--weights {args.weights})"),
        ("file size", _mib(loaded.file_bytes)),
        ("weights in memory", _mib(weight_bytes)),
        ("compute dtype", str(model.dtype).replace("torch.", "")),
        ("KV cache", f"{kv}, {kv_per_token / 1024:.1f} KiB/token, {_mib(kv_per_token * ctx)} at {ctx} tokens"),
        ("KV cache by format", ", ".join(f"{f} {_mib(b * ctx)}" for f, b in kv_all.items()) + f" at {ctx} tokens"),
        ("memory needed", _mib(weight_bytes + kv_per_token * ctx)),
        ("chat template", "yes" if loaded.tokenizer.chat_template else "no"),
        ("device", str(model.device)),
        *([("CPU kernels", _cpu_kernels_text())] if model.device.type == "cpu" else []),
        ("decode path", str(decode_path)),
        ("prefill path", str(prefill_path(model, fused_rows=fused_prefill_rows(step)))),
    ]
    if args.json:
        print(json.dumps({k: v for k, v in rows}))
        return 0
    table = Table(show_header=False, box=None)
    for k, v in rows:
        table.add_row(f"[bold]{k}[/]", v)
    Console().print(table)
    return 0


def _cpu_kernels_text() -> str:
    """The C++ kernels' build (kernels/matmul.cpu_kernel_build), or why there are none."""
    from .kernels import matmul

    build = matmul.cpu_kernel_build()
    return build if build else "off (torch's own ops: --no-ext, no compiler, or a failed build)"


def probe_decode_path(loaded, options, kv: str):
    """Which decode step an engine with this KV format would run, and the step (a small cache: the path depends on
    its format, not its length)."""
    from .cache import KVCache
    from .decode_step import Decoder

    model = loaded.model
    decoder = Decoder(model, options)
    step = decoder.compiled(KVCache(model.config, 16, model.dtype, model.device, kv_format=kv), options.decode.compile)
    return decoder.path, step


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------
# Parser and entry point
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgellm", description="Fast local LLM inference for one user.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate an answer to one prompt")
    run.add_argument("prompt", help="the prompt text, or - to read stdin")
    add_model_options(run)
    add_format_options(run, draft=True)
    add_quant_options(run)
    add_sampling_options(run)
    run.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    run.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    info = sub.add_parser("info", help="describe a model")
    add_model_options(info)
    add_format_options(info)
    info.add_argument("--json", action="store_true")

    for extend in EXTENSIONS:
        extend(sub)
    return parser


# Other modules (chat, quantize, bench, perplexity) add their subcommands through this list.
EXTENSIONS: list[Callable] = []


def _load_extensions() -> None:
    import importlib

    for name in ("edgellm.tui.cli", "edgellm.bench", "edgellm.quantize", "edgellm.perplexity", "edgellm.serve_cli"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        EXTENSIONS.append(module.add_parser)
        COMMANDS.update(module.COMMANDS)


def main(argv: list[str] | None = None) -> int:
    _load_extensions()
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = debug_requested(args)
    try:
        return COMMANDS[args.command](args)
    except EdgeLLMError as e:
        if debug:
            traceback.print_exc()
        print(f"edgellm: error: {' '.join(str(e).splitlines())}", file=sys.stderr)  # one line, always
        return e.exit_code
    except KeyboardInterrupt:
        print("edgellm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
