"""The command line's shared options and the one place they become an `Options` value (`options_from_args`),
plus loading a model and building an engine from that value. The commands (cli.py, bench, perplexity, serve,
quantize, the chat) import this module; nothing below the commands imports it, and nothing imports cli.py but the
entry point.

Environment variables that are the right interface for a location (EDGELLM_EXT_CACHE: where the C++ kernels are
built; EDGELLM_DEBUG=1: as --debug) are read here, once, and passed down as options.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Mapping

from .errors import EdgeLLMError
from .options import (COMPILE_MODES, DEFAULT_CTX, WEIGHT_FORMATS, DecodeOptions, DecodeTuning, ExtensionSettings,
                      KernelOptions, LoadOptions, Options, configure_process)

ACTIVATION_NAMES = ("int8", "int8x2", "fp32")
PREFILL_NAMES = ("auto", "fp32", "bf16")


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
    add_kernel_options(g)
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks and which decode path runs (or EDGELLM_DEBUG=1)")


def add_kernel_options(g) -> None:
    """How the decode step and the CPU kernels run (every command that loads a model takes these)."""
    g.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                   help="the decode step as one unit: auto = fused C++ step on CPU, CUDA graph on CUDA; "
                        "inductor = CUDA graph of torch.compile'd layers (CUDA: ~2x decode, 10-30 s to compile "
                        "on first use); off = op by op (default auto)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="same as --compile off")
    g.add_argument("--no-fused", dest="fused", action="store_false", default=True,
                   help="CPU: run the eager model instead of the fused C++ decode step (CUDA graphs stay on)")
    g.add_argument("--no-ext", dest="ext", action="store_false", default=True,
                   help="do not build or use the C++ CPU kernels (the torch paths only)")
    g.add_argument("--prefill", default="auto", choices=PREFILL_NAMES,
                   help="prefill of int8/int4 weights: auto = the C++ kernel up to the measured crossover, then "
                        "dequantize + a GEMM (bf16 for int4 where the CPU has it natively); fp32 | bf16 = every "
                        "prefill through dequantize + a GEMM of that dtype (default auto)")


def kv_format_arg(value: str) -> str:
    from .cache import parse_kv_format

    if value == "auto":
        return value
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
    g.add_argument("--kv", default="auto", type=kv_format_arg,
                   help="KV-cache storage: auto (f16 on the CPU, else fp) | fp (the compute dtype) | f16 | int8 | int4, "
                        "optionally :GROUP (int8:32, int4:64) (default: auto)")
    add_activations_option(g)
    if draft:
        g.add_argument("--draft", default="none",
                       help="speculative decoding: none | self[:int4|:int8][:asym|:sym][:L<n>] (int4 asym g32 copy by default) | lookup | MODEL")
        g.add_argument("--draft-tokens", type=int, default=None, help="fix the draft length (default: adaptive)")
        g.add_argument("--show-drafts", action="store_true", help="colour tokens that came from accepted drafts")


def add_activations_option(g) -> None:
    g.add_argument("--activations", default=None, choices=ACTIVATION_NAMES,
                   help="CPU int8/int4 matmuls: activations rounded to int8 per block (default, llama.cpp's "
                        "numerics), int8 plus an int8 residual (closer to fp32, a decode step ~1.3x as long), or fp32")


def add_quant_options(p: argparse.ArgumentParser) -> None:
    """How --weights int8|int4 quantizes at load: the knobs of `edgellm quantize`."""
    g = p.add_argument_group("quantization (with --weights int8|int4)")
    g.add_argument("--per-channel", action="store_true", help="int8: one scale per output channel")
    sym = g.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="symmetric", action="store_true", default=True, help="int4 symmetric (default)")
    sym.add_argument("--asym", dest="symmetric", action="store_false", help="int4 with scale + min")
    g.add_argument("--embeddings", default="int8", choices=("int8", "int4", "fp"),
                   help="embedding table / LM head format (default int8)")
    g.add_argument("--fast", dest="search", action="store_false", default=True,
                   help="round-to-nearest instead of the scale search")
    g.add_argument("--calibrate", dest="calibration", nargs="?", const="builtin", default=None, metavar="TEXT",
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


# ------------------------------------------------------------------------------------------------
# argparse → Options (the one function), and what the commands build from it
# ------------------------------------------------------------------------------------------------
def options_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Options:
    """The Options the parsed command line asks for. A command's parser adds only the option groups it needs;
    a setting it has no flag for keeps its default (each dataclass field takes the flag of the same name)."""
    ns = vars(args)

    def pick(cls, **renamed):
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: ns[renamed.get(k, k)] for k in names if renamed.get(k, k) in ns}

    try:
        kernel = KernelOptions.from_names(ns.get("activations"), ns.get("prefill") or "auto")
        decode = DecodeOptions(tuning=DecodeTuning(), **pick(DecodeOptions))
    except ValueError as e:
        raise EdgeLLMError(str(e)) from e
    load = LoadOptions(**pick(LoadOptions))
    if load.per_channel and load.weights != "int8":
        raise EdgeLLMError("--per-channel is for int8 weights only")
    cache_dir = environ.get("EDGELLM_EXT_CACHE") or None
    extension = ExtensionSettings(enabled=ns.get("ext", True), cache_dir=cache_dir and os.path.expanduser(cache_dir))
    return Options(kernel=kernel, decode=decode, load=load, extension=extension, debug=debug_requested(args, environ))


def debug_requested(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> bool:
    """--debug, or EDGELLM_DEBUG=1 (for a command run by another program)."""
    return bool(vars(args).get("debug")) or environ.get("EDGELLM_DEBUG") == "1"


def load_from_options(options: Options, on_tensor: Callable[[str], None] | None = None):
    """Load the model the options name, on the device and dtype they ask for."""
    from .device import parse_dtype, pick_device, set_threads
    from .loading import load_model

    configure_process(options)
    lo = options.load
    set_threads(lo.threads)
    try:
        device = pick_device(lo.device)
        dtype = parse_dtype(lo.dtype, device)
    except (ValueError, RuntimeError) as e:
        raise EdgeLLMError(str(e)) from e
    return load_model(lo.model, device=device, dtype=dtype, max_seq_len=lo.ctx or DEFAULT_CTX, on_tensor=on_tensor,
                      weights=lo.weights, group_size=0 if lo.per_channel else lo.group_size, symmetric=lo.symmetric,
                      embeddings=lo.embeddings, search=lo.search, calibration=lo.calibration, options=options)


def engine_from_options(options: Options, loaded, kv: str = "auto", draft: str | None = None,
                        draft_tokens: int | None = None):
    """The Engine for a loaded model: KV format, draft proposer (--draft), the decode options."""
    from .cache import KVCache
    from .generate import Engine

    model = loaded.model
    cache = KVCache(model.config, model.rope_len, model.dtype, model.device, kv_format=kv)
    proposer = None
    if (draft or "none") != "none":
        from .speculative import make_proposer

        proposer = make_proposer(draft, loaded)
    kwargs = {"draft": proposer, "draft_tokens": draft_tokens} if proposer else {}
    return Engine(model, loaded.tokenizer, cache=cache, options=options, **kwargs)


def load_from_args(args: argparse.Namespace, on_tensor=None):
    """`load_from_options(options_from_args(args))`."""
    return load_from_options(options_from_args(args), on_tensor)


def engine_from_args(args: argparse.Namespace, loaded):
    """The Engine the options describe: KV format (--kv), draft proposer (--draft, --draft-tokens)."""
    ns = vars(args)
    return engine_from_options(options_from_args(args), loaded, kv=ns.get("kv", "auto"), draft=ns.get("draft"),
                               draft_tokens=ns.get("draft_tokens"))


def show_decode_path(options: Options, engine) -> None:
    """With --debug: which decode step the engine runs, and why not a faster one, and the prefill's kernels (on
    stderr)."""
    if options.debug:
        import sys

        from .prefill_path import fused_prefill_rows, prefill_path

        print(f"edgellm: decode path: {engine.decode_path}", file=sys.stderr)
        path = prefill_path(engine.model, fused_rows=fused_prefill_rows(engine.compiled_step()))
        print(f"edgellm: prefill path: {path}", file=sys.stderr)
