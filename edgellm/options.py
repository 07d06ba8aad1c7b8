"""The runtime settings as one frozen value, passed explicitly: built from the command line in one place
(edgellm/args.py `options_from_args`), given to `load_model`, `Engine`, the decode step, bench, perplexity, serve
and the chat. Library code reads no environment variable; the defaults here are edgellm's defaults, so
`load_model(path)` / `Engine(model, tok)` without options behave as `edgellm run` without flags.

Where each setting is read:
  kernel (KernelOptions, kernels/matmul.py): each QuantLinear holds it from load time (the C++ int kernels'
      activations, the prefill GEMM's dtype and crossover); the fused CPU step takes its activations variant.
  decode (DecodeOptions): decode_step.Decoder (compile mode, fused step on/off, the fused step's A/B tuning).
  load (LoadOptions): args.load_from_args → load_model's device, dtype, context, threads and weight format.
  extension (ExtensionSettings, kernels/cpu_ext.py): how the C++ kernels are built and found, applied once per
      process by `configure_process` (the first build wins).
The layer below (kernels/) defines its own settings classes and imports nothing of edgellm; this module composes
them and imports nothing else of ours.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kernels.cpu_decode import DecodeTuning
from .kernels.cpu_ext import ExtensionSettings
from .kernels.matmul import KernelOptions

COMPILE_MODES = ("auto", "inductor", "off")
WEIGHT_FORMATS = ("auto", "fp", "int8", "int4")
DEFAULT_CTX = 8192

__all__ = ["COMPILE_MODES", "DEFAULT_CTX", "DecodeOptions", "DecodeTuning", "ExtensionSettings", "KernelOptions",
           "LoadOptions", "Options", "WEIGHT_FORMATS", "configure_process"]


@dataclass(frozen=True)
class DecodeOptions:
    """How one decode step runs (edgellm/decode_step.py). compile: auto = the fused C++ step on CPU, a CUDA graph
    on CUDA; inductor = a CUDA graph of torch.compile'd layers; off = the eager model op by op. fused: False keeps
    the CPU on the eager model while CUDA still captures its graph (benchmarks compare the two). tuning: the fused
    step's A/B switches."""

    compile: str = "auto"
    fused: bool = True
    tuning: DecodeTuning = field(default_factory=DecodeTuning)

    def __post_init__(self):
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile mode {self.compile!r}: choose from {', '.join(COMPILE_MODES)}")


@dataclass(frozen=True)
class LoadOptions:
    """What `load_model` is asked for: device and dtype names as the command line takes them ("auto": fp32 on CPU,
    bf16 on CUDA), the context (None: min(model's, DEFAULT_CTX)), CPU threads (None: torch's choice) and the weight
    format with its quantization knobs (`--weights int8|int4`: see edgellm quantize)."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    ctx: int | None = None
    threads: int | None = None
    weights: str = "auto"
    group_size: int = 32
    per_channel: bool = False
    symmetric: bool = True
    embeddings: str = "int8"
    search: bool = True
    calibration: str | None = None


@dataclass(frozen=True)
class Options:
    """Every runtime setting of one edgellm process. debug: show tracebacks and which decode path ran."""

    kernel: KernelOptions = field(default_factory=KernelOptions)
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    load: LoadOptions = field(default_factory=LoadOptions)
    extension: ExtensionSettings = field(default_factory=ExtensionSettings)
    debug: bool = False


def configure_process(options: Options) -> None:
    """Apply the process-wide part of `options` (how the C++ kernels are found; malloc keeping freed memory for
    reuse, device.keep_freed_memory) before the first model loads."""
    from .device import keep_freed_memory
    from .kernels.matmul import configure_cpu_extension

    configure_cpu_extension(options.extension)
    keep_freed_memory()
