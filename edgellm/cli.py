"""`edgellm run | chat | quantize | bench | perplexity | info` — one vocabulary everywhere."""
from __future__ import annotations

import argparse
import json
import os
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


# ------------------------------------------------------------------------------------------------
# Shared options
# ------------------------------------------------------------------------------------------------
def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", default=None,
                   help="HF folder, .gguf file, edgellm-quantized folder or hub id (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | mps (default: auto)")
    g.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on CUDA)")
    g.add_argument("--ctx", type=int, default=None, help="context length (default: min(model's, 8192))")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    g.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                   help="the decode step as one unit: auto = fused C++ step on CPU, CUDA graph on CUDA; "
                        "inductor = CUDA graph of torch.compile'd layers (CUDA: ~2x decode, 10-30 s to compile "
                        "on first use); off = op by op (default auto)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="same as --compile off")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


WEIGHT_FORMATS = ("auto", "fp", "int8", "int4")
COMPILE_MODES = ("auto", "inductor", "off")


def kv_format_arg(value: str) -> str:
    from .cache import parse_kv_format

    try:
        parse_kv_format(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_format_options(p: argparse.ArgumentParser, draft: bool = False) -> None:
    g = p.add_argument_group("formats")
    g.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="auto = as stored: a quantized GGUF keeps its blocks (Q4_K, Q6_K, Q8_0, ...) and multiplies "
                        "them in place, a float model stays float; fp = the compute dtype; int8 | int4 = quantize "
                        "at load (default auto)")
    g.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), help="int4/int8 group size")
    g.add_argument("--kv", default="fp", type=kv_format_arg,
                   help="KV-cache storage: fp | int8 | int4, optionally :GROUP (int8:32, int4:64) (default: fp)")
    g.add_argument("--activations", default=None, choices=("int8", "int8x2", "fp32"),
                   help="CPU int8/int4 matmuls: activations rounded to int8 per block (default, llama.cpp's "
                        "numerics), int8 plus an int8 residual (closer to fp32, a decode step ~1.3x as long), or fp32")
    if draft:
        g.add_argument("--draft", default="none",
                       help="speculative decoding: none | self[:int4|:int8][:asym|:sym][:L<n>] (int4 asym g32 copy by default) | lookup | MODEL")
        g.add_argument("--draft-tokens", type=int, default=None, help="fix the draft length (default: adaptive)")
        g.add_argument("--show-drafts", action="store_true", help="colour tokens that came from accepted drafts")


def add_quant_options(p: argparse.ArgumentParser) -> None:
    """How --weights int8|int4 quantizes at load: the knobs of `edgellm quantize`."""
    g = p.add_argument_group("quantization (with --weights int8|int4)")
    g.add_argument("--per-channel", action="store_true", help="int8: one scale per output channel")
    sym = g.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="symmetric", action="store_true", default=True, help="int4 symmetric (default)")
    sym.add_argument("--asym", dest="symmetric", action="store_false", help="int4 with scale + min")
    g.add_argument("--embeddings", default="int8", choices=("int8", "int4", "fp"),
                   help="embedding table / LM head format (default int8)")
    g.add_argument("--fast", action="store_true", help="round-to-nearest instead of the scale search")
    g.add_argument("--calibrate", nargs="?", const="builtin", default=None, metavar="TEXT",
                   help="weight the scale search by each input channel's activations over a text (llama.cpp's "
                        "imatrix): the built-in one, or the file TEXT. Loads the float model first")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("-n", "--max-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system prompt")


def sampling_from_args(args: argparse.Namespace):
    from .sampling import SamplingSettings

    try:
        return SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)
    except ValueError as e:
        raise EdgeLLMError(str(e)) from e


DEFAULT_CTX = 8192


def load_from_args(args: argparse.Namespace, on_tensor=None):
    """Load the model the options name, on the device and dtype they ask for."""
    from .device import parse_dtype, pick_device, set_threads
    from .loading import load_model

    set_threads(args.threads)
    if getattr(args, "activations", None):
        from .kernels.matmul import set_activations

        set_activations(args.activations)
    try:
        device = pick_device(args.device)
        dtype = parse_dtype(args.dtype, device)
    except (ValueError, RuntimeError) as e:
        raise EdgeLLMError(str(e)) from e
    ctx = args.ctx or DEFAULT_CTX
    weights = getattr(args, "weights", "auto")
    per_channel = getattr(args, "per_channel", False)
    if per_channel and weights != "int8":
        raise EdgeLLMError("--per-channel is for int8 weights only")
    loaded = load_model(args.model, device=device, dtype=dtype, max_seq_len=ctx, on_tensor=on_tensor,
                        weights=weights, group_size=0 if per_channel else getattr(args, "group_size", 32),
                        symmetric=getattr(args, "symmetric", True), embeddings=getattr(args, "embeddings", "int8"),
                        search=not getattr(args, "fast", False), calibration=getattr(args, "calibrate", None))
    return loaded


def engine_from_args(args: argparse.Namespace, loaded):
    """The Engine the options describe: KV format and draft proposer."""
    from .cache import KVCache
    from .generate import Engine

    model = loaded.model
    cache = KVCache(model.config, model.rope_len, model.dtype, model.device, kv_format=getattr(args, "kv", "fp"))
    draft_spec = getattr(args, "draft", "none") or "none"
    proposer = None
    if draft_spec != "none":
        from .speculative import make_proposer

        proposer = make_proposer(draft_spec, loaded)
    kwargs = {"draft": proposer, "draft_tokens": getattr(args, "draft_tokens", None)} if proposer else {}
    engine = Engine(model, loaded.tokenizer, cache=cache, **kwargs)
    engine.compile_mode = getattr(args, "compile", "auto")
    return engine


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
    loaded = load_from_args(args)
    tok = loaded.tokenizer
    ids = prompt_ids(args, tok, text)
    engine = engine_from_args(args, loaded)
    if args.truncate and len(ids) >= engine.max_seq_len:
        ids = ids[-(engine.max_seq_len - 1):]  # keep the end: the question is usually last
    settings = GenerationSettings(max_tokens=args.max_tokens, sampling=sampling_from_args(args),
                                  stop_strings=args.stop)
    out: list[int] = []
    pieces: list[str] = []
    done = None
    show_drafts = getattr(args, "show_drafts", False) and engine.draft is not None and not args.json
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

    loaded = load_from_args(args)
    cfg = loaded.config
    model = loaded.model
    weight_bytes = sum(t.nbytes for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())
    from .cache import KVCache

    kv_per_token = KVCache(cfg, 1, model.dtype, "meta", kv_format=getattr(args, "kv", "fp")).bytes_per_token
    kv_all = {f: KVCache(cfg, 1, model.dtype, "meta", kv_format=f).bytes_per_token for f in ("fp", "int8", "int4")}
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
        ("weights run as", f"{loaded.runs_as_text()} (--weights {getattr(args, 'weights', 'auto')})"),
        ("file size", _mib(loaded.file_bytes)),
        ("weights in memory", f"{_mib(weight_bytes)} ({model.dtype})".replace("torch.", "")),
        ("KV cache", f"{kv_per_token / 1024:.1f} KiB/token, {_mib(kv_per_token * ctx)} at {ctx} tokens"),
        ("KV cache by format", ", ".join(f"{f} {_mib(b * ctx)}" for f, b in kv_all.items()) + f" at {ctx} tokens"),
        ("memory needed", _mib(weight_bytes + kv_per_token * ctx)),
        ("chat template", "yes" if loaded.tokenizer.chat_template else "no"),
        ("device", str(model.device)),
    ]
    if args.json:
        print(json.dumps({k: v for k, v in rows}))
        return 0
    table = Table(show_header=False, box=None)
    for k, v in rows:
        table.add_row(f"[bold]{k}[/]", v)
    Console().print(table)
    return 0


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

    for name in ("edgellm.tui.cli", "edgellm.bench", "edgellm.quant.cli", "edgellm.perplexity", "edgellm.serve_cli"):
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
    debug = args.debug or os.environ.get("EDGELLM_DEBUG") == "1"
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
