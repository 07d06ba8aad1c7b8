"""`edgellm quantize SRC -o OUT`: shrink a model to int8/int4 groups, as an edgellm folder or a GGUF."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .errors import EdgeLLMError, OutputError


def add_parser(sub) -> None:
    from .args import add_quant_options

    p = sub.add_parser("quantize", help="quantize a model to int8/int4 (edgellm folder or GGUF)")
    p.add_argument("src", help="HF folder, .gguf file or hub id")
    p.add_argument("-o", "--output", required=True, help="output folder (edgellm) or .gguf file")
    p.add_argument("--weights", default="int4", choices=("int8", "int4"))
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                   help="group size along the input dimension (int8 also: --per-channel)")
    add_quant_options(p)  # --per-channel --sym/--asym --embeddings --fast --calibrate, as run/chat/perplexity take them
    p.add_argument("--format", default=None, choices=("edgellm", "gguf"),
                   help="output format (default: gguf if OUT ends in .gguf, else edgellm)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)


def cmd_quantize(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .atomic import check_writable
    from .device import set_threads
    from .gguf_export import export_gguf
    from .loading import load_model, open_source, resolve_model
    from .quant.convert import QuantSettings
    from .quantized_format import save_edgellm

    set_threads(args.threads)
    out = Path(args.output)
    fmt = args.format or ("gguf" if out.suffix.lower() == ".gguf" else "edgellm")
    group = 0 if args.per_channel else args.group_size
    if args.per_channel and args.weights != "int8":
        raise EdgeLLMError("--per-channel is for int8 weights only")
    if fmt == "gguf" and (group != 32):
        raise EdgeLLMError("GGUF export maps onto Q8_0/Q4_0/Q4_1, which use groups of 32: use --group-size 32")
    settings = QuantSettings(weights=args.weights, group_size=group, symmetric=args.symmetric,
                             embeddings=args.embeddings, search=args.search, calibration=args.calibration)
    if out.exists() and fmt == "edgellm" and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder")
    if out.is_dir() and fmt == "gguf":
        raise OutputError(f"{out}: is a folder; name the .gguf file to write")
    check_writable(out)  # before the minutes of quantizing, not after
    console = Console(stderr=True)
    t0 = time.perf_counter()
    path = resolve_model(args.src)
    src, cfg, _ = open_source(path)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("quantizing", total=len(src.names()))
            loaded = load_model(path, device=args.device, max_seq_len=1, on_tensor=lambda name: bar.advance(task),
                                weights=args.weights, group_size=group, symmetric=args.symmetric,
                                embeddings=args.embeddings, search=args.search, calibration=args.calibration)
            bar.update(task, description="writing", completed=0, total=9 * cfg.n_layers + 3)
            if fmt == "gguf":
                export_gguf(loaded, out, progress=lambda name: bar.advance(task))
            else:
                save_edgellm(loaded, out, settings)
    except KeyboardInterrupt:
        console.print(f"interrupted: nothing was written to {out}")
        return 130
    size_in = loaded.file_bytes
    size_out = out.stat().st_size if out.is_file() else sum(f.stat().st_size for f in out.iterdir())
    bpw = size_out * 8 / cfg.num_parameters()
    console.print(f"wrote {out} ({fmt}): {size_in / 2**20:.1f} MiB → {size_out / 2**20:.1f} MiB, "
                  f"{bpw:.2f} bits/weight, {args.weights} g{group or 'channel'} "
                  f"{'sym' if args.symmetric or args.weights == 'int8' else 'asym'}, embeddings {args.embeddings}, "
                  f"{'RTN' if not args.search and not args.calibration else 'search'}"
                  f"{', calibrated on ' + args.calibration if args.calibration else ''}, {time.perf_counter() - t0:.1f} s")
    return 0


COMMANDS = {"quantize": cmd_quantize}
