"""What the C++ GGUF kernels (kernels/cpu_gguf.cpp) take, and when to use them rather than dequantize + GEMM.

`ext.gguf_linear(x, parts, n_total)` multiplies GGUF blocks in place (x rounded to int8 per 32 values, once for all
parts); `ext.gguf_dequantize(raw, type, n, k, out)` gives gguf.quants' fp32 rows bit for bit. For a prompt chunk
of M rows the int-dot kernel re-decodes each weight row for every 4 activation rows, while dequantize + an fp32
GEMM pays the decoding once and then runs at GEMM speed: past some M the second wins.
"""
from __future__ import annotations

# GGML type ids (gguf.GGMLQuantizationType) the kernels multiply natively.
GGUF_NATIVE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

# The largest M (rows of x) for which the int-dot kernel beat gguf_dequantize + F.linear, per K-quant, measured by
# benchmarks/gguf_kernels_cpu.py (prefill table: Llama-3.2-1B's 2048 x 2048 projection, M = 16 .. 512; result in
# benchmarks/results/gguf-kernels-cpu.json, `gguf_kernel_max_rows`). Above it, dequantize into a reused buffer
# and run the GEMM. The 32-block types (not measured past 16 rows) take the kernel for decode and verification only.
GGUF_KERNEL_MAX_ROWS = {"Q4_K": 64, "Q5_K": 32, "Q6_K": 32}
_DEFAULT_MAX_ROWS = 16
X8 = 1000  # a K-quant's type id + X8: its rows repacked 8 at a time (kernels/cpu_gguf_x8.cpp)  # the decode / verification passes (<= 16 rows) take the kernel in any case


def use_kernel(qtype: int, rows: int) -> bool:
    """True where the int-dot kernel is the faster way to multiply `rows` activation rows by a `qtype` tensor.
    The x8 layout's kernel wins at every M measured (M = 512, 2048 x 2048, one thread: Q4_K 210 GOP/s, Q6_K 110,
    against 89 for dequantize + fp32 F.linear and 69 / 59 for the per-row kernel)."""
    if qtype >= X8:
        return True
    names = {v: k for k, v in GGUF_NATIVE_TYPES.items()}
    return rows <= GGUF_KERNEL_MAX_ROWS.get(names.get(qtype, ""), _DEFAULT_MAX_ROWS)
