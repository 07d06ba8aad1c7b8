"""Quantized modules swapped in for nn.Linear / nn.Embedding (gpt-fast style module swap).

QuantLinear holds the packed weight as buffers (codes, scales, mins: see quant/groups.py) and calls
kernels.matmul. What it keeps beside them, per device (never in the state dict):
  CPU with the C++ kernel: nothing; tokens M <= 16 run the kernel, prefill dequantizes this layer's
      weight into the compute dtype for the call and uses the float GEMM.
  CPU without it: a dequantized copy of the weight in the compute dtype, made on first use (cost:
      4 bytes per weight in fp32, i.e. MORE memory than the float model alone; it keeps the default CPU
      path as fast as fp32 F.linear, where torch's CPU int kernels are 10-28x slower). `cache_dense=False`
      turns it off (dequantize per call instead: less memory, slower).
  CUDA / MPS: the weight repacked once for torch's int4 tinygemm / int8 kernel (`prepare`), the same
      size as the codes; shapes those kernels cannot take dequantize per call.
Moving or casting the module (`.to()`, `.cuda()`, `.half()`) drops what was kept; it is rebuilt lazily.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QuantizationError
from ..kernels import matmul as K
from .groups import QuantizedTensor, quantize

__all__ = ["QuantLinear", "QuantEmbedding", "quantize_linears"]


PACKED_BUFFERS = ("codes", "scales", "mins")
# id(old packed tensor) → (weak ref to it, its moved copy), while the old one lives: a tied embedding /
# LM head pair moved with .to(device) stays one table on the device instead of becoming two. (Keyed by
# id: tensors compare elementwise, so they cannot be dictionary keys.)
_moved: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    if _moved.get(key, (None,))[0] is ref:
        del _moved[key]


def _move_packed(t: torch.Tensor, fn) -> torch.Tensor:
    """Apply a module conversion to a packed tensor, keeping its dtype: `.half()` or `.to(bfloat16)`
    on the model must not touch the codes or the float16 scales (the format fixes their dtypes)."""
    device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
    if t.device == device:
        return t
    hit = _moved.get(id(t))
    if hit is not None and hit[0]() is t and hit[1].device == device:
        return hit[1]
    new = t.to(device)
    key = id(t)
    _moved[key] = (weakref.ref(t, lambda r, key=key: _forget(key, r)), new)
    return new


class _QuantWeight(nn.Module):
    """Shared buffers and bookkeeping of QuantLinear and QuantEmbedding."""

    def _apply(self, fn, recurse: bool = True):
        self.release()
        packed = {name: self._buffers.pop(name) for name in PACKED_BUFFERS}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in packed.items():
                self._buffers[name] = None if t is None else _move_packed(t, fn)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self.release()  # new codes: what was derived from the old ones is stale
        return super()._load_from_state_dict(*args, **kwargs)

    def release(self) -> None:
        pass

    def _init_format(self, qt: QuantizedTensor) -> None:
        self.bits, self.group_size, self.symmetric = qt.bits, qt.group_size, qt.symmetric
        self.out_features, self.in_features = qt.shape
        # the very tensors of `qt` (no copy): a tied embedding and LM head share one set
        self.register_buffer("codes", qt.codes)
        self.register_buffer("scales", qt.scales)
        self.register_buffer("mins", qt.mins)

    def qtensor(self) -> QuantizedTensor:
        """The packed weight, sharing this module's buffers."""
        return QuantizedTensor(self.bits, self.group_size, self.symmetric, (self.out_features, self.in_features),
                               self.codes, self.scales, self.mins)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qtensor().dequantize(dtype)

    @property
    def weight_nbytes(self) -> int:
        return self.qtensor().nbytes

    def _fmt(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        group = "channel" if self.group_size == self.in_features and self.bits == 8 else f"g{self.group_size}"
        return f"int{self.bits}-{group}-{kind}"


class QuantLinear(_QuantWeight):
    """y = x @ dequant(W).T + b with W stored as int8/int4 groups."""

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None, cache_dense: bool = True):
        super().__init__()
        self._init_format(qt)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise QuantizationError(f"bias of shape {tuple(bias.shape)} does not fit a weight of shape {qt.shape}")
        # a buffer, not a Parameter: inference only, and it loads/saves like the codes
        self.register_buffer("bias", bias)
        self.cache_dense = cache_dense
        self._dense: torch.Tensor | None = None
        self._pack: K.DevicePack | None = None
        self._packed_for: tuple | None = None
        self.kernel_options = K.DEFAULT_OPTIONS  # the CPU kernels' activations / prefill (set_kernel_options)

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> QuantLinear:
        return cls(qt, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, symmetric: bool = True,
                    search: bool = True) -> QuantLinear:
        with torch.no_grad():
            qt = quantize(linear.weight.detach(), bits, group_size, symmetric=symmetric, search=search)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qt, bias)

    # -- per-device state ---------------------------------------------------------------------------
    def release(self) -> None:
        """Drop the dense copy / device pack (they are rebuilt on the next call)."""
        self._dense, self._pack, self._packed_for = None, None, None

    def prepare(self, dtype: torch.dtype | None = None) -> None:
        """Build what the forward of this device needs, once: the CUDA/MPS pack, or the CPU dense copy
        when no CPU kernel is available. `dtype`: the compute dtype (default: the bias's, else fp32)."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        device = self.codes.device
        if self._packed_for == (device, dtype):
            return
        self.release()
        self._packed_for = (device, dtype)
        if device.type in ("cuda", "mps"):
            self._pack = K.pack_for_device(self.bits, self.codes, self.scales, self.mins, self.group_size, dtype)
        elif device.type == "cpu" and self.cache_dense and not K.has_cpu_kernel():
            self._dense = self.dequantized_weight(dtype)

    def method(self, x: torch.Tensor) -> str:
        """How forward multiplies x: kernels/matmul.cpu_method's names on the CPU ("amx", "prompt", "kernel",
        "dense"); elsewhere "packed" (torch's device kernel, where the pack takes x's rows) or "dense"."""
        if x.device.type == "cpu":
            return K.cpu_method(K.cpu_extension(), self.bits, x, self.group_size, self.kernel_options)
        if self._packed_for != (x.device, x.dtype):
            self.prepare(x.dtype)  # the pack forward would build
        return "packed" if K._use_pack(self._pack, x) else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_for != (x.device, x.dtype):
            self.prepare(x.dtype)
        if self.bits == 8:
            return K.int8_linear(x, self.codes, self.scales, self.group_size, self.bias,
                                 dense=self._dense, pack=self._pack, options=self.kernel_options)
        return K.int4_linear(x, self.codes, self.scales, self.mins, self.group_size, self.bias,
                             dense=self._dense, pack=self._pack, options=self.kernel_options)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self._fmt()}, "
                f"bias={self.bias is not None}")


class QuantEmbedding(_QuantWeight):
    """nn.Embedding over an int8/int4 table: only the looked-up rows are dequantized."""

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self._init_format(qt)
        self.num_embeddings, self.embedding_dim = qt.shape
        self.dtype = dtype

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> QuantEmbedding:
        return cls(qt, dtype)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, bits: int, group_size: int, symmetric: bool = True,
                       search: bool = True) -> QuantEmbedding:
        with torch.no_grad():
            qt = quantize(emb.weight.detach(), bits, group_size, symmetric=symmetric, search=search)
        return cls(qt, emb.weight.dtype)

    def _apply(self, fn, recurse: bool = True):
        # .half() / .to(dtype) convert float tensors; this module has none to convert (the scales keep
        # float16), so the output dtype follows the conversion by hand
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return super()._apply(fn, recurse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        codes, scales = self.codes.index_select(0, flat), self.scales.index_select(0, flat)
        if self.bits == 8:
            rows = K.dequantize_int8(codes, scales, self.group_size, self.dtype)
        else:
            mins = None if self.mins is None else self.mins.index_select(0, flat)
            rows = K.dequantize_int4(codes, scales, mins, self.group_size, self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._fmt()}"


# ------------------------------------------------------------------------------------------------
# Whole-model swap
# ------------------------------------------------------------------------------------------------
def quantize_linears(model: nn.Module, bits: int, group_size: int, symmetric: bool = True, search: bool = True,
                     skip: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Swap every nn.Linear of `model` (in place) for a QuantLinear, one at a time, dropping each float
    weight as it goes, so the float and quantized copies of the whole model never coexist.
    `skip(name, module)` → True keeps that linear float. A linear whose weight is shared with an
    nn.Embedding (tied LM head) is quantized once: the embedding becomes a QuantEmbedding over the same
    buffers. int8 is always symmetric; `group_size` for int8 may be 0 = per output channel."""
    tied = _embeddings_by_weight(model)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (skip is not None and skip(name, module)):
            continue
        group = group_size or module.in_features
        if bits == 4 and group_size == 0:
            raise QuantizationError("int4 needs a group size (32, 64 or 128)")
        new = QuantLinear.from_linear(module, bits, group, symmetric=bits == 8 or symmetric, search=search)
        for emb_name in tied.pop(id(module.weight), []):
            emb = model.get_submodule(emb_name)
            _set_submodule(model, emb_name, QuantEmbedding.from_quantized(new.qtensor(), dtype=emb.weight.dtype))
        _set_submodule(model, name, new)
        del module
    return model


def _embeddings_by_weight(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            out.setdefault(id(m.weight), []).append(name)
    return out


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def set_kernel_options(model: nn.Module, options: K.KernelOptions) -> None:
    """Give every QuantLinear of `model` the CPU kernels' settings (load_model does, from its options)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.kernel_options = options
