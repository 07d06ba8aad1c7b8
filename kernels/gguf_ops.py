"""What the C++ GGUF kernels (kernels/cpu_gguf.cpp) take, and when to use them rather than dequantize + GEMM.

`ext.gguf_linear(x, parts, n_total)` multiplies GGUF blocks in place (x rounded to int8 per 32 values, once for all
parts); `ext.gguf_dequantize(raw, type, n, k, out)` gives gguf.quants' fp32 rows bit for bit. For a prompt chunk
of M rows the int-dot row kernel re-decodes each weight row for every 4 activation rows; `ext.gguf_linear_prompt`
(the same product as an int8 panel GEMM, cpu_gguf.cpp "prompt GEMM") decodes each weight once per call and runs
~2.5-3x an fp32 GEMM's rate where it is vectorized (`ext.gguf_prompt_gemm_fast()`: AVX2, AVX-512 VNNI). Elsewhere
(the portable and NEON builds) dequantize + an fp32 GEMM takes the long prompts, past the row counts below.
Parts repacked at load for the AVX2 / AVX-512 kernels carry their type id + X8 (K-quants, IQ4_XS, Q5_0, Q5_1: 8 rows
interleaved) or + R8 (Q5_0 / Q5_1 rows left over from groups of 8: each row's runs of 8 blocks regrouped); IQ2_XXS /
IQ3_XXS / IQ3_S / IQ1_S parts are recoded as L4 blocks, IQ2_XS / IQ2_S parts as L4 blocks with a scale per 16 values
(+ L4, and + L4 + X8 for their 8-row groups): see quant/gguf_linear.repack_for_cpu.
"""
from __future__ import annotations

import torch

# GGML type ids (gguf.GGMLQuantizationType) the kernels multiply natively.
GGUF_NATIVE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
                     "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ3_XXS": 18, "IQ4_NL": 20, "IQ3_S": 21, "IQ4_XS": 23}

# The largest M (rows of x) for which the int-dot kernel beat gguf_dequantize + F.linear, per K-quant, measured by
# benchmarks/gguf_kernels_cpu.py (prefill table: Llama-3.2-1B's 2048 x 2048 projection, M = 16 .. 512; result in
# benchmarks/results/gguf-kernels-cpu.json, `gguf_kernel_max_rows`). Above it, dequantize into a reused buffer
# and run the GEMM. The 32-block types (not measured past 16 rows) take the kernel for decode and verification only.
GGUF_KERNEL_MAX_ROWS = {"Q4_K": 64, "Q5_K": 32, "Q6_K": 32}
_DEFAULT_MAX_ROWS = 16  # the decode / verification passes (<= 16 rows) take the kernel in any case
X8 = 1000  # a K-quant's, IQ4_XS's, Q5_0's or Q5_1's type id + X8: rows repacked 8 at a time (kernels/cpu_gguf_x8.cpp)
R8 = 2000  # a Q5_0 / Q5_1 type id + R8: each row's runs of 8 blocks regrouped (kernels/cpu_gguf.cpp)
L4 = 100  # an IQ2_XXS / IQ3_XXS / IQ3_S / IQ1_S type id + L4: recoded as IQ4_XS blocks indexing its levels (IQ2_XS /
# IQ2_S: with a scale per 16 values; cpu_gguf.h); its x8 form: + L4 + X8


# Where the prompt GEMM is vectorized it takes every product of more than this many rows: it beat the row kernel
# from M = 8 up and dequantize + F.linear at every M measured (8 .. 512; benchmarks/results/gguf-prefill-gemm.json),
# but decode and speculative verification (<= 16 rows) stay on the row kernel, whose rows are bit-identical
# whatever M is. PROMPT_GEMM = False restores the dequantize + GEMM path (for A/B runs).
PROMPT_GEMM_MIN_ROWS = 17
PROMPT_GEMM = True


# Where the extension has the AMX kernel (`ext.gguf_amx_available()`: Intel Xeon since Sapphire Rapids), prefills of
# at least this many rows run on AMX tiles in bf16 (`ext.gguf_linear_amx`, cpu_gguf.cpp "AMX prefill"): 1.2-2.0x the
# prompt GEMM at 128-512 rows of Llama-3.2-1B's shapes (benchmarks/gguf_amx_gemm.py, results/gguf-amx-gemm.json), and
# finer: its bf16 rounding of x and W against the prompt GEMM's int8 x gave SmolLM2 Q4_K_M / Q8_0 a KL to the fp model
# of 0.00016 against 0.0031-0.0033 (results/gguf-amx-kl.json). From 32 rows on, where its TTFT ties the prompt GEMM's
# on the 1B-shaped Q4_K_M (0.98x at 32 tokens, 0.89x at 48) and costs SmolLM2 ~4 ms (1.13x at 32 tokens; 1.2x at 24,
# so shorter prompts keep the prompt GEMM): results/gguf-amx-prefill-ab.json. AMX_GEMM = False keeps the prompt GEMM.
AMX_MIN_ROWS = 32
AMX_GEMM = True


def method(qtypes: list[int], rows: int, prompt_gemm_fast: bool, amx: bool = False) -> str:
    """How to multiply `rows` activation rows by a linear whose parts have GGML types `qtypes` on the CPU with the
    extension: "rows" (the row kernel, gguf_linear), "prompt" (the panel GEMM, gguf_linear_prompt), "amx" (the AMX
    kernel, gguf_linear_amx, where the extension has it: `amx`) or "dequantize" (dequantize + float GEMM)."""
    if AMX_GEMM and amx and rows >= AMX_MIN_ROWS:
        return "amx"
    if PROMPT_GEMM and prompt_gemm_fast:
        return "rows" if rows < PROMPT_GEMM_MIN_ROWS else "prompt"
    return "rows" if all(use_kernel(t, rows) for t in qtypes) else "dequantize"


def use_kernel(qtype: int, rows: int) -> bool:
    """(Builds without a vectorized prompt GEMM) True where the int-dot row kernel is the faster way to multiply
    `rows` activation rows by a `qtype` tensor. The x8 layout's kernel beats dequantize + F.linear at every M (M =
    512, 2048 x 2048, one thread: Q4_K 210 GOP/s, Q6_K 110, against 89 for the fp32 GEMM)."""
    if qtype >= X8:
        return True
    names = {v: k for k, v in GGUF_NATIVE_TYPES.items()}
    return rows <= GGUF_KERNEL_MAX_ROWS.get(names.get(qtype, ""), _DEFAULT_MAX_ROWS)


# IQ4_NL / IQ4_XS: the int8 level of each 4-bit code (ggml-common.h kvalues_iq4nl), as the bytes of two int64
# constants: `iq4_levels` builds the table on the blocks' device from fills and shifts (no host copy: a CUDA graph
# can capture it). Used by quant/gguf_tensor.py (torch dequantization) and kernels/triton_gguf.py.
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_WORDS = tuple(int.from_bytes(bytes(v & 0xFF for v in IQ4_LEVELS[i:i + 8]), "little", signed=True) for i in (0, 8))


def iq4_levels(device: torch.device) -> torch.Tensor:
    """The 16 levels as float32 [16] on `device`."""
    shifts = torch.arange(0, 64, 8, device=device, dtype=torch.int64)
    words = [(torch.full((1,), w, dtype=torch.int64, device=device) >> shifts) & 0xFF for w in _IQ4_WORDS]
    return torch.cat(words).to(torch.uint8).view(torch.int8).float()
