"""Weight-only int8 / int4 matmul on group-quantized weights, per device.

Works on raw tensors in the packed format of `edgellm.quant.groups` (imports nothing of edgellm's):
  int8: codes int8 [N, K],                 w = codes * scale
  int4: codes uint8 [N, K//2] (GGUF Q4 block nibble order: kernels/int4_layout.py), w = (codes - 8) * scale   (symmetric)
                                                            w = codes * scale + min  (asymmetric)
  scales / mins: float16 [N, K // group_size]. Dequantization is done in float32, in exactly that
  order, so a GGUF Q8_0/Q4_0/Q4_1 import dequantizes bit for bit like `gguf.quants.dequantize`.

Dispatch (`int8_linear` / `int4_linear`):
  CPU, M <= 16 tokens (decode, verification): the C++ kernel of `kernels/cpu_ext.py` when it builds
  (reads the codes once); prefills up to the crossover measured for the kernel build, activations and
  GEMM dtype (PREFILL_KERNEL_MAX_M) too.
  CPU otherwise: float GEMM on a dequantized weight — the caller's cached copy (`dense=`) or one
  dequantized for this call. torch's own CPU packed kernels (`_weight_int4pack_mm_for_cpu`,
  `_weight_int8pack_mm`) measured 28x / 10x slower than fp32 F.linear on a 1536x576 matvec on our
  AVX2 CPU (4,350 / 1,580 µs vs 157 µs), so they are never used on CPU.
  CUDA / MPS: torch's tinygemm int4 kernel and `_weight_int8pack_mm` on weights repacked once by
  `pack_for_device` (the caller keeps the pack), for small M only; larger M and shapes they cannot
  take dequantize into the compute dtype and use the float GEMM. Measured on an H100, torch 2.11, µs
  (bf16 F.linear | tinygemm int4 g32 | int8pack per channel | dequantize + F.linear, int8 g32):
    4096x4096  M=1:   22 |   25 |   127 | 167
    4096x4096  M=16:  21 |   24 |   615 | 167
    4096x4096  M=512: 25 |  593 | 18834 | 178
    14336x4096 M=1:   43 |   40 |   281 | 543
  so tinygemm serves M <= 16 and `_weight_int8pack_mm` only M == 1 (a naive kernel; int8 on CUDA is
  ~6x slower than bf16 either way: a fused GEMV kernel is the next step there).
"""
from __future__ import annotations

import functools
import os
import platform
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gguf_ops
from .int4_layout import Q4_BLOCK as BLOCK, unpack_q4_blocks

CPU_KERNEL_MAX_M = 16  # decode and verification sizes: always the C++ kernel (prefill: PREFILL_KERNEL_MAX_M)
TINYGEMM_MAX_M = 16  # tinygemm int4 (CUDA/MPS): ~bf16 speed at M <= 16, 20x slower than it at M = 512
INT8PACK_MAX_M = 1  # torch's int8pack kernel beats dequantize+GEMM at M = 1 only (see above)

_cpu_ext_state: dict[str, object] = {}
# How the C++ kernel takes the activations (KernelOptions.activations, `--activations`):
#   int8   rounded to int8 per 32-block (llama.cpp's numerics, ~0.5% relative error per product; the default,
#          2.4x faster than fp32 here),
#   int8x2 int8 plus an int8 residual as a second kernel row (~2^-14 error; a decode step 1.3x as long on
#          the bundled model, fp32 2.3x: benchmarks/activations_cpu.py),
#   fp32   float-fma: exact to the dequantized reference up to fp32 summation order (`--activations fp32`).
_INT_DOT_OR_AUTO, _FLOAT_FMA, _INT_DOT_RESIDUAL = 0, 2, 5
ACTIVATIONS = {"int8": _INT_DOT_OR_AUTO, "int8x2": _INT_DOT_RESIDUAL, "fp32": _FLOAT_FMA}
PREFILL_MODES = ("auto", "fp32", "bf16")
_NO_MINS = torch.empty(0, dtype=torch.float16, device="cpu")  # the C++ kernel takes an empty tensor for "no mins"


ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")


@functools.lru_cache(maxsize=1)
def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16, AMX; aarch64's BF16 extension): there a bf16 GEMM
    measured 2-4x the fp32 GEMM's speed at 512 tokens on a 2-core Zen 4 (benchmarks/results/decode-cpu.md);
    without it bf16 is several times slower than fp32. On x86 the CPU's own flags decide: oneDNN reports bf16
    support on any AVX-512 CPU, where it emulates it (an Ice Lake Xeon: a 512 x 1536 x 576 bf16 GEMM 17.6 ms, fp32
    5.1 ms), and taking that for native made every long prefill of int4 weights 3.5x slower there. oneDNN capped
    below bf16 by ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA emulates it too (AVX2 capped on an AMX host: a 512-token
    SmolLM2 Q4_0 TTFT 3.1 s against 0.25 s), so such a cap counts as no bf16."""
    isa_cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if isa_cap in ONEDNN_ISAS_WITHOUT_BF16:
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        flags = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
        return any(bool(f()) for f in flags if f is not None)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class KernelOptions:
    """What the CPU int8/int4 kernels and the prefill GEMMs of quantized weights read. Chosen at load time and
    held by each QuantLinear (and given to the fused decode step); the defaults are edgellm's defaults.

    activations: see ACTIVATIONS above.
    prefill_kernel: prefills of up to the measured crossover (PREFILL_KERNEL_MAX_M) run in the C++ kernel, longer
      ones through dequantize + GEMM; False sends every prefill (more than CPU_KERNEL_MAX_M rows) to the GEMM.
    prefill_bf16: the GEMM of int4 weights in bf16; None = where the CPU multiplies bf16 natively. The weights
      are int4 approximations already; bf16 activations cost less than the decode kernel's int8 rounding of them.
    prefill_bf16_int8: int8 weights' GEMM in bf16 too. int8 is the near-lossless choice and bf16 doubled its
      error (GPL-3, calibrated int8 g32: KL 0.0011 / top-1 97.5% with bf16 prefill, 0.0004 / 98.9% in fp32),
      so it stays fp32 unless asked. The fp32 activations (float-FMA) keep every GEMM in fp32."""

    activations: str = "int8"
    prefill_kernel: bool = True
    prefill_bf16: bool | None = None
    prefill_bf16_int8: bool = False

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: choose from {', '.join(ACTIVATIONS)}")

    @classmethod
    def from_names(cls, activations: str | None = None, prefill: str = "auto") -> KernelOptions:
        """From the command line's names: `--activations int8|int8x2|fp32`, `--prefill auto|fp32|bf16`
        (fp32 / bf16: every prefill through dequantize + a GEMM of that dtype, int8 weights included)."""
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill {prefill!r}: choose from {', '.join(PREFILL_MODES)}")
        opts = {} if prefill == "auto" else {"prefill_kernel": False, "prefill_bf16": prefill == "bf16",
                                             "prefill_bf16_int8": prefill == "bf16"}
        return cls(activations=activations or "int8", **opts)

    @property
    def variant(self) -> int:
        """The C++ kernels' variant number for these activations."""
        return ACTIVATIONS[self.activations]

    @property
    def exact(self) -> bool:
        return self.variant == _FLOAT_FMA

    def dense_bf16(self, bits: int) -> bool:
        """Whether a prefill GEMM of `bits`-bit weights runs in bf16."""
        on = native_bf16_gemm() if self.prefill_bf16 is None else self.prefill_bf16
        return on and not self.exact and (bits == 4 or self.prefill_bf16_int8)


DEFAULT_OPTIONS = KernelOptions()


# Prefill (more rows than CPU_KERNEL_MAX_M): up to how many rows the C++ int kernel beats dequantize + GEMM,
# by the kernel build (isa()), the activations variant and the GEMM's dtype. The kernel streams the codes
# once per call and its integer dots run at up to twice the fp32 GEMM's rate (VNNI); the GEMM pays a
# dequantize pass, a dtype conversion and its own weight packing per call. Measured on the bundled model,
# 2 threads, kernel and GEMM interleaved (benchmarks/prefill_cpu.py, results/prefill-cpu.json; ratio =
# GEMM time / kernel time): int8 activations against the fp32 GEMM 1.9-5.2x (VNNI) and 1.1-3.6x (AVX2)
# at 17-512 rows; against the bf16 GEMM 3.4x at 17 rows, 1.35x at 128, 1.0 at 256, and in `edgellm bench`
# TTFT (the two rules alternating by process) 1.5-1.9x at 24-64 tokens and level at 96-128, where the bf16
# GEMM's rounding (smaller than int8 activations') decides. int8x2 (two kernel rows per token) wins over fewer
# rows. Combinations not listed (the float-FMA variant, scalar and NEON builds, an AVX2 build beside a
# native bf16 GEMM) keep the GEMM above CPU_KERNEL_MAX_M. The AVX-VNNI build ("avx2vnni") runs the AVX2 int kernels
# (its VNNI serves the GGUF kernels): the AVX2 rows.
PREFILL_KERNEL_MAX_M = {
    ("avx512vnni", _INT_DOT_OR_AUTO, "bf16"): 64,
    ("avx512vnni", _INT_DOT_OR_AUTO, "fp32"): 512,
    ("avx2", _INT_DOT_OR_AUTO, "fp32"): 512,
    ("avx2vnni", _INT_DOT_OR_AUTO, "fp32"): 512,
    ("avx512vnni", _INT_DOT_RESIDUAL, "bf16"): 32,
    ("avx512vnni", _INT_DOT_RESIDUAL, "fp32"): 256,
    ("avx2", _INT_DOT_RESIDUAL, "fp32"): 24,
    ("avx2vnni", _INT_DOT_RESIDUAL, "fp32"): 24,
}


def _in_kernel(ext, bits: int, x: torch.Tensor, opts: KernelOptions) -> bool:
    """Whether x runs in the C++ kernel (decode sizes always) or dequantize + GEMM."""
    rows = _rows(x)
    return rows <= CPU_KERNEL_MAX_M or (opts.prefill_kernel and rows <= _kernel_max_rows(ext, bits, x, opts))


def _kernel_max_rows(ext, bits: int, x: torch.Tensor, opts: KernelOptions) -> int:
    """Prefills of up to this many rows run in the C++ kernel (the prefill_kernel mode's table)."""
    if "isa" not in _cpu_ext_state:
        _cpu_ext_state["isa"] = ext.isa() if hasattr(ext, "isa") else ""
    bf16 = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and opts.dense_bf16(bits))
    key = (_cpu_ext_state["isa"], opts.variant, "bf16" if bf16 else "fp32")
    return PREFILL_KERNEL_MAX_M.get(key, CPU_KERNEL_MAX_M)


# Where the extension has a vectorized int8 panel GEMM (kernels/cpu_gguf.cpp "prompt GEMM": AVX2, AVX-512 VNNI), it
# takes the prefills the int kernel would take and the longer ones the fp32 GEMM would: it decodes each weight value
# once per call where the int kernel re-reads the codes per group of rows. Same int8 activations, same integer sums:
# equal to the int kernel to fp32 rounding. Measured (benchmarks/quant_prompt_gemm.py, results/quant-prompt-gemm.json).
# The bf16 GEMM's range on CPUs that multiply bf16 natively is left as measured above. False: the rules above only.
QUANT_PROMPT_GEMM = True


def _prompt_gemm(ext, bits: int, x: torch.Tensor, group_size: int, opts: KernelOptions) -> bool:
    """Whether this prefill runs in the extension's int8 prompt GEMM (quant_linear_prompt)."""
    rows = _rows(x)
    if (not QUANT_PROMPT_GEMM or rows <= CPU_KERNEL_MAX_M or not opts.prefill_kernel
            or opts.variant != _INT_DOT_OR_AUTO or group_size % BLOCK or x.shape[-1] % BLOCK):
        return False
    if "prompt" not in _cpu_ext_state:
        _cpu_ext_state["prompt"] = hasattr(ext, "quant_linear_prompt") and bool(ext.gguf_prompt_gemm_fast())
    if not _cpu_ext_state["prompt"]:
        return False
    bf16 = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and opts.dense_bf16(bits))
    return not bf16 or rows <= _kernel_max_rows(ext, bits, x, opts)


_amx_by_ext: dict[int, bool] = {}


def amx_kernels(ext) -> bool:
    """Whether this extension runs its AMX kernels here (gguf_linear_amx, quant_linear_prompt(..., amx=True),
    flash_causal(..., amx=True)): an AVX-512 VNNI build on a CPU with AMX-BF16 whose kernel grants the tile state.
    Asked once per extension (the GGUF linears, these prefills and the attention all ask)."""
    key = id(ext)
    if key not in _amx_by_ext:
        _amx_by_ext[key] = hasattr(ext, "gguf_amx_available") and bool(ext.gguf_amx_available())
    return _amx_by_ext[key]


def _amx_prompt(ext, x: torch.Tensor, group_size: int, opts: KernelOptions) -> bool:
    """Whether this prefill runs on the extension's AMX kernel (quant_linear_prompt(..., amx=True)): from
    gguf_ops.AMX_MIN_ROWS rows on, where the CPU has AMX, as GGUF linears do (kernels/gguf_ops.py)."""
    if (not gguf_ops.AMX_GEMM or _rows(x) < gguf_ops.AMX_MIN_ROWS or not opts.prefill_kernel
            or opts.variant != _INT_DOT_OR_AUTO or group_size % BLOCK or x.shape[-1] % BLOCK):
        return False
    return amx_kernels(ext)


def cpu_method(ext, bits: int, x: torch.Tensor, group_size: int, opts: KernelOptions) -> str:
    """How int8_linear / int4_linear multiply x with the CPU extension `ext` (None: not built, or not the CPU):
    "amx" (quant_linear_prompt on AMX tiles), "prompt" (its int8 panel GEMM), "kernel" (the int-dot row kernel) or
    "dense" (dequantize + the float GEMM, bf16 where opts.dense_bf16(bits))."""
    if ext is None:
        return "dense"
    if _amx_prompt(ext, x, group_size, opts):
        return "amx"
    if _prompt_gemm(ext, bits, x, group_size, opts):
        return "prompt"
    return "kernel" if _in_kernel(ext, bits, x, opts) else "dense"


def _float_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, bits: int,
                  opts: KernelOptions) -> torch.Tensor:
    """x @ w.T (+ bias) for a dequantized weight: fp32 in x's dtype, or bf16 where `opts.dense_bf16(bits)`."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and opts.dense_bf16(bits)
            and _rows(x) > CPU_KERNEL_MAX_M):
        out = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16))
        out = out.to(torch.float32)
        return out if bias is None else out.add_(bias.to(torch.float32))
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


# ------------------------------------------------------------------------------------------------
# Dequantization (the reference every path is measured against)
# ------------------------------------------------------------------------------------------------
def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = codes.shape
    w = codes.to(torch.float32).reshape(n, k // group_size, group_size) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = codes.shape[0]
    k = codes.shape[1] * 2
    q = unpack_q4_blocks(codes).to(torch.float32).reshape(n, k // group_size, group_size)
    s = scales.to(torch.float32).unsqueeze(-1)
    if mins is None:
        w = (q - 8.0) * s
    else:
        w = q * s + mins.to(torch.float32).unsqueeze(-1)  # two roundings, like numpy: no FMA
    return w.reshape(n, k).to(dtype)


# ------------------------------------------------------------------------------------------------
# The CPU extension (written separately; optional)
# ------------------------------------------------------------------------------------------------
def cpu_extension():
    """The built C++ module, or None (disabled, no compiler, failed build). Looked up once, with the settings of
    `configure_cpu_extension` (default: the best build for this CPU, in the user cache folder)."""
    if "ext" not in _cpu_ext_state:
        from .cpu_ext import get_extension

        _cpu_ext_state["ext"] = get_extension(_cpu_ext_state.get("settings"))
    return _cpu_ext_state["ext"]


def cpu_kernel_build() -> str | None:
    """The C++ kernels' build this process runs ("avx512vnni", "avx2vnni", "avx2", "neon-dotprod", ...; None without
    them): what `edgellm info` and a bench row's machine name beside the CPU's flags (EDGELLM_EXT_ISA can pick a
    lesser build than the flags allow)."""
    ext = cpu_extension()
    return ext.isa() if ext is not None and hasattr(ext, "isa") else None


def configure_cpu_extension(settings) -> None:
    """How `cpu_extension()` finds the kernels (a `cpu_ext.ExtensionSettings`: disabled, a forced ISA, the cache
    folder). The app sets it once from its options, before the first matmul."""
    _cpu_ext_state.clear()
    _cpu_ext_state["settings"] = settings


def set_cpu_extension(ext) -> None:
    """Override the lookup: None disables the C++ kernel (tests of the float path, benchmarks)."""
    _cpu_ext_state.clear()
    _cpu_ext_state["ext"] = ext


def set_kernel_tuning(rows16: bool = True, rows8_min_tokens: int = 2) -> None:
    """A/B switches of the C++ int kernels for benchmarks (the same bits, other speed; process-wide, like the
    extension): rows16 = False keeps multi-token calls on 8-row groups on AVX-512 VNNI builds instead of 16 rows
    in 512-bit registers; rows8_min_tokens = from how many tokens a call takes weight rows 8 at a time (default 2;
    a large value keeps every call on the one-row kernel)."""
    ext = cpu_extension()
    if ext is not None and hasattr(ext, "set_kernel_tuning"):
        ext.set_kernel_tuning(bool(rows16), int(rows8_min_tokens))


def has_cpu_kernel() -> bool:
    return cpu_extension() is not None


# ------------------------------------------------------------------------------------------------
# Device packs (CUDA / MPS): repacked once, never per call
# ------------------------------------------------------------------------------------------------
@dataclass
class DevicePack:
    """Weights in the layout of torch's device kernels. kind: 'int4_tinygemm' or 'int8_channel'."""

    kind: str
    weight: torch.Tensor  # tinygemm int32 [N/8, K/(16*t), 32, t/2] | int8 [N, K]
    scales: torch.Tensor  # tinygemm [K/g, N, 2] (scale, zero) | [N] per-channel scales
    group_size: int
    dtype: torch.dtype  # activations are cast to this for the kernel
    max_m: int  # the kernel serves inputs of at most this many rows; larger ones dequantize + GEMM

    @property
    def device(self) -> torch.device:
        return self.weight.device


def _tinygemm_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    # CUDA tinygemm takes bfloat16 activations and scales only; MPS takes the activation dtype.
    return torch.bfloat16 if device.type == "cuda" else dtype


def pack_int4_tinygemm(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                       dtype: torch.dtype) -> DevicePack | None:
    """Repack our int4 codes for `torch.ops.aten._weight_int4pack_mm` (CUDA / MPS), or None where the
    kernel cannot take the shape. tinygemm reads an int4 value as q - 8 and computes
    w = (q - 8) * scale + zero, so: symmetric → zero = 0; asymmetric (w = q*s + m) → zero = m + 8*s."""
    n, k = codes.shape[0], codes.shape[1] * 2
    if n % 8 or group_size not in (32, 64, 128):
        return None
    inner_k_tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
    if inner_k_tiles is None:
        return None
    q = unpack_q4_blocks(codes)
    # the kernel's input is uint8 [N, K/2] with the even k in the HIGH nibble (torchao's convention)
    tiny = ((q[:, ::2] << 4) | q[:, 1::2]).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(tiny, inner_k_tiles)
    s = scales.to(torch.float32)
    z = torch.zeros_like(s) if mins is None else mins.to(torch.float32) + 8.0 * s
    kdtype = _tinygemm_dtype(codes.device, dtype)
    sz = torch.stack((s, z), dim=-1).transpose(0, 1).contiguous().to(kdtype)  # [K/g, N, 2]
    return DevicePack("int4_tinygemm", packed, sz, group_size, kdtype, TINYGEMM_MAX_M)


def pack_int8_channel(codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> DevicePack | None:
    """`_weight_int8pack_mm` takes one scale per output channel only: group-wise int8 returns None."""
    n, k = codes.shape
    if group_size != k or (codes.device.type == "mps" and (n % 32 or k % 32)):
        return None
    return DevicePack("int8_channel", codes.contiguous(), scales.reshape(n).to(dtype), group_size, dtype,
                      INT8PACK_MAX_M)


def pack_for_device(bits: int, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    group_size: int, dtype: torch.dtype) -> DevicePack | None:
    """The device kernel's layout for these weights (on their device), or None: use the fallback."""
    if codes.device.type not in ("cuda", "mps"):
        return None
    if bits == 4:
        return pack_int4_tinygemm(codes, scales, mins, group_size, dtype)
    return pack_int8_channel(codes, scales, group_size, dtype)


def _packed_matmul(x2: torch.Tensor, pack: DevicePack) -> torch.Tensor:
    xk = x2.to(pack.dtype).contiguous()
    if pack.kind == "int4_tinygemm":
        return torch.ops.aten._weight_int4pack_mm(xk, pack.weight, pack.group_size, pack.scales)
    return torch.ops.aten._weight_int8pack_mm(xk, pack.weight, pack.scales)


# ------------------------------------------------------------------------------------------------
# The linears
# ------------------------------------------------------------------------------------------------
def _finish(out2: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = out2.reshape(*x.shape[:-1], out2.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def _finish_cpu(out2: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """_finish for the C++ kernel's fresh fp32 [M, N]: no op that is not needed (each costs µs from Python),
    the bias added in place."""
    if x.dim() != 2:
        out2 = out2.view(*x.shape[:-1], out2.shape[-1])
    if x.dtype != torch.float32:
        out2 = out2.to(x.dtype)
    return out2 if bias is None else out2.add_(bias.to(out2.dtype))


# Prefill (M > 16 on CPU) dequantizes a layer's weight for the float GEMM into one buffer per thread, reused by
# every layer: a fresh multi-MB tensor per call costs page faults and torch's ~6 passes over it (measured: the
# torch dequantize took a third of a 512-token int4 prefill). Weights larger than this are not kept.
SCRATCH_MAX_ELEMENTS = 16 << 20  # 64 MiB of fp32
_scratch = threading.local()


def _dequantize_cpu(bits: int, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    group_size: int, x: torch.Tensor) -> torch.Tensor | None:
    """The fp32 weight from the C++ dequantizer (bit-identical to `dequantize_int4/8`) in the reused buffer,
    or None (not CPU / fp32, no extension, a layout it does not take): the caller uses the torch one."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or codes.device.type != "cpu":
        return None
    ext = cpu_extension()
    if ext is None or not hasattr(ext, "dequant_out"):
        return None
    n = codes.shape[0]
    k = codes.shape[1] * (2 if bits == 4 else 1)
    if k % BLOCK or group_size % BLOCK or not (codes.is_contiguous() and scales.is_contiguous()):
        return None
    numel = n * k
    buf = getattr(_scratch, "buf", None)
    if numel > SCRATCH_MAX_ELEMENTS:
        buf = torch.empty(numel, dtype=torch.float32)
    elif buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return ext.dequant_out(codes, scales, _NO_MINS if mins is None else mins.contiguous(), group_size, bits, buf)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _use_pack(pack: DevicePack | None, x: torch.Tensor) -> bool:
    return pack is not None and pack.device == x.device and _rows(x) <= pack.max_m


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, dense: torch.Tensor | None = None,
                pack: DevicePack | None = None, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """x [..., K] @ dequant(codes).T (+ bias) → [..., N] in x.dtype. `dense`: a dequantized copy of
    the weight the caller keeps (any float dtype); `pack`: from `pack_for_device`; `options`: the CPU
    kernel's activations and the prefill compute."""
    k = x.shape[-1]
    if _use_pack(pack, x):
        return _finish(_packed_matmul(x.reshape(-1, k), pack), x, bias)
    ext = cpu_extension() if x.device.type == "cpu" else None
    how = cpu_method(ext, 8, x, group_size, options)
    if how in ("amx", "prompt"):
        out = ext.quant_linear_prompt(x.reshape(-1, k), codes, scales, _NO_MINS, group_size, 8, how == "amx")
        return _finish_cpu(out, x, bias)
    if how == "kernel":  # the C++ side makes x contiguous fp32
        out = ext.int8_gemm_variant(x.reshape(-1, k), codes, scales, group_size, options.variant)
        return _finish_cpu(out, x, bias)
    w = dense if dense is not None else _dequantize_cpu(8, codes, scales, None, group_size, x)
    if w is None:
        w = dequantize_int8(codes, scales, group_size, x.dtype)
    return _float_linear(x, w, bias, 8, options)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                group_size: int, bias: torch.Tensor | None = None, *, dense: torch.Tensor | None = None,
                pack: DevicePack | None = None, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """As `int8_linear`, for int4 codes (symmetric when `mins` is None)."""
    k = x.shape[-1]
    if _use_pack(pack, x):
        return _finish(_packed_matmul(x.reshape(-1, k), pack), x, bias)
    ext = cpu_extension() if x.device.type == "cpu" else None
    m = _NO_MINS if mins is None else mins
    how = cpu_method(ext, 4, x, group_size, options)
    if how in ("amx", "prompt"):
        out = ext.quant_linear_prompt(x.reshape(-1, k), codes, scales, m, group_size, 4, how == "amx")
        return _finish_cpu(out, x, bias)
    if how == "kernel":
        out = ext.int4_gemm_variant(x.reshape(-1, k), codes, scales, m, group_size, options.variant)
        return _finish_cpu(out, x, bias)
    w = dense if dense is not None else _dequantize_cpu(4, codes, scales, mins, group_size, x)
    if w is None:
        w = dequantize_int4(codes, scales, mins, group_size, x.dtype)
    return _float_linear(x, w, bias, 4, options)
