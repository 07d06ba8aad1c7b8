"""Linear and embedding modules over GGUF blocks as stored (`--weights auto` on a quantized GGUF).

A GGUFLinear holds one or more *parts*: raw blocks of one GGUF tensor each (a fused Q/K/V may be Q4_K + Q4_K +
Q6_K in a Q4_K_M file), usually read-only views of the memory-mapped file, so the weights are used in place
with no second copy. Where the source rows are stored in another order than ours (llama.cpp permutes Q/K rows
for RoPE), `out_index` says which output column each stored row feeds: the rows are never moved.

On a CPU whose kernel build has them (AVX2), K-quant, Q5_0 and Q5_1 parts are repacked at load into the x8 layout
(kernels/cpu_gguf_x8.cpp): the same bytes, 8 rows interleaved so that the integer dots need no horizontal sums,
which makes decode memory-bound rather than compute-bound (llama.cpp repacks its Q4_K likewise). A part's last
rows % 8 stay as stored, or for Q5_0 / Q5_1 take the r8 layout (kernels/cpu_gguf.cpp): each row's runs of 8 blocks
regrouped so that their fifth bits cost three vector operations a block instead of five. The mapped pages of the
original are then dropped from RSS, so the process still holds one copy.

How the product is computed:
  CPU with the C++ kernels (kernels/cpu_gguf.cpp, x rounded to int8 per 32 values; kernels/gguf_ops.py chooses):
      decode and verification (<= 16 rows) take the row kernel, longer prompts the int8 panel GEMM ("prompt
      GEMM") where it is vectorized (AVX2, AVX-512 VNNI); builds without it keep the row kernel up to a measured
      number of rows per type and dequantize this layer into a float buffer for longer prompts.
  CUDA with Triton, the types kernels/triton_gguf.py has (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL,
      IQ4_XS): up to 16 rows of x (decode, verification) multiplied by the blocks in place, dequantized in
      registers; longer prompts dequantize this layer with its kernel (bit for bit gguf.quants) into a float buffer
      for the GEMM.
  Anywhere else (MPS, other CUDA types, CPU without the extension): this layer's blocks are dequantized on the
      device for the call (quant/gguf_tensor.py, bit for bit gguf.quants) and multiplied in the compute dtype: one
      layer's float weight exists at a time, never the whole model's.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import early_repack
from ..gguf_file import GGML_BLOCKS, row_bytes
from ..kernels import matmul as K
from ..kernels import gguf_ops
from ..kernels.cpu_ext import build_id
from ..kernels.gguf_ops import L4, R8, X8  # a type id + X8 / R8 / L4: repacked for the CPU kernels (cpu_gguf.h)
from . import gguf_grid
from .gguf_tensor import dequantize_blocks
from .linear import _move_packed

__all__ = ["GGUFPart", "GGUFLinear", "GGUFEmbedding", "raw_tensor", "install_gguf", "weight_formats", "repack_for_cpu"]

# the x8 layout's unit per base type: (values, bytes of 8 rows x those values)
X8_UNITS = {10: (256, 672), 11: (256, 912), 12: (256, 1184), 13: (256, 1440), 14: (256, 1680),  # Q2_K .. Q6_K
            23: (256, 1104), 6: (32, 176), 7: (32, 192), 20: (32, 144)}  # IQ4_XS, Q5_0, Q5_1, IQ4_NL
X8_UNITS.update({L4 + t: X8_UNITS[23] for t in (16, 18, 21, 19)})  # the L4 types (IQ4_XS's layout)
X8_UNITS.update({L4 + t: (256, 1168) for t in (17, 22, 29)})  # IQ2_XS / IQ2_S / IQ1_M's L4 per 16 (a scale per 16)
L4_BLOCK_BYTES = {17: 146, 22: 146, 29: 146}  # an L4 type's bytes per 256 values where not IQ4_XS's 136


def part_row_bytes(type_id: int, k: int) -> int:
    """Bytes per row of a part: a GGUF type's (r8 types: the same), or an x8 type's (one eighth of its 8-row groups)."""
    if X8 <= type_id < R8:
        values, group_bytes = X8_UNITS[type_id - X8]
        return k // values * group_bytes // 8
    if L4 < type_id < X8:
        return k // 256 * L4_BLOCK_BYTES.get(type_id - L4, 136)  # IQ4_XS-shaped blocks
    return row_bytes(stored_type(type_id), k)


def stored_type(type_id: int) -> int:
    """The GGUF type a part's blocks are (an x8, r8 or l4 part: the type it was repacked from)."""
    if type_id >= R8:
        type_id -= R8
    elif type_id >= X8:
        type_id -= X8
    return type_id - L4 if type_id > L4 else type_id


@dataclass
class GGUFPart:
    raw: torch.Tensor  # uint8 [rows, row_bytes]
    type: int  # gguf.GGMLQuantizationType value
    rows: int
    out_index: torch.Tensor | None = None  # int32 [rows]: output column of each stored row; None = in order


def raw_tensor(data, rows: int, type_id: int, k: int) -> torch.Tensor:
    """A uint8 [rows, row_bytes] view of GGUF blocks (a numpy view of the memory-mapped file: no copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mmap is read-only; nothing here writes to it
        t = torch.from_numpy(data) if not isinstance(data, torch.Tensor) else data
    return t.reshape(rows, row_bytes(type_id, k))


class _GGUFWeight(nn.Module):
    """The parts as buffers (so .to(device) moves them; dtype conversions leave uint8 alone)."""

    def _init_parts(self, parts: list[GGUFPart], in_features: int) -> None:
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.part_types = [int(p.type) for p in parts]
        self.part_rows = [int(p.rows) for p in parts]
        for i, p in enumerate(parts):
            if tuple(p.raw.shape) != (p.rows, part_row_bytes(p.type, in_features)) or p.raw.dtype != torch.uint8:
                raise ValueError(f"GGUF part {i}: expected uint8 [{p.rows}, {part_row_bytes(p.type, in_features)}], "
                                 f"got {p.raw.dtype} {list(p.raw.shape)}")
            self.register_buffer(f"raw{i}", p.raw)
            self.register_buffer(f"index{i}", p.out_index)

    @property
    def gguf_parts(self) -> list[GGUFPart]:
        return [GGUFPart(getattr(self, f"raw{i}"), t, r, getattr(self, f"index{i}"))
                for i, (t, r) in enumerate(zip(self.part_types, self.part_rows))]

    def _apply(self, fn, recurse: bool = True):
        # the blocks keep their dtype whatever the conversion; a tied embedding / LM head stays one table
        raws = {n: self._buffers.pop(n) for n in list(self._buffers) if n.startswith("raw")}
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in raws.items():
                self._buffers[n] = _move_packed(t, fn)
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] in our row order (for prefill GEMMs, self-drafts and exports)."""
        parts = self.gguf_parts
        TG, tparts = _triton_parts(parts, self.in_features)
        if TG is not None:  # one kernel launch a part, each row written to its output position
            try:
                return TG.gguf_dequantize(tparts, self.in_features, dtype)
            except TG.KernelFailed as e:
                _triton_failed(e)
        device = parts[0].raw.device
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
        start = 0
        for p in parts:
            w = _dequantize(p, self.in_features, dtype)
            if p.out_index is None:
                out[start:start + p.rows] = w
            else:
                out.index_copy_(0, p.out_index.long(), w)
            start += p.rows
        return out

    @property
    def weight_nbytes(self) -> int:
        return sum(p.raw.numel() for p in self.gguf_parts)

    def type_names(self) -> list[str]:
        return [GGML_BLOCKS[stored_type(t)][0] for t in self.part_types]

    def _fmt(self) -> str:
        return "+".join(dict.fromkeys(self.type_names()))


# On CUDA, GGUF types kernels/triton_gguf.py takes are multiplied there: decode / verification rows in place, longer
# prompts through its dequantization (bit for bit gguf.quants'). False: every product dequantizes through torch ops
# (quant/gguf_tensor.py), the A/B baseline (benchmarks/cuda_gguf.sh sets EDGELLM_GGUF_TRITON=0).
TRITON_GGUF = os.environ.get("EDGELLM_GGUF_TRITON", "1") != "0"


def triton_gguf(device: torch.device):
    """kernels/triton_gguf.py where it serves tensors on `device` (CUDA with Triton; see TRITON_GGUF), else None."""
    if not TRITON_GGUF or device.type != "cuda":
        return None
    from ..kernels.attention import triton_available

    if not triton_available():
        return None
    from ..kernels import triton_gguf as TG

    return TG


def _triton_parts(parts: list[GGUFPart], k: int):
    """(the Triton module, the parts as its tuples) where it takes every part of this weight, else (None, None)."""
    TG = triton_gguf(parts[0].raw.device)
    if TG is None or not all(TG.supports(p.type, k) for p in parts):
        return None, None
    return TG, [(p.raw, p.type, p.rows, p.out_index) for p in parts]


def _triton_failed(e: Exception) -> None:
    warnings.warn(f"{e}; that type is dequantized by torch ops instead (slower)", RuntimeWarning, stacklevel=3)


def _dequantize(p: GGUFPart, k: int, dtype: torch.dtype) -> torch.Tensor:
    TG, tparts = _triton_parts([GGUFPart(p.raw, p.type, p.rows)], k)
    if TG is not None:
        try:
            return TG.gguf_dequantize(tparts, k, dtype)
        except TG.KernelFailed as e:  # (the type is out of TG.supports now)
            _triton_failed(e)
    ext = K.cpu_extension() if p.raw.device.type == "cpu" else None
    if ext is not None and hasattr(ext, "gguf_dequantize") and p.type in _native_types(ext):
        return ext.gguf_dequantize(p.raw, p.type, p.rows, k, None).to(dtype)
    if stored_type(p.type) != p.type:
        raise RuntimeError("these GGUF blocks were repacked for the CPU kernels (x8 / r8 / l4 layout), which are not "
                           "loaded now: load the model again for this device or without the C++ kernels")
    return dequantize_blocks(p.raw, p.type, (p.rows, k), dtype)


_native: dict[int, frozenset[int]] = {}


def _native_types(ext) -> frozenset[int]:
    key = id(ext)
    if key not in _native:
        types = {int(t) for t in ext.gguf_types()} if hasattr(ext, "gguf_types") else set()
        types |= {int(t) + X8 for t in getattr(ext, "gguf_x8_types", list)()}
        types |= {int(t) + R8 for t in getattr(ext, "gguf_r8_types", list)()}
        types |= {int(t) + L4 for t in getattr(ext, "gguf_l4_types", list)()}
        _native[key] = frozenset(types)
    return _native[key]


_prompt_fast: dict[int, bool] = {}


def _prompt_gemm_fast(ext) -> bool:
    """Whether this extension has a vectorized prompt GEMM (kernels/gguf_ops.py: then it takes the long prompts)."""
    key = id(ext)
    if key not in _prompt_fast:
        _prompt_fast[key] = hasattr(ext, "gguf_linear_prompt") and bool(ext.gguf_prompt_gemm_fast())
    return _prompt_fast[key]


class GGUFLinear(_GGUFWeight):
    """y = x @ W.T (+ b), W held as GGUF blocks (one or more parts stacked along the output dim)."""

    def __init__(self, parts: list[GGUFPart], in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self._init_parts(parts, in_features)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not fit {self.out_features} outputs")
        self.register_buffer("bias", bias)

    def method(self, x: torch.Tensor) -> str:
        """How forward multiplies x: "rows", "prompt", "amx" or "dequantize" (see gguf_ops.method), on CUDA "triton"
        (kernels/triton_gguf.gguf_rows) or "dequantize"."""
        return self._method(x.reshape(-1, self.in_features))[0]

    def _method(self, x2: torch.Tensor) -> tuple[str, object]:
        """(how, the extension or the Triton module) for this product: see gguf_ops.method; "dequantize" where neither
        takes it (another device, no extension, a type without a kernel, a prompt longer than triton_gguf's rows)."""
        TG = triton_gguf(x2.device)
        if TG is not None and all(TG.supports(t, self.in_features) for t in self.part_types):
            return ("triton", TG) if x2.shape[0] <= TG.MAX_ROWS else ("dequantize", None)
        if x2.device.type != "cpu":
            return "dequantize", None
        ext = K.cpu_extension()
        if ext is None or not hasattr(ext, "gguf_linear"):
            return "dequantize", None
        if any(t not in _native_types(ext) for t in self.part_types):
            return "dequantize", None
        return gguf_ops.method(self.part_types, x2.shape[0], _prompt_gemm_fast(ext), K.amx_kernels(ext)), ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        how, ext = self._method(x2)
        if how in ("triton", "rows", "prompt", "amx"):
            parts = [(p.raw, p.type, p.rows, p.out_index) for p in self.gguf_parts]
            if how == "triton":
                try:
                    out = ext.gguf_rows(x2, parts, self.out_features)
                except ext.KernelFailed as e:
                    _triton_failed(e)
                    return self.forward(x)  # its type is no longer the kernel's: the torch-ops path
            else:
                fn = {"rows": ext.gguf_linear, "prompt": ext.gguf_linear_prompt, "amx": ext.gguf_linear_amx}[how]
                xin = x2 if how == "amx" and x2.dtype == torch.bfloat16 else x2.float()
                out = fn(xin.contiguous(), parts, self.out_features).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x2, self.dequantized_weight(x.dtype), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, gguf {self._fmt()}, "
                f"bias={self.bias is not None}")


class GGUFEmbedding(_GGUFWeight):
    """nn.Embedding over a GGUF table: only the looked-up rows are dequantized."""

    def __init__(self, part: GGUFPart, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        if part.out_index is not None:
            raise ValueError("an embedding table is stored in token order")
        self._init_parts([part], dim)
        self.num_embeddings, self.embedding_dim = part.rows, dim
        self.dtype = dtype

    def _apply(self, fn, recurse: bool = True):
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype  # output dtype follows .half() / .to(dtype)
        return super()._apply(fn, recurse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.raw0.index_select(0, flat)
        w = dequantize_blocks(rows, self.part_types[0], (flat.numel(), self.embedding_dim), self.dtype)
        return w.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, gguf {self._fmt()}"


# How repack_for_cpu lays out Q5_0 / Q5_1 parts (benchmarks' A/B switch): "x8" (8 rows interleaved, the rows % 8
# left over in r8), "r8" (each row's runs of 8 blocks regrouped), or "stored".
Q5_LAYOUT = "x8"
# How repack_for_cpu lays out IQ4_NL parts (A/B switch): "x8" or "stored".
IQ4_NL_LAYOUT = "x8"
# How repack_for_cpu lays out IQ2_XXS / IQ3_XXS / IQ3_S parts (A/B switch): "l4" (recoded as IQ4_XS blocks over the
# type's levels) or "stored" (multiplied through the grids). IQ1_S, IQ1_M, IQ2_XS and IQ2_S, which have no kernel as
# stored, take their L4 forms where it is on (the IQ1 types kept as blocks for it: `cpu_recoded_types`); else the IQ1
# types take the loader's Q6_K form of their values, and IQ2_XS / IQ2_S parts are dequantized per call
# (quant/gguf_tensor.py).
GRID_LAYOUT = "l4"


def cpu_recoded_types(device: torch.device) -> frozenset[str]:
    """The GGUF types without a kernel as stored that the CPU loader keeps as their blocks, to be recoded as L4 by
    repack_for_cpu (IQ1_S: 4.25 bits a weight, IQ1_M: 4.56, their values bit for bit, where their Q6_K form takes
    6.56): on the CPU with the extension's recoding and GRID_LAYOUT "l4"; none elsewhere (IQ2_XS / IQ2_S, also
    listed, are kept as blocks everywhere)."""
    ext = K.cpu_extension() if device.type == "cpu" and GRID_LAYOUT == "l4" else None
    if ext is None:
        return frozenset()
    native = set(gguf_ops.GGUF_NATIVE_TYPES.values())
    return frozenset(GGML_BLOCKS[t][0] for t in getattr(ext, "gguf_l4_types", list)() if t not in native)


def _repack_part(ext, p: GGUFPart, k: int, x8_types: set[int], r8_types: set[int],
                 l4_types: set[int]) -> list[GGUFPart]:
    """One part as the CPU kernels multiply it fastest: a grid i-quant's rows recoded (l4: 4.25 / 4.56 bits a weight,
    ~3x faster than its grid lookups); else its first rows // 8 * 8 rows in the x8 layout where there is one for its
    type, the others (Q5_0 / Q5_1) in the r8 layout, the rest as stored (with their out_index entries)."""
    index = p.out_index
    if p.type in l4_types:  # the grid i-quants: IQ4_XS blocks over their levels (the same values), rows 8 at a
        # time straight into the x8 layout where the build has it, the rest as L4
        n8 = p.rows // 8 * 8 if p.type + L4 in x8_types else 0
        out = []
        tables = gguf_grid.l4_tables(p.type)
        if n8:
            head = p.raw[:n8].contiguous()
            x8 = _made_early_or(ext, head, p.type, n8, k,
                                lambda: ext.gguf_to_l4(head, p.type, n8, k, x8=True, **tables))
            out.append(GGUFPart(x8, p.type + L4 + X8, n8, None if index is None else index[:n8].contiguous()))
        if n8 < p.rows:
            tail_index = index if index is None or not n8 else index[n8:].contiguous()
            out.append(GGUFPart(ext.gguf_to_l4(p.raw[n8:].contiguous(), p.type, p.rows - n8, k, **tables),
                                p.type + L4, p.rows - n8, tail_index))
        return out
    n8 = p.rows // 8 * 8 if p.type in x8_types and k % X8_UNITS[p.type][0] == 0 else 0
    out = []
    if n8:
        head = p.raw[:n8].contiguous()
        x8 = _made_early_or(ext, head, p.type, n8, k, lambda: ext.gguf_repack(head, p.type, n8, k))
        out.append(GGUFPart(x8, p.type + X8, n8, None if index is None else index[:n8].contiguous()))
    if n8 < p.rows:
        tail, rows = p.raw[n8:], p.rows - n8
        tail_index = index if index is None or not n8 else index[n8:].contiguous()
        if p.type in r8_types and k >= 256:
            out.append(GGUFPart(ext.gguf_repack_r8(tail.contiguous(), p.type, rows, k), p.type + R8, rows, tail_index))
        else:
            out.append(GGUFPart(tail, p.type, rows, tail_index))
    return out


def _made_early_or(ext, head: torch.Tensor, type_id: int, rows: int, k: int,
                   make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The x8 rows `make()` would give, as the `edgellm` command's head start made them while torch was imported
    (edgellm/early_repack.py: the same bytes), or make()'s where it did not."""
    early = early_repack.take(build_id(ext), head.data_ptr(), type_id, rows, k)
    return torch.frombuffer(early, dtype=torch.uint8).view(rows, -1) if early is not None else make()


def repack_for_cpu(parts: list[GGUFPart], k: int,
                   release: Callable[[torch.Tensor], None] | None = None) -> list[GGUFPart]:
    """The parts in the layouts this CPU's kernel build multiplies fastest (see _repack_part; Q5_LAYOUT picks Q5_0 /
    Q5_1's). `release(raw)` is called on each original whose blocks were all copied into a repacked layout (the
    loader drops its mapped pages)."""
    ext = K.cpu_extension()
    x8_types = set(getattr(ext, "gguf_x8_types", list)()) if ext is not None else set()
    r8_types = set(getattr(ext, "gguf_r8_types", list)()) if ext is not None else set()
    if Q5_LAYOUT != "x8":
        x8_types -= {gguf_ops.GGUF_NATIVE_TYPES["Q5_0"], gguf_ops.GGUF_NATIVE_TYPES["Q5_1"]}
    if Q5_LAYOUT == "stored":
        r8_types = set()
    if IQ4_NL_LAYOUT != "x8":
        x8_types.discard(gguf_ops.GGUF_NATIVE_TYPES["IQ4_NL"])
    l4_types = set(getattr(ext, "gguf_l4_types", list)()) if ext is not None and GRID_LAYOUT == "l4" else set()
    out = []
    for p in parts:
        if p.raw.device.type != "cpu":
            out.append(p)
            continue
        repacked = _repack_part(ext, p, k, x8_types, r8_types, l4_types)
        out.extend(repacked)
        copied = p.rows - sum(q.rows for q in repacked if q.type == p.type)  # the rows before a stored tail
        if release is not None and copied and p.raw.is_contiguous():
            release(p.raw[:copied])  # their mapped blocks need not stay resident (a stored tail's stay mapped)
    return out


def install_gguf(model: nn.Module, parts: dict[str, list[GGUFPart]], state: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
    """Swap GGUFLinear / GGUFEmbedding modules in for the parameters kept as GGUF blocks (taking their
    biases out of `state`, and each entry out of `parts` as it is installed: blocks the loader made in memory, a type
    rewritten at load, are freed once repacked, not held to the end of the load). A tied LM head multiplies the
    embedding's own blocks (on a CPU with the x8 kernels, a repacked copy of them: the embedding's lookups read the
    mapped file, a row at a time). `release(raw)`: the loader's hook for blocks copied into the x8 layout."""
    tied = model.config.tie_embeddings and "tok_embeddings.weight" in parts
    while parts:
        name, ps = parts.popitem()
        module_name = name.rsplit(".", 1)[0]
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        ps = [GGUFPart(p.raw.to(device), p.type, p.rows, None if p.out_index is None else p.out_index.to(device))
              for p in ps]
        if isinstance(old, nn.Embedding):
            new: nn.Module = GGUFEmbedding(ps[0], old.embedding_dim, dtype)
        else:
            bias = state.pop(module_name + ".bias", None)
            if device.type == "cpu":
                ps = repack_for_cpu(ps, old.in_features, release)
            new = GGUFLinear(ps, old.in_features, bias)
        setattr(parent, attr, new)
    if tied:
        ps, dim = model.tok_embeddings.gguf_parts, model.tok_embeddings.embedding_dim
        if device.type == "cpu":
            ps = repack_for_cpu(ps, dim, release)
        model.output = GGUFLinear(ps, dim)
        state.pop("output.weight", None)


# our packed formats that are GGUF types byte for byte (quant/groups.py)
GGUF_NAME_OF = {"int4-g32-asym": "Q4_1", "int4-g32-sym": "Q4_0", "int8-g32-sym": "Q8_0"}


def weight_formats(model: nn.Module) -> dict[str, int]:
    """What each weight matrix runs as: {format name: count}, e.g. {"Q4_K": 97, "Q6_K": 25, "f32": 1}
    (a tied embedding / LM head counts once per module)."""
    from .linear import QuantEmbedding, QuantLinear

    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, _GGUFWeight):
            names = m.type_names()
        elif isinstance(m, (QuantLinear, QuantEmbedding)):
            names = [GGUF_NAME_OF.get(m._fmt(), m._fmt())]
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            names = [str(m.weight.dtype).replace("torch.float", "f").replace("torch.bfloat", "bf")]
        else:
            continue
        for n in names:
            out[n] = out.get(n, 0) + 1
    return out
