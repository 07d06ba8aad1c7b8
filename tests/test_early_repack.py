"""The `edgellm` command's head start (edgellm/early_repack.py): a GGUF's K-quant matrices repacked into the x8 layout
by a plain C build of the extension's repack while torch is imported, then taken by the loader.

The x8 layout itself is checked against gguf.quants in tests/test_gguf_x8.py; here the claims are that the early
copies are the extension's bytes, that a model loaded with them computes bit for bit what one loaded without them
does, that the loader takes every one the command line foresaw (and nothing from another build), and that nothing
starts where the loader would not use it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm import early_repack
from edgellm.gguf_file import GGUFFile
from edgellm.kernels import cpu_ext
from edgellm.kernels.ext_cache import cache_root, repack_pointer
from edgellm.loading import load_model
from tests.fixtures.tiny import make_gguf, make_hf_model
from tests.test_cpu_kernels import ext  # noqa: F401  (the extension fixture, shared)
from tests.test_gguf_as_stored import IQ1_MIX, IQ2_MIX, IQ3_MIX, IQ4_MIX, K_MIX, LEGACY_MIX, LOW_MIX, SHAPE, _logits

# what the head start repacks: {type: values per block} (Q2_K .. Q6_K, IQ4_XS; Q5_0, Q5_1, IQ4_NL)
X8_BLOCK_VALUES = {10: 256, 11: 256, 12: 256, 13: 256, 14: 256, 23: 256, 6: 32, 7: 32, 20: 32}
L4 = 100  # a grid i-quant's L4 form: its type id + this (kernels/cpu_gguf.h GGUF_L4)


def early_kind(ext, type_id: int, k: int) -> str | None:
    """How the head start copies a matrix of this type on this build: "x8", "l4" (a grid i-quant recoded into its
    L4 form's x8 layout) or not at all."""
    x8_types = set(ext.gguf_x8_types())
    if type_id in X8_BLOCK_VALUES and type_id in x8_types and k % X8_BLOCK_VALUES[type_id] == 0:
        return "x8"
    if type_id in ext.gguf_l4_types() and type_id + L4 in x8_types and k % 256 == 0:
        return "l4"
    return None


def every_matrix(type_name: str, tied: bool = False) -> dict[str, str]:
    return {k: type_name for k in K_MIX if not (tied and k == "output.weight")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("early-repack")
    out = {}
    for name, variant, types in (("kmix", "llama_gqa", K_MIX), ("lowmix", "llama_gqa", LOW_MIX),
                                 ("iq4mix", "llama_gqa", IQ4_MIX), ("legacy", "llama_gqa", LEGACY_MIX),
                                 ("iq3mix", "llama_gqa", IQ3_MIX), ("iq2mix", "llama_gqa", IQ2_MIX),
                                 ("iq1mix", "llama_gqa", IQ1_MIX),
                                 ("tied", "llama_tied", {k: v for k, v in K_MIX.items() if k != "output.weight"}),
                                 ("q4_0", "llama_gqa", every_matrix("Q4_0")),  # Q/K rows permuted in the file
                                 ("q8_0", "llama_tied", every_matrix("Q8_0", tied=True)),
                                 ("q4_1", "qwen2_bias", every_matrix("Q4_1"))):  # (not permuted: qwen2)
        folder = make_hf_model(root / name, variant, seed=5, **SHAPE)
        out[name] = make_gguf(folder, root / f"{name}.gguf", quant_types=types, seed=11)
    return out


@pytest.fixture
def x8_ext(ext):  # noqa: F811
    if not set(X8_BLOCK_VALUES) & set(ext.gguf_x8_types()):
        pytest.skip(f"the {ext.isa()} build has no x8 layout (AVX2 and AVX-512 builds do): nothing to repack early")
    pointer = repack_pointer(cache_root(os.environ.get("EDGELLM_EXT_CACHE") or None), os.environ.get("EDGELLM_EXT_ISA"))
    if not pointer.exists():
        pytest.fail(f"the extension loaded but published no repack library ({pointer} missing): no C++ compiler?")
    return ext


@pytest.fixture(autouse=True)
def closed():
    yield
    early_repack.close()


def run_line(path, *extra: str) -> list[str]:
    return ["run", "hello", "-m", str(path), *extra]


def test_the_library_is_the_extensions_build(x8_ext):
    pointer = json.loads(repack_pointer(cache_root(os.environ.get("EDGELLM_EXT_CACHE") or None),
                                        os.environ.get("EDGELLM_EXT_ISA")).read_text())
    assert pointer["build"] == cpu_ext.build_id(x8_ext) == Path(pointer["library"]).parent.name
    assert pointer["torch"] == torch.__version__


# Each matrix in one job (these files' are far below CHUNK_BYTES), or cut into the smallest jobs: 8 rows (one x8
# group), one row, or one head's rows where they are unpermuted.
CHUNKS = [None, 1]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", ["kmix", "lowmix", "iq4mix", "legacy", "iq3mix", "iq2mix", "iq1mix"])
def test_early_copies_are_the_extensions_bytes(x8_ext, files, name, chunk, monkeypatch):
    """Every matrix of a type the build has an x8 layout for (and only those; the embedding only where it is the LM
    head too; its first rows // 8 * 8 rows) is copied, as ext.gguf_repack copies it; a grid i-quant's (IQ1_S ...
    IQ3_S) recoded as ext.gguf_to_l4(x8=True) recodes it, with the codebook the loader gives it."""
    from edgellm.quant.gguf_grid import l4_tables

    if chunk is not None:
        monkeypatch.setattr(early_repack, "CHUNK_BYTES", chunk)
    early_repack.start(run_line(files[name]))
    active = early_repack._active
    assert active is not None, "the command line loads a GGUF on the CPU: the head start should run"
    gguf = GGUFFile(files[name])
    kinds = {n: early_kind(x8_ext, t.type_id, t.shape[1]) for n, t in gguf.tensors.items()
             if len(t.shape) == 2 and t.shape[0] >= 8 and n != "token_embd.weight"}
    expected = {n: kind for n, kind in kinds.items() if kind}
    assert len(active._x8) == len(expected) > 0
    if name.startswith(("iq3", "iq2", "iq1")):
        assert "l4" in expected.values()
    for n, kind in expected.items():
        src, t = active.file.data(n), active.file.tensors[n]
        rows, k = t.shape[0] // 8 * 8, t.shape[1]
        jobs = active._x8[(src.ctypes.data, t.type_id, rows, k)][0]
        assert len(jobs) == (1 if chunk is None else rows // 8), n
        out = early_repack.take(cpu_ext.build_id(x8_ext), src.ctypes.data, t.type_id, rows, k)
        assert out is not None, n
        blocks = torch.from_numpy(np.array(src[:rows]))
        want = (x8_ext.gguf_repack(blocks, t.type_id, rows, k) if kind == "x8"
                else x8_ext.gguf_to_l4(blocks, t.type_id, rows, k, x8=True, **l4_tables(t.type_id)))
        np.testing.assert_array_equal(np.frombuffer(out, dtype=np.uint8), want.numpy().reshape(-1), err_msg=n)


def test_another_build_or_matrix_gets_nothing(x8_ext, files):
    early_repack.start(run_line(files["kmix"]))
    active = early_repack._active
    name, t = next((n, t) for n, t in active.file.tensors.items() if t.type_id == 12 and n.startswith("blk."))
    src = active.file.data(name).ctypes.data
    rows, k = t.shape[0] // 8 * 8, t.shape[1]
    assert early_repack.take("ext-another-build", src, 12, rows, k) is None
    assert early_repack.take(cpu_ext.build_id(x8_ext), src, 12, rows - 8, k) is None  # not the rows it copied
    assert early_repack.take(cpu_ext.build_id(x8_ext), src + 1, 12, rows, k) is None
    assert early_repack.take(cpu_ext.build_id(x8_ext), src, 12, rows, k) is not None


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", ["q4_0", "q8_0", "q4_1"])
def test_q4_0_q4_1_q8_0_are_split_as_gguf_into_splits_them(x8_ext, files, name, chunk, monkeypatch):
    """Each of our matrices of Q4_0 / Q4_1 / Q8_0 blocks (the embedding, Q/K/V and gate/up fused, Q/K rows unpermuted
    in the llama file) is edgellm's int8 / int4 layout exactly as quant/groups.gguf_into makes it."""
    from edgellm.loading import open_source, weight_plan, source_names
    from edgellm.quant.groups import empty_gguf_exact, gguf_into

    if chunk is not None:
        monkeypatch.setattr(early_repack, "CHUNK_BYTES", chunk)
    early_repack.start(run_line(files[name]))
    assert early_repack._active is not None and early_repack._active._exact
    src, cfg, fmt = open_source(files[name])
    assert src.file is early_repack._active.file  # adopted
    plan = weight_plan(cfg, source_names(cfg, fmt), gguf_layout=True)
    matrices = [ours for ours in plan.parts if ours.endswith(("weight",)) and "norm" not in ours]
    assert len(early_repack._active._exact) == len(matrices)
    for ours in matrices:
        raws = [src.raw(p) for p in plan.parts[ours]]
        heads = [plan.permute.get(p) for p in plan.parts[ours]]
        key = tuple((raw.ctypes.data, t, shape[0], shape[1], h or 0) for (raw, t, shape), h in zip(raws, heads))
        jobs = early_repack._active._exact[key][0]
        per_part = [1 if chunk is None else h or shape[0] for (_, _, shape), h in zip(raws, heads)]
        assert len(jobs) == sum(per_part), ours
        made = early_repack.take_exact(cpu_ext.build_id(x8_ext), key)
        assert made is not None, ours
        want = empty_gguf_exact(raws[0][1], sum(r[2][0] for r in raws), raws[0][2][1])
        row0 = 0
        for (raw, t, shape), h in zip(raws, heads):
            gguf_into(raw, t, shape, want, row0, h)
            row0 += shape[0]
        fields = [want.codes, want.scales] + ([want.mins] if want.mins is not None else [])
        assert (made[2] is None) == (want.mins is None), ours
        for got, field in zip(made, fields):
            np.testing.assert_array_equal(np.frombuffer(got, dtype=np.uint8),
                                          field.contiguous().view(torch.uint8).numpy().reshape(-1), err_msg=ours)


@pytest.mark.parametrize("name", ["kmix", "tied", "lowmix", "legacy", "q4_0", "q8_0", "q4_1", "iq3mix", "iq2mix",
                                  "iq1mix", "q4_0-chunked", "kmix-chunked"])
def test_a_load_with_the_head_start_computes_the_same_bits(x8_ext, files, name, monkeypatch):
    """The loader takes every early copy (a tied model's LM head too; the grid i-quants' L4 recodings) and the
    model's logits, prefill and a cached decode step, are those of the same file loaded without the head start, bit
    for bit."""
    name, chunked = name.removesuffix("-chunked"), name.endswith("-chunked")
    if chunked:
        monkeypatch.setattr(early_repack, "CHUNK_BYTES", 1)
    ids = list(range(3, 40))
    plain = _logits(load_model(files[name], weights="auto"), ids)
    taken = []
    for fn in ("take", "take_exact"):
        monkeypatch.setattr(early_repack, fn, lambda *a, f=getattr(early_repack, fn): taken.append(f(*a)) or taken[-1])
    early_repack.start(run_line(files[name]))
    made = len(early_repack._active._x8) + len(early_repack._active._exact)
    loaded = load_model(files[name], weights="auto")
    assert early_repack._active is None  # closed by the loader
    # every copy made is taken (iq1mix's ternary matrices, rewritten as Q2_K blocks in memory, were never foreseen)
    assert sum(x is not None for x in taken) == made > 0
    assert name == "iq1mix" or len(taken) == made
    early = _logits(loaded, ids)
    for a, b in zip(early, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("extra", [("--device", "cuda"), ("--weights", "int4"), ("--weights", "fp"), ("--no-ext",),
                                   ("--threads", "1")])
def test_nothing_starts_where_the_loader_would_not_take_it(x8_ext, files, extra):
    early_repack.start(run_line(files["kmix"], *extra))
    assert early_repack._active is None


def test_nothing_starts_for_other_commands_or_models(x8_ext, files, tmp_path):
    for argv in (["info", "-m", str(files["kmix"])], ["quantize", str(files["kmix"]), "-o", str(tmp_path / "q")],
                 ["run", "hello", "-m", str(tmp_path / "missing.gguf")],
                 ["run", "hello", "-m", str(files["kmix"].parent)], ["run", "hello", "-m"], []):
        early_repack.start(argv)
        assert early_repack._active is None, argv


def test_the_bundled_model_gets_its_head_start(x8_ext, bundled_path):
    """No -m: the commands load the bundled SmolLM2 (Q4_1 blocks, split into the int4 layout early) and the loader,
    which resolves the same path, takes it."""
    early_repack.start(["chat"])
    assert early_repack._active is not None and early_repack._active._exact
    assert early_repack.adopt_file(bundled_path) is early_repack._active.file


def test_a_corrupt_file_is_left_to_the_loader(x8_ext, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    early_repack.start(run_line(bad))  # no exception: the loader will name the problem
    assert early_repack._active is None


def test_the_command_takes_its_head_start(x8_ext, files):
    """`edgellm run` (entry.main) starts the copies before it imports torch, and its loader takes all of them."""
    code = (
        "import sys\n"
        "from edgellm import early_repack, entry\n"
        "hits = []\n"
        "def counting(*a, take=early_repack.take):\n"
        "    r = take(*a)\n"
        "    hits.append(r is not None)\n"
        "    return r\n"
        "early_repack.take = counting\n"
        "sys.argv = ['edgellm', 'run', 'hello', '-m', sys.argv[1], '-n', '2', '--raw', '--json']\n"
        "started = {}\n"
        "def spy(argv, start=early_repack.start):\n"
        "    start(argv)\n"
        "    started['jobs'] = len(early_repack._active._jobs) if early_repack._active else 0\n"
        "    started['torch'] = 'torch' in sys.modules\n"
        "early_repack.start = spy\n"
        "rc = entry.main()\n"
        "print('HEAD-START', started['jobs'], started['torch'], sum(hits), len(hits), file=sys.stderr)\n"
        "sys.exit(rc)\n")
    out = subprocess.run([sys.executable, "-c", code, str(files["kmix"])], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("HEAD-START"))
    _, jobs, torch_then, hits, asked = line.split()
    assert int(jobs) > 0 and torch_then == "False" and int(hits) == int(jobs) == int(asked)


def test_another_model_loaded_first_leaves_the_head_start_alone(x8_ext, files, monkeypatch):
    """A draft model loaded before the main one (`run --draft`), a GGUF or a safetensors folder, neither takes nor
    ends the main model's copies."""
    taken = []
    original = early_repack.take
    monkeypatch.setattr(early_repack, "take", lambda *a: taken.append(original(*a)) or taken[-1])
    early_repack.start(run_line(files["kmix"], "--draft", str(files["lowmix"])))
    active = early_repack._active
    draft = load_model(files["lowmix"], weights="auto")
    assert early_repack._active is active and not any(x is not None for x in taken)
    assert active.tokenizer is not None and draft.tokenizer is not active.tokenizer  # (the main model's, kept)
    load_model(files["tied"].with_suffix(""), weights="auto")  # a safetensors folder: not a GGUF, nothing ended
    assert early_repack._active is active
    taken.clear()
    load_model(files["kmix"], weights="auto")
    assert early_repack._active is None and len(taken) == len(active._jobs) and all(x is not None for x in taken)


def test_the_tokenizer_is_built_before_torch_and_taken(x8_ext, files):
    """The head start builds the file's tokenizer (while torch's library loads) and the loader takes that one: the
    loader's own build of it, to the serialized tokenizer and every setting."""
    import dataclasses

    early_repack.start(run_line(files["kmix"]))
    early = early_repack._active.tokenizer
    assert early is not None
    assert load_model(files["kmix"], weights="auto").tokenizer is early
    own = load_model(files["kmix"], weights="auto").tokenizer  # no head start now: the loader builds it
    assert own is not early
    assert early.backend.to_str() == own.backend.to_str()
    for f in dataclasses.fields(own):
        if f.name != "backend":
            assert getattr(early, f.name) == getattr(own, f.name), f.name
    text = "Hello world, 12345!  spaces\tand\nnewlines ünïcödé"
    assert early.encode(text) == own.encode(text) and early.decode(early.encode(text)) == own.decode(own.encode(text))


@pytest.mark.parametrize("trouble", ["warns", "fails", "deprecation"])
def test_a_tokenizer_that_warns_or_fails_is_left_to_the_loader(x8_ext, files, monkeypatch, trouble):
    """Built early, a tokenizer that warns (an unknown pre-tokenizer) or fails (malformed metadata) is dropped: the
    loader builds it again, so the warning or the error comes where it always did, from the load. A deprecation
    (which Python's default filters do not show) keeps it."""
    import warnings

    from edgellm import tokenizer as tokenizer_module
    from edgellm.errors import ModelFormatError

    real = tokenizer_module.tokenizer_from_gguf

    def troubled(src):
        if trouble == "fails":
            raise ModelFormatError(f"{src.path}: the tokenizer in the GGUF metadata is malformed (test)")
        if trouble == "deprecation":  # (a library's: not shown by Python's default filters, so not a reason)
            warnings.warn("a parameter of tokenizers is deprecated", DeprecationWarning)
        else:
            warnings.warn("GGUF pre-tokenizer 'test' is not known; using GPT-2's split")
        return real(src)

    monkeypatch.setattr(tokenizer_module, "tokenizer_from_gguf", troubled)
    early_repack.start(run_line(files["kmix"]))
    assert early_repack._active is not None
    if trouble == "deprecation":
        assert early_repack._active.tokenizer is not None
        return
    assert early_repack._active.tokenizer is None
    if trouble == "fails":
        with pytest.raises(ModelFormatError, match="malformed"):
            load_model(files["kmix"], weights="auto")
    else:
        with pytest.warns(UserWarning, match="not known"):
            assert load_model(files["kmix"], weights="auto").tokenizer is not None


def test_a_failure_after_the_plan_ends_the_head_start(x8_ext, files, monkeypatch):
    """Anything failing once the head start is set up (here the tokenizer's import) ends it, its thread and memory
    with it, and the loader loads as it would have without it."""
    made = []
    original = early_repack.EarlyRepack.close
    monkeypatch.setattr(early_repack.EarlyRepack, "close", lambda self: made.append(self) or original(self))
    monkeypatch.setattr(early_repack, "_ready_tokenizers", lambda: (_ for _ in ()).throw(ImportError("test")))
    early_repack.start(run_line(files["kmix"]))
    assert early_repack._active is None and len(made) == 1 and made[0]._outputs == []
    assert made[0]._thread is None or not made[0]._thread.is_alive()
    assert load_model(files["kmix"], weights="auto").tokenizer is not None
