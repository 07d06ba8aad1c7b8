"""The KV cache interface (edgellm/cache.py): one class per format behind `KVCache(...)`, each writing and
attending as float64 attention over the K/V it was given (up to its format's rounding), `decode_spec()`
describing its storage for the fused C++ step, and the import layering around it."""
import ast
import math
from pathlib import Path

import pytest
import torch

import edgellm
from edgellm.cache import Float16KVCache, FloatKVCache, Int4KVCache, Int8KVCache, KVCache
from edgellm.config import ModelConfig
from edgellm.kernels.attention import reference_attention
from edgellm.kernels.kv_store import Int8KV
from edgellm.kv_calibration import KVCalibration

CFG = ModelConfig(arch="llama", vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                  head_dim=64)
CLASSES = {"fp": FloatKVCache, "f16": Float16KVCache, "int8": Int8KVCache, "int8:32": Int8KVCache, "int4": Int4KVCache,
           "int4:64": Int4KVCache}


def test_the_entry_point_makes_the_class_of_the_format():
    for fmt, cls in CLASSES.items():
        cache = KVCache(CFG, 8, torch.float32, "meta", kv_format=fmt)
        assert type(cache) is cls and isinstance(cache, KVCache)
        assert (cache.kind, cache.kv_format, cache.length, len(cache.layers)) == (fmt.split(":")[0], fmt, 0, 2)
        # the class made directly is the same cache
        direct = cls(CFG, 8, torch.float32, "meta", kv_format=fmt)
        assert direct.bytes_per_token == cache.bytes_per_token and direct.nbytes == cache.nbytes
    assert type(KVCache(CFG, 8, torch.float32, "meta")) is FloatKVCache  # the default format
    assert Int4KVCache(CFG, 8, torch.float32, "meta").kv_format == "int4"  # a class defaults to its own
    with pytest.raises(ValueError, match="int8"):
        Int4KVCache(CFG, 8, torch.float32, "meta", kv_format="int8")
    with pytest.raises(ValueError, match="int4:48"):
        KVCache(CFG, 8, torch.float32, "meta", kv_format="int4:48")  # 48 does not divide the head dim
    with pytest.raises(ValueError, match="f16:32"):
        KVCache(CFG, 8, torch.float32, "meta", kv_format="f16:32")  # a float cache has no groups


def test_truncate_and_reset():
    cache = KVCache(CFG, 8, torch.float32, "cpu", kv_format="int8")
    cache.length = 6
    cache.truncate(6)
    cache.truncate(2)
    assert cache.length == 2
    with pytest.raises(ValueError):
        cache.truncate(3)  # past what it holds
    cache.reset()
    assert cache.length == 0


def calibration(k: torch.Tensor, v: torch.Tensor, g: torch.Generator) -> KVCalibration:
    """Centres: the mean K and V (as kv_calibration.py measures them); key scales: random, around 1."""
    centers = torch.stack((k.mean(1, keepdim=True), v.mean(1, keepdim=True))).expand(CFG.n_layers, -1, -1, -1, -1)
    scales = torch.exp(0.5 * torch.randn(CFG.n_layers, CFG.n_kv_heads, 1, CFG.head_dim, generator=g))
    return KVCalibration(centers, scales)


# relative error of the attention output against float64 over the unrounded K/V: the format's rounding only
# (measured: fp ~6e-7, int8 <0.02, int4 <0.2, int4:64 <0.28); a wrong rotation, centre or scale is O(1)
@pytest.mark.parametrize("fmt,tol", [("fp", 1e-5), ("int8", 0.03), ("int4", 0.3), ("int4:64", 0.4)])
@pytest.mark.parametrize("calibrated", [False, True])
def test_write_then_attend_is_attention_over_what_was_written(fmt, tol, calibrated):
    """Two writes (a prefill chunk, then more), then prefill rows, a decode row and a sliding-window row read the
    cache: each equals float64 attention over the K/V as given. A calibrated quantized cache stores them centred,
    scaled and rotated, which must leave attention unchanged (only the rounding moves)."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(CFG, 48, torch.float32, "cpu", kv_format=fmt)
    Hq, Hkv, D, T = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, 40
    k = torch.randn(Hkv, T, D, generator=g) + 3 * torch.randn(Hkv, 1, D, generator=g)  # an offset per channel
    v = torch.randn(Hkv, T, D, generator=g)
    q = torch.randn(1, Hq, T, D, generator=g)
    if calibrated:
        cache.set_calibration(calibration(k, v, g))
    scale = 1 / math.sqrt(D)
    layer = 1
    cache.write(layer, k[:, :30], v[:, :30], 0)
    cache.write(layer, k[:, 30:], v[:, 30:], 30)
    cache.length = T
    for start, n in ((0, 30), (30, 9), (39, 1)):
        out = cache.attend(layer, q[:, :, start:start + n], start, scale)
        want = reference_attention(q[:, :, start:start + n], k, v, start + n, start, scale)
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < tol, (start, n, err)
    # a sliding window of 8 positions for the last row: the reference over those positions only
    out = cache.attend(layer, q[:, :, 39:], 39, scale, window=8)
    want = reference_attention(q[:, :, 39:], k[:, 32:], v[:, 32:], 8, 7, scale)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_f16_cache_is_attention_over_the_rounded_values(dtype):
    """The f16 cache stores K/V rounded to float16 (nearest even) and attends over them in the compute dtype: the
    same checks as above against float64 attention over K/V rounded to float16 first, to the compute dtype's own
    rounding; and against the unrounded K/V only to float16's (so the rounding really happens)."""
    g = torch.Generator().manual_seed(1)
    cache = KVCache(CFG, 48, dtype, "cpu", kv_format="f16")
    assert all(t.dtype == torch.float16 for store in cache.layers for t in store)
    Hq, Hkv, D, T = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, 40
    k = (torch.randn(Hkv, T, D, generator=g) * 4).to(dtype)
    v = torch.randn(Hkv, T, D, generator=g).to(dtype)
    q = torch.randn(1, Hq, T, D, generator=g).to(dtype)
    kr, vr = k.half().double(), v.half().double()
    cache.write(0, k[:, :30], v[:, :30], 0)
    cache.write(0, k[:, 30:], v[:, 30:], 30)
    cache.length = T
    tol = 1e-5 if dtype == torch.float32 else 1e-6  # (float64: one decode row's tiles are read in fp32 on the CPU)
    for start, n, window in ((0, 30, 0), (30, 9, 0), (39, 1, 0), (30, 9, 8), (39, 1, 8)):
        out = cache.attend(0, q[:, :, start:start + n], start, 0.125, window=window)
        assert out.dtype == dtype
        if window:  # row by row: each sees its own last `window` positions
            want = torch.cat([reference_attention(q[:, :, t:t + 1].double(), kr[:, t + 1 - window:t + 1],
                                                  vr[:, t + 1 - window:t + 1], window, window - 1, 0.125)
                              for t in range(start, start + n)], dim=2)
        else:
            want = reference_attention(q[:, :, start:start + n].double(), kr, vr, start + n, start, 0.125)
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < tol, (start, n, window, err)
        unrounded = reference_attention(q[:, :, start:start + n].double(), k.double(), v.double(), start + n, start,
                                        0.125) if not window else None
        if unrounded is not None:
            assert 1e-6 < ((out.double() - unrounded).norm() / unrounded.norm()).item() < 3e-3


def test_decode_spec_hands_over_the_storage_itself():
    """What the fused C++ step reads is the cache's own tensors (it writes K/V through them), with the layout it
    takes: fp32 K/V; codes with fp16 scales (+ mins for int4), the groups, and fp32 sink rows."""
    fp = KVCache(CFG, 16, torch.float32, "cpu")
    spec = fp.decode_spec()
    assert len(spec) == CFG.n_layers
    assert all(sk is store.k and sv is store.v for (sk, sv), store in zip(spec, fp.layers))
    for fmt, bits, groups in (("int8", 8, (64, 64)), ("int4", 4, (16, 32)), ("int4:64", 4, (64, 64))):
        cache = KVCache(CFG, 16, torch.float32, "cpu", kv_format=fmt)
        for (ks, vs), store in zip(cache.decode_spec(), cache.layers):
            assert (ks[0], vs[0], ks[1], vs[1]) == (bits, bits, *groups)
            assert ks[2] is store.k and ks[3] is store.k_scale and ks[5] is store.k_sink
            assert vs[2] is store.v and vs[3] is store.v_scale and vs[5] is store.v_sink
            assert ks[3].dtype == torch.float16 and ks[5].dtype == torch.float32
            if bits == 4:
                assert ks[4] is store.k_min and vs[4] is store.v_min
            else:
                assert ks[4] is None and vs[4] is None
    f16 = KVCache(CFG, 16, torch.float32, "cpu", kv_format="f16")
    assert all(sk is store.k and sv is store.v and sk.dtype == torch.float16
               for (sk, sv), store in zip(f16.decode_spec(), f16.layers))
    # layouts the C++ step does not read
    assert KVCache(CFG, 16, torch.bfloat16, "cpu").decode_spec() is None
    assert KVCache(CFG, 16, torch.float32, "meta", kv_format="int4").decode_spec() is None
    cache = KVCache(CFG, 16, torch.float32, "cpu", kv_format="int8")
    cache.layers = [Int8KV(s.k, s.k_scale.float(), s.v, s.v_scale.float(), s.group) for s in cache.layers]
    assert cache.decode_spec() is None


def imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in a file, function-local ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
        elif isinstance(node, ast.Import):
            out.extend((0, a.name) for a in node.names)
    return out


def test_imports_point_one_way():
    """kernels/ imports nothing of edgellm outside kernels/ but edgellm.errors; the Triton kernel takes the stores
    from kv_store, not from attention.py (which imports it); the calibration imports no cache (the cache imports
    it)."""
    kernels = Path(edgellm.kernels.__file__).parent
    for f in kernels.glob("*.py"):
        for level, mod in imports(f):
            if level >= 2 or mod.startswith("edgellm"):
                assert mod in ("errors", "edgellm.errors") or mod.startswith("edgellm.kernels"), (f.name, mod)
    assert (1, "attention") not in imports(kernels / "triton_attention.py")
    pkg = Path(edgellm.__file__).parent
    assert not any(mod == "cache" or mod.endswith(".cache") for _, mod in imports(pkg / "kv_calibration.py"))


def test_large_cpu_stores_are_zero_and_resident_only_where_written():
    """kv_store.zeros: a large CPU store reads as zeros, keeps what is written, and costs resident memory only for
    the pages written (an anonymous mapping), where torch.zeros would make all of it resident at once."""
    import psutil

    from edgellm.kernels.kv_store import FloatKV, zeros

    proc = psutil.Process()
    before = proc.memory_info().rss
    t = zeros((8, 4096, 2048), torch.float32)  # 256 MiB
    assert proc.memory_info().rss - before < 32 << 20
    assert t.shape == (8, 4096, 2048) and t.dtype == torch.float32
    assert not t[:, ::512].any() and not t[-1, -1].any()
    t[:, :1024] = 1.5  # a quarter of the positions
    grown = proc.memory_info().rss - before
    assert (64 - 16) << 20 < grown < (64 + 32) << 20, grown
    assert bool((t[:, :1024] == 1.5).all()) and not t[:, 1024:].any()
    small = zeros((4, 4), torch.int8)  # small stores are ordinary tensors
    assert small.dtype == torch.int8 and not small.any()
    kv = FloatKV.empty(2, 8192, 64)  # 4 MiB each: mapped
    kv.k[0, 0] = 2.0
    assert kv.k[0, 0].eq(2.0).all() and not kv.v.any()
    before = proc.memory_info().rss
    layers = [FloatKV.empty(3, 2560, 64, torch.float16) for _ in range(30)]  # SmolLM2-135M's: 960 KiB a store
    assert proc.memory_info().rss - before < 16 << 20, "small models' stores are mapped too (56 MiB in all)"
    assert not any(kv.k.any() or kv.v.any() for kv in layers)
