"""The int4 nibble layouts, in one place: two 4-bit codes (0..15) per byte, and which two.

- Split halves (`pack_halves` / `unpack_halves`): byte j of a row of D codes holds code j in its low nibble and
  code j + D/2 in its high nibble. The KV cache's int4 rows (kernels/kv_quant.py): unpacking is two whole-half
  operations with no interleave, and the Triton kernel dots q's two halves against the two nibble planes.
- GGUF Q4 blocks (`pack_q4_blocks` / `unpack_q4_blocks`): split halves inside each block of 32 codes along the
  row, as GGUF Q4_0 / Q4_1 store them: byte j of block b holds codes 32b + j and 32b + j + 16. Our int4
  weights (quant/groups.py, kernels/matmul.py, the C++ kernels), so a GGUF Q4 tensor maps onto them byte for
  byte; GGUF's K-quants and Q5 types use the same halves within their own runs (quant/gguf_tensor.py).

(torch's tinygemm wants a third order, even k in the high nibble: matmul.pack_int4_tinygemm builds it from
the codes.)
"""
from __future__ import annotations

import torch

Q4_BLOCK = 32  # codes per GGUF Q4_0 / Q4_1 block


def pack_halves(codes: torch.Tensor) -> torch.Tensor:
    """codes (integer dtype, 0..15) [..., D], D even → uint8 [..., D // 2]: byte j = code j | code j + D/2 << 4."""
    codes = codes.to(torch.uint8)
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_halves(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., H] → codes uint8 [..., 2H]: the low nibbles, then the high ones (inverse of pack_halves)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def pack_q4_blocks(codes: torch.Tensor) -> torch.Tensor:
    """codes (integer dtype, 0..15) [..., K], K % 32 == 0 → uint8 [..., K // 2] in GGUF Q4 block order."""
    k = codes.shape[-1]
    return pack_halves(codes.unflatten(-1, (k // Q4_BLOCK, Q4_BLOCK))).flatten(-2)


def unpack_q4_blocks(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] in GGUF Q4 block order → codes uint8 [..., K] (inverse of pack_q4_blocks)."""
    return unpack_halves(packed.unflatten(-1, (-1, Q4_BLOCK // 2))).flatten(-2)
