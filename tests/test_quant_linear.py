"""QuantLinear / QuantEmbedding / quantize_linears, and the kernels.matmul dispatch."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgellm.errors import QuantizationError
from edgellm.kernels import gguf_ops, matmul
from edgellm.quant.groups import quantize
from edgellm.quant.linear import QuantEmbedding, QuantLinear, quantize_linears

FORMATS = [(4, 32, True), (4, 64, True), (4, 128, True), (4, 32, False), (4, 64, False), (4, 128, False),
           (8, 32, True), (8, 64, True), (8, 128, True), (8, 0, True)]
IDS = [f"int{b}-g{g or 'chan'}-{'sym' if s else 'asym'}" for b, g, s in FORMATS]
MS = list(range(1, 17)) + [100]


FP32_PREFILL = matmul.KernelOptions(prefill_bf16=False)  # every dequantize + GEMM in fp32


@pytest.fixture
def float_path():
    """Run without the C++ CPU kernel; returns the kernel options without bf16 prefill GEMMs: the float path,
    exact to the dequantized reference."""
    saved = matmul.cpu_extension()
    matmul.set_cpu_extension(None)
    yield FP32_PREFILL
    matmul.set_cpu_extension(saved)


def test_bf16_prefill_gemm_close_and_only_for_many_rows():
    """On CPUs with native bf16 (or when asked), int4 linears of more than 16 rows (prefill) multiply in
    bf16: close to the fp32 reference, not equal to it; int8 linears, decode-size inputs and exact mode
    keep fp32."""
    bf16 = matmul.KernelOptions(prefill_kernel=False, prefill_bf16=True)
    lin = make_linear(n=64, k=256, bias=True)
    q = QuantLinear.from_linear(lin, 4, 32, symmetric=True, search=False)
    q.kernel_options = bf16
    w, b = q.dequantized_weight(), lin.bias.detach()
    x = torch.randn(40, 256)
    ref = F.linear(x.double(), w.double(), b.double())
    got = q(x)
    assert got.dtype == torch.float32 and rel_err(got, ref) < 1e-2
    assert rel_err(got, ref) > 1e-6  # bf16 really was used
    # int8 (the near-lossless format) keeps fp32 unless asked for bf16 too
    q8 = QuantLinear.from_linear(lin, 8, 32, symmetric=True, search=False)
    q8.kernel_options = bf16
    ref8 = F.linear(x.double(), q8.dequantized_weight().double(), b.double())
    assert rel_err(q8(x), ref8) < 1e-5
    q8.kernel_options = matmul.KernelOptions.from_names(prefill="bf16")
    assert 1e-6 < rel_err(q8(x), ref8) < 1e-2
    q.kernel_options = matmul.KernelOptions(activations="fp32", prefill_kernel=False, prefill_bf16=True)
    assert rel_err(q(x), ref) < 1e-5


def make_linear(n=37, k=256, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    return lin


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("bits,group,sym", FORMATS, ids=IDS)
@pytest.mark.parametrize("bias", [True, False])
def test_quant_linear_equals_dequantized_float_linear(float_path, bits, group, sym, bias):
    lin = make_linear(bias=bias)
    q = QuantLinear.from_linear(lin, bits, group or lin.in_features, symmetric=sym, search=True)
    q.kernel_options = float_path
    w = q.dequantized_weight()
    b = None if lin.bias is None else lin.bias.detach()
    for m in MS:
        x = torch.randn(m, lin.in_features)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert rel_err(q(x), ref) < 1e-5, m
    x3 = torch.randn(2, 3, lin.in_features)  # any leading dims
    assert q(x3).shape == (2, 3, lin.out_features)
    torch.testing.assert_close(q(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-6)


def test_cpu_kernel_path_close_to_float():
    """With the C++ kernel (int8-rounded activations, llama.cpp style) decode-size inputs stay close."""
    if matmul.cpu_extension() is None:
        pytest.skip("C++ CPU kernel not available")
    for bits, sym in ((4, True), (4, False), (8, True)):
        lin = make_linear(n=64, k=256, bias=True)
        q = QuantLinear.from_linear(lin, bits, 32, symmetric=sym)
        w = q.dequantized_weight()
        for m in (1, 7, 16):
            x = torch.randn(m, 256)
            assert rel_err(q(x), F.linear(x, w, lin.bias.detach())) < 2e-2


def test_dense_cache_follows_dtype_and_moves(float_path):
    lin = make_linear(n=16, k=64)
    q = QuantLinear.from_linear(lin, 4, 32, symmetric=False)
    x = torch.randn(3, 64)
    y = q(x)
    assert q._dense is not None and q._dense.dtype == torch.float32  # built once, on first use
    dense = q._dense
    q(x)
    assert q._dense is dense
    q = q.to(torch.bfloat16)  # the bias follows; the packed buffers keep their dtypes
    assert q._dense is None and q.bias.dtype == torch.bfloat16
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float16 and q.mins.dtype == torch.float16
    yb = q(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and q._dense.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=3e-2, atol=3e-2)
    q.cache_dense = False
    q.release()
    assert q(x.bfloat16()).dtype == torch.bfloat16 and q._dense is None


def test_from_linear_close_to_float(float_path):
    lin = make_linear(n=48, k=256)
    x = torch.randn(5, 256)
    for bits, bound in ((8, 1e-2), (4, 0.12)):  # measured 0.0045 and 0.075
        q = QuantLinear.from_linear(lin, bits, 32)
        assert rel_err(q(x), lin(x)) < bound
        assert torch.equal(q.bias, lin.bias.detach())


def test_state_dict_round_trip(float_path):
    q = QuantLinear.from_linear(make_linear(), 4, 64, symmetric=False)
    sd = q.state_dict()
    assert set(sd) == {"codes", "scales", "mins", "bias"}
    other = QuantLinear.from_linear(make_linear(seed=5), 4, 64, symmetric=False)
    x = torch.randn(2, 256)
    other(x)  # builds a dense cache that the load must invalidate
    other.load_state_dict(sd)
    assert torch.equal(other(x), q(x))


def test_from_quantized_shares_buffers_and_validates():
    qt = quantize(torch.randn(10, 64), 8, 32)
    lin = QuantLinear.from_quantized(qt)
    emb = QuantEmbedding.from_quantized(qt)
    assert lin.codes is qt.codes and emb.codes is qt.codes and lin.scales is emb.scales
    assert lin.qtensor().codes is qt.codes
    with pytest.raises(QuantizationError, match="bias"):
        QuantLinear.from_quantized(qt, bias=torch.zeros(3))


@pytest.mark.parametrize("bits,group,sym", [(8, 32, True), (8, 0, True), (4, 32, True), (4, 64, False)])
def test_quant_embedding_rows(bits, group, sym):
    table = torch.randn(50, 128) * 0.1
    qt = quantize(table, bits, group or 128, symmetric=sym)
    emb = QuantEmbedding.from_quantized(qt, dtype=torch.float32)
    ids = torch.tensor([[3, 0, 49, 3], [7, 7, 1, 2]])
    assert torch.equal(emb(ids), qt.dequantize()[ids])
    emb = emb.to(torch.bfloat16)
    assert emb(ids).dtype == torch.bfloat16 and emb.scales.dtype == torch.float16


class TiedToy(nn.Module):
    def __init__(self, vocab=40, dim=64, hidden=96):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        return self.output(h + self.down(F.silu(self.up(h))))


def test_quantize_linears_tied_model(float_path):
    torch.manual_seed(0)
    model = TiedToy()
    ids = torch.tensor([[1, 5, 9, 39]])
    ref = model(ids)
    quantize_linears(model, 8, 32, skip=lambda name, m: name == "down")
    assert isinstance(model.up, QuantLinear) and isinstance(model.output, QuantLinear)
    assert isinstance(model.down, nn.Linear)  # skipped
    assert isinstance(model.tok_embeddings, QuantEmbedding)
    assert model.tok_embeddings.codes is model.output.codes  # stored once
    assert [n for n, p in model.named_parameters()] == ["down.weight"]  # float weights dropped
    assert rel_err(model(ids), ref) < 5e-3
    # the second pass quantizes what the first skipped; a tied pair moved stays one table
    quantize_linears(model, 4, 32, symmetric=False)
    assert isinstance(model.down, QuantLinear) and model.down.bits == 4 and model.up.bits == 8
    model.to("meta")
    assert model.tok_embeddings.codes is model.output.codes and model.output.codes.device.type == "meta"


def test_quantize_linears_bad_settings():
    with pytest.raises(QuantizationError, match="group size"):
        quantize_linears(TiedToy(), 4, 0)
    with pytest.raises(QuantizationError, match="multiple"):
        quantize_linears(TiedToy(dim=64, hidden=80), 4, 64)


def test_kernel_functions_raw_tensors(float_path):
    """kernels.matmul on raw tensors: bias, output dtype, the dense= shortcut."""
    qt = quantize(torch.randn(24, 128) * 0.1, 4, 32, symmetric=False)
    x = torch.randn(4, 128, dtype=torch.float64)
    w = qt.dequantize(torch.float64)
    bias = torch.randn(24, dtype=torch.float64)
    y = matmul.int4_linear(x, qt.codes, qt.scales, qt.mins, 32, bias)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, F.linear(x, w, bias))
    y2 = matmul.int4_linear(x, qt.codes, qt.scales, qt.mins, 32, bias, dense=w)
    torch.testing.assert_close(y2, y)
    q8 = quantize(torch.randn(24, 128) * 0.1, 8, 128)
    y8 = matmul.int8_linear(x, q8.codes, q8.scales, 128)
    torch.testing.assert_close(y8, F.linear(x, q8.dequantize(torch.float64)))


def test_no_device_pack_on_cpu():
    qt = quantize(torch.randn(16, 128), 4, 32)
    assert matmul.pack_for_device(4, qt.codes, qt.scales, qt.mins, 32, torch.float32) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("bits,group,sym", FORMATS, ids=IDS)
def test_cuda_paths_match_reference(bits, group, sym):
    lin = make_linear(n=64, k=256)
    q = QuantLinear.from_linear(lin, bits, group or 256, symmetric=sym).cuda()
    w = q.dequantized_weight().double()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q.bias.data = q.bias.data.to(dtype)
        for m in (1, 5, 16, 100):
            x = torch.randn(m, 256, device="cuda", dtype=dtype)
            y = q(x)
            assert y.dtype == dtype
            ref = F.linear(x.double(), w, q.bias.double())
            # tinygemm works in bfloat16 (scales and zeros too): ~1e-2; the fallback is exact to the dtype
            assert rel_err(y, ref) < 2e-2, (dtype, m)
    packed = bits == 4 or group == 0
    assert (q._pack is not None) == packed


def test_prefill_rows_take_the_kernel_up_to_the_measured_crossover(monkeypatch):
    """In the default (auto) mode a prefill of up to PREFILL_KERNEL_MAX_M rows for this kernel build,
    activations variant and GEMM dtype runs in the C++ kernel: every row bit for bit what a one-token call
    gives, as decode computes it. More rows, a combination the table does not list, or an explicit
    `--prefill fp32` take dequantize + GEMM (fp32 there: exact to the dequantized weight). (The rules for builds
    without a vectorized int8 prompt GEMM, which otherwise takes every prefill: tests/test_quant_prompt_gemm.py.)"""
    ext = matmul.cpu_extension()
    if ext is None:
        pytest.skip("C++ CPU kernel not available")
    monkeypatch.setattr(matmul, "QUANT_PROMPT_GEMM", False)
    monkeypatch.setattr(gguf_ops, "AMX_GEMM", False)  # (AMX CPUs: the AMX kernel's own tests)
    monkeypatch.setattr(matmul, "PREFILL_KERNEL_MAX_M", {(ext.isa(), matmul.ACTIVATIONS["int8"], "fp32"): 48})
    auto_fp32 = FP32_PREFILL  # the auto mode, its GEMM in fp32 (as on a CPU without native bf16)
    lin = make_linear(n=64, k=256, bias=True)
    for bits, sym in ((4, False), (4, True), (8, True)):
        q = QuantLinear.from_linear(lin, bits, 32, symmetric=sym)
        q.kernel_options = auto_fp32
        ref = lambda x: F.linear(x.double(), q.dequantized_weight().double(), lin.bias.detach().double())
        x = torch.randn(48, 256)
        rows = torch.cat([q(x[i:i + 1]) for i in range(48)])
        assert torch.equal(q(x), rows), bits  # the kernel, as one-token decode steps compute it
        assert 1e-5 < rel_err(q(x), ref(x)) < 2e-2
        x = torch.randn(49, 256)
        assert rel_err(q(x), ref(x)) < 1e-5  # past the crossover: the fp32 GEMM
        x = torch.randn(40, 256)
        q.kernel_options = matmul.KernelOptions(activations="fp32", prefill_bf16=False)  # not in the table
        assert rel_err(q(x), ref(x)) < 1e-5
        q.kernel_options = matmul.KernelOptions.from_names(prefill="fp32")  # every prefill to the GEMM
        assert rel_err(q(x), ref(x)) < 1e-5
        q.kernel_options = auto_fp32
        assert torch.equal(q(x), torch.cat([q(x[i:i + 1]) for i in range(40)]))


def test_prefill_table_names_real_kernel_builds():
    """Every key of the prefill table is a kernel build `isa()` reports (kernels/cpu_kernels.cpp isa_name), an
    activations variant and a GEMM dtype, and every bound is at least the decode sizes (always the kernel)."""
    variants = set(matmul.ACTIVATIONS.values())
    for (isa, variant, gemm), rows in matmul.PREFILL_KERNEL_MAX_M.items():
        assert isa in ("avx512vnni", "avx2vnni", "avx2") and variant in variants and gemm in ("fp32", "bf16")
        assert rows >= matmul.CPU_KERNEL_MAX_M


def test_native_bf16_gemm_follows_the_cpu_flags():
    """The bf16 prefill GEMM is chosen where the CPU multiplies bf16 in hardware. On x86 that is the CPU's
    avx512_bf16 / amx_bf16 flags (/proc/cpuinfo, the kernel's reading of CPUID), not oneDNN's "bf16 supported",
    which is true on every AVX-512 CPU and sent an Ice Lake's prefills to an emulated GEMM 3.5x slower than fp32."""
    import platform
    from pathlib import Path

    matmul.native_bf16_gemm.cache_clear()
    got = matmul.native_bf16_gemm()
    cpuinfo = Path("/proc/cpuinfo")
    assert isinstance(got, bool)
    if platform.machine() == "x86_64" and cpuinfo.exists():
        flags = set(next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")).split(":")[1].split())
        assert got == bool({"avx512_bf16", "amx_bf16"} & flags)


@pytest.mark.parametrize("var", ["DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA"])
def test_native_bf16_gemm_is_off_where_onednn_is_capped_below_bf16(monkeypatch, var):
    """oneDNN capped at an ISA without bf16 instructions emulates the bf16 GEMM, whatever the CPU has."""
    for name in ("DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, "avx2")
    matmul.native_bf16_gemm.cache_clear()
    try:
        assert matmul.native_bf16_gemm() is False
        monkeypatch.setenv(var, "AVX512_CORE_BF16")  # a cap that keeps bf16: the CPU's flags decide again
        matmul.native_bf16_gemm.cache_clear()
        monkeypatch.delenv(var)
        expected = matmul.native_bf16_gemm()
        monkeypatch.setenv(var, "AVX512_CORE_BF16")
        matmul.native_bf16_gemm.cache_clear()
        assert matmul.native_bf16_gemm() == expected
    finally:
        monkeypatch.undo()
        matmul.native_bf16_gemm.cache_clear()
