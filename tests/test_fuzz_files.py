"""Broken and hostile model files end in one edgellm error naming the file: never a traceback, a hang,
a crash of the process or gigabytes allocated because a header lied (cases: tests/fuzz_cases.py).

The seeded sample here runs in CI; `benchmarks/fuzz.py` runs every case (results/fuzz.json)."""
import os
import struct
import time

import pytest

from edgellm.errors import ModelFormatError, UnsupportedModelError
from edgellm.file_checks import check_safetensors_file
from edgellm.gguf_file import check_gguf_file
from tests.fuzz_cases import all_cases, gguf_map, run_worker
from tests.test_errors_cli import assert_clean_error, run_cli

SEED = 20261124


def sources(tiny_models):
    return {k: (str(a), str(b)) for k, (a, b) in tiny_models.items()}


def assert_all_clean(outcomes, expected):
    failures = [f"{o.name}: {o.detail}" for o in outcomes if o.result == "FAIL"]
    assert not failures, f"{len(failures)} of {len(outcomes)} cases failed:\n" + "\n".join(failures[:30])
    assert len(outcomes) == expected  # the worker ran every case (it did not die part way)


def test_fuzzed_files_fail_cleanly(tiny_models, tmp_path):
    """A seeded sample of every kind of case over the five tiny models, in a child process with its
    address space capped at 2 GiB above what it maps at start and a 20 s alarm per case."""
    spec = {"sources": sources(tiny_models), "seed": SEED, "n_random": 20, "work": str(tmp_path / "work"),
            "memory_limit": 2 << 30, "timeout_s": 20, "sample": 400}
    outcomes, proc = run_worker(spec, tmp_path / "out.json", timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_all_clean(outcomes, 400)
    kinds = {o.name.split(":")[0] for o in outcomes}
    assert kinds >= {"gguf", "safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}
    assert sum(o.result == "refused" for o in outcomes) > 200  # most cases are real damage, refused


# Cases the whole corpus (benchmarks/fuzz.py) once found unclean: per-layer lists sized by a lying layer count
# before it was checked (MemoryError, a 30 s hang), negative windows and scales reaching the attention, a rotary
# fraction of true / below zero, LongRoPE factors of the wrong count (refused without the file's name, or loaded).
ESCAPED = ["gguf:gemma2.gguf:kv[gemma2.block_count]=u64-huge", "gguf:gemma2.gguf:kv[gemma2.block_count]=2147483647",
           "gguf:gemma2.gguf:kv[gemma2.attention.sliding_window]=int32=-1",
           "gguf:gemma3.gguf:kv[gemma3.attention.sliding_window]=int32=-1",
           "config.json:query_pre_attn_scalar=negative", "config.json:sliding_window=negative",
           "config.json:num_hidden_layers=huge", "config.json:partial_rotary_factor=bool",
           "config.json:partial_rotary_factor=negative",
           "gguf:phi4_partial.gguf:kv[phi3.rope.dimension_count].removed",
           "gguf:phi4_partial.gguf:kv[phi3.block_count]=4294967295",
           "gguf:phi4_partial.gguf:kv[phi3.rope.dimension_count]=16",
           "gguf:phi4_partial.gguf:t[rope_factors_long.weight].dim0=8",
           "gguf:phi4_partial.gguf:t[rope_factors_short.weight].dim0=8"]


def test_cases_the_whole_corpus_found_stay_clean(tiny_models, tmp_path):
    spec = {"sources": sources(tiny_models), "seed": SEED, "n_random": 20, "work": str(tmp_path / "work"),
            "memory_limit": 2 << 30, "timeout_s": 20, "names": ESCAPED}
    outcomes, proc = run_worker(spec, tmp_path / "out.json", timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {o.name for o in outcomes} == set(ESCAPED)
    assert_all_clean(outcomes, len(outcomes))
    # each GGUF case is one file's damage; a config.json case runs on every model, benign for some (loaded)
    assert all(o.result == "refused" for o in outcomes if o.name.startswith("gguf:"))


@pytest.mark.slow
def test_fuzzed_bundled_header_fails_cleanly(bundled_path, tmp_path):
    """The bundled 98 MB GGUF (a real llama.cpp file, 49k-token vocab): lying counts, lengths, types and
    offsets, each refused by the header check in well under a second."""
    spec = {"sources": {}, "bundled": str(bundled_path), "seed": SEED, "n_random": 0,
            "work": str(tmp_path / "work"), "memory_limit": 2 << 30, "timeout_s": 60, "bundled_count": 24,
            "generate": False}
    outcomes, proc = run_worker(spec, tmp_path / "out.json", timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_all_clean(outcomes, 24)
    assert all(o.result == "refused" for o in outcomes)
    assert max(o.seconds for o in outcomes) < 10


def test_lying_lengths_are_refused_before_any_loop(tiny_llama, tmp_path):
    """gguf.GGUFReader would loop over a lying array length item by item; the check refuses it at once."""
    data = tiny_llama[1].read_bytes()
    m = gguf_map(tiny_llama[1])
    tokens = next(kv for kv in m.kvs if kv.key == "tokenizer.ggml.tokens")
    f = tmp_path / "lie.gguf"
    for at, value, needle in [(tokens.type_at + 8, 1 << 60, "claims"), (tokens.type_at + 8, tokens.count + 1, "past the end"),
                              (16, (1 << 64) - 1, "metadata count"), (8, 1 << 40, "tensor count")]:
        f.write_bytes(data[:at] + struct.pack("<Q", value) + data[at + 8:])
        t0 = time.perf_counter()
        with pytest.raises(ModelFormatError, match=needle) as e:
            check_gguf_file(f)
        assert time.perf_counter() - t0 < 2
        assert str(f) in str(e.value)


def test_string_arrays_of_every_shape_read_as_gguf_reader_reads(tiny_llama, tmp_path, monkeypatch):
    """Vocabularies are read without a Python step per item (empty and 256+ byte items among them, as Llama 3's
    has); arrays with a NUL inside an item or bad UTF-8 go through the loops. Either way the values are gguf-py's
    (GGUFReader), and bad UTF-8 is refused naming the item."""
    import gguf

    from edgellm.gguf_file import GGUFFile, _Reader
    from tests.fuzz_cases import ARRAY, STRING, enc_kv, rebuilt

    arrays = {"plain": [f"tok{i}" for i in range(3000)] + ["Ġthe", "éè", "中文", "x" * 255],
              "one": ["a"], "empty-item": ["a", "", "b", ""], "long-items": [f"t{i}" for i in range(500)] +
              ["y" * 256, "z" * 300 + "\u00e9", "w" * 65535, "", "v"] + [f"u{i}" for i in range(500)] + ["q" * 256],
              "huge-item": ["a", "w" * 65536, "b"], "all-empty": [""] * 5000,
              "nul-run": ["a", "b" + "\0" * 9 + "c", "d"], "nul": ["a", "\0", "d"]}
    data = tiny_llama[1].read_bytes()
    m = gguf_map(tiny_llama[1])
    extra = b"".join(enc_kv(f"test.{k}", ARRAY, v, STRING) for k, v in arrays.items())
    f = tmp_path / "arrays.gguf"
    f.write_bytes(rebuilt(data, m, extra_kv=extra, n_kv_delta=len(arrays)))
    fast = []
    vectorized = _Reader._strings_vectorized

    def spy(self, count):
        out = vectorized(self, count)
        fast.append(out is not None)
        return out

    monkeypatch.setattr(_Reader, "_strings_vectorized", spy)
    ours, ref = GGUFFile(f).fields, gguf.GGUFReader(str(f)).fields
    for k, v in arrays.items():
        assert ours[f"test.{k}"] == ref[f"test.{k}"].contents() == v, k
    # the arrays in the file's order; an item of 64 KiB or more, more odd items than MAX_STEPS, and a NUL send
    # theirs to the loops
    assert fast[-len(arrays):] == [True, True, True, True, False, False, False, False]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(rebuilt(data, m, extra_kv=enc_kv("test.bad", ARRAY, ["a", b"\xc3", "d"], STRING), n_kv_delta=1))
    with pytest.raises(ModelFormatError, match=r"test.bad\[1\] is not valid UTF-8"):
        GGUFFile(bad)


def test_a_vocabulary_past_the_embedding_is_refused(tiny_llama, tmp_path):
    """A GGUF token list longer than the embedding table would send ids past its rows into the lookup: refused at
    load, naming the first token past the table."""
    from edgellm.gguf_file import GGUFFile
    from edgellm.loading import load_model
    from tests.fuzz_cases import ARRAY, STRING, enc_kv, rebuilt

    data = tiny_llama[1].read_bytes()
    m = gguf_map(tiny_llama[1])
    src = GGUFFile(tiny_llama[1])
    tokens, types = src.fields["tokenizer.ggml.tokens"], src.fields["tokenizer.ggml.token_type"]
    rows = src.tensors["token_embd.weight"].shape[0]
    at = {kv.key: i for i, kv in enumerate(m.kvs)}
    extra = rows - len(tokens) + 1
    # new tokens, or copies of one already there (the vocabulary's size then stays; its top id does not)
    for grown in (tokens + [f"zz{i}" for i in range(extra)], tokens + [tokens[5]] * extra):
        f = tmp_path / "grown.gguf"
        f.write_bytes(rebuilt(data, m, kv_bytes={
            at["tokenizer.ggml.tokens"]: enc_kv("tokenizer.ggml.tokens", ARRAY, grown, STRING),
            at["tokenizer.ggml.token_type"]: enc_kv("tokenizer.ggml.token_type", ARRAY,
                                                    types + [1] * (len(grown) - len(types)), 5)}))
        with pytest.raises(ModelFormatError, match=f"'{grown[-1]}' with id {rows}, past the model's {rows} embeddings"):
            load_model(f)


def test_tensor_checks_name_the_problem(tiny_llama, tmp_path):
    data = tiny_llama[1].read_bytes()
    m = gguf_map(tiny_llama[1])
    t0, t1 = m.tensors[0], m.tensors[1]
    f = tmp_path / "bad.gguf"
    cases = [((t0.type_at, struct.pack("<I", 100)), UnsupportedModelError, "unknown GGML type 100"),
             ((t0.offset_at, struct.pack("<Q", t0.offset + 1)), ModelFormatError, "not aligned"),
             ((t1.offset_at, struct.pack("<Q", t0.offset)), ModelFormatError, "overlap"),
             ((t0.dims_at, struct.pack("<Q", 1 << 40)), ModelFormatError, "past the end of the file"),
             ((t0.dims_at - 4, struct.pack("<I", 7)), ModelFormatError, "7 dimensions")]
    for (at, b), err, needle in cases:
        f.write_bytes(data[:at] + b + data[at + len(b):])
        with pytest.raises(err, match=needle):
            check_gguf_file(f)


def test_metadata_of_the_wrong_type_is_named(tiny_llama, tmp_path):
    from tests.fuzz_cases import enc_kv, rebuilt

    data = tiny_llama[1].read_bytes()
    m = gguf_map(tiny_llama[1])
    i = next(i for i, kv in enumerate(m.kvs) if kv.key == "llama.embedding_length")
    f = tmp_path / "typed.gguf"
    f.write_bytes(rebuilt(data, m, kv_bytes={i: enc_kv("llama.embedding_length", 8, "sixty-four")}))
    with pytest.raises(ModelFormatError, match="llama.embedding_length should be an integer, found string"):
        check_gguf_file(f)


def test_safetensors_header_length_checked_against_the_file(tiny_llama, tmp_path):
    data = (tiny_llama[0] / "model.safetensors").read_bytes()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", (1 << 64) - 1) + data[8:])
    with pytest.raises(ModelFormatError, match="header claims"):
        check_safetensors_file(f)
    assert check_safetensors_file(tiny_llama[0] / "model.safetensors").tensors  # the good file passes


@pytest.mark.slow
def test_fuzzed_files_through_the_cli(tiny_llama, tmp_path):
    """A sample through the real command line: one line on stderr naming the file, exit 2, no traceback."""
    wanted = ["gguf:llama_gqa.gguf:n_kv=18446744073709551615", "gguf:llama_gqa.gguf:kv[tokenizer.ggml.tokens].array_len=4294967296",
              "safetensors:header_len=18446744073709551615", "config.json:hidden_size=string",
              "tokenizer_config.json:chat_template=list", "gguf:llama_gqa.gguf:kv[tokenizer.ggml.merges]:=['zz qq', 'a']"]
    cases = {c.name: c for c in all_cases({"llama_gqa": tiny_llama}, SEED, 0) if c.name in wanted}
    assert sorted(cases) == sorted(wanted)
    for name in wanted:
        work = tmp_path / str(len(os.listdir(tmp_path)))
        work.mkdir()
        path = cases[name].build(work)
        proc = run_cli("run", "Hi", "-m", str(path), "-n", "2")
        assert_clean_error(proc, str(work))


def test_broken_edgellm_folder_is_refused(tiny_llama, tmp_path):
    """An edgellm-quantized folder can come from anyone too: broken metadata or weights name the folder."""
    import json
    import shutil

    from edgellm.errors import EdgeLLMError
    from edgellm.loading import load_model

    out = tmp_path / "q"
    proc = run_cli("quantize", str(tiny_llama[0]), "-o", str(out), "--fast", "--weights", "int8")
    assert proc.returncode == 0, proc.stderr
    name = next(iter(json.loads((out / "edgellm.json").read_text())["tensors"]))
    edits = {
        "shape": lambda m: m["tensors"][name].update(shape=[7, 64]),
        "shape-transposed": lambda m: m["tensors"][name].update(shape=m["tensors"][name]["shape"][::-1]),
        "bits": lambda m: m["tensors"][name].update(bits=3),
        "config-type": lambda m: m["config"].update(dim="64"),
        "config-missing": lambda m: m["config"].pop("n_layers"),
        "config-heads": lambda m: m["config"].update(n_heads=0),
        "no-tokenizer": lambda m: m.pop("tokenizer"),
        "tensors-list": lambda m: m.update(tensors=[1]),
        "not-an-object": lambda m: [m],
    }
    for label, edit in edits.items():
        bad = tmp_path / label
        shutil.copytree(out, bad)
        meta = json.loads((bad / "edgellm.json").read_text())
        meta = edit(meta) or meta
        (bad / "edgellm.json").write_text(json.dumps(meta))
        with pytest.raises(EdgeLLMError) as e:
            load_model(bad)
        assert str(bad) in str(e.value), (label, str(e.value))
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_clean_error(run_cli("info", "-m", str(cut)), str(cut))


def test_the_checked_reader_reads_what_gguf_reader_reads(tiny_models):
    """GGUFFile (the one checked reader) against gguf-py's own GGUFReader on every tiny model: the same metadata
    values, and for every tensor the same type, shape and bytes."""
    import gguf
    import numpy as np

    from edgellm.gguf_file import GGUFFile

    for _, path in tiny_models.values():
        ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
        want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert ours.fields == want
        assert list(ours.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            mine = ours.tensors[t.name]
            assert mine.type_id == int(t.tensor_type) and mine.shape == tuple(int(d) for d in reversed(t.shape))
            assert ours.data(t.name).tobytes() == np.asarray(t.data).tobytes()
        assert {n: (i.shape, i.dtype) for n, i in ours.layout.tensors.items()} == {
            t.name: (mine.shape, mine.type_name) for t in ref.tensors for mine in [ours.tensors[t.name]]}


def test_gguf_tables_and_row_layout():
    """The block-type table beside the reader is gguf-py's (GGML_QUANT_SIZES) and names exactly the types the
    kernels take; the Q/K row permutation is llama.cpp's converter's, and its inverse undoes it."""
    import gguf
    import numpy as np
    import torch

    from edgellm.gguf_file import GGML_BLOCKS, GGUF_TYPES, permute_rope_rows, unpermute_rope_rows
    from edgellm.kernels.gguf_ops import GGUF_NATIVE_TYPES
    from tests.fixtures.tiny import llamacpp_permute

    for type_id, t in GGUF_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert (t.name, (t.block_values, t.block_bytes)) == (qtype.name, gguf.GGML_QUANT_SIZES[qtype])
    # the types kept as stored: the C++ kernels' and IQ2_XS / IQ2_S (recoded for them on the CPU)
    assert {t.name: t.id for t in GGUF_TYPES.values()} == {**GGUF_NATIVE_TYPES, "IQ2_XS": 17, "IQ2_S": 22}
    # the reader's table of every type (no gguf-py import when reading a header): gguf-py's sizes
    known = {int(q): (q.name, *gguf.GGML_QUANT_SIZES[q]) for q in gguf.GGMLQuantizationType}
    assert GGML_BLOCKS.items() <= known.items(), set(GGML_BLOCKS.items()) - set(known.items())
    assert len(GGML_BLOCKS) >= 34
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    np.testing.assert_array_equal(permute_rope_rows(w, 4), llamacpp_permute(w, 4))
    wt = torch.from_numpy(w)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(wt, 4), 4), wt)
