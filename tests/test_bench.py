"""`edgellm bench` on a tiny model: the JSON schema and its consistency, the roofline arithmetic, the
combination grid, formats that are not there yet, --against llama.cpp (missing, and a stand-in),
--plot without matplotlib, and bad arguments."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgellm import bench, cli
from edgellm.kernels.matmul import has_cpu_kernel
from edgellm.loading import load_model

FAST = ["-p", "16", "-n", "6", "-r", "2", "--warmup", "1", "--threads", "2", "--stream-mib", "8", "--no-progress",
        "--device", "cpu"]

ROW_FIELDS = {"model", "model_path", "model_format", "params", "backend", "device", "dtype", "threads", "load_s",
              "weight_bytes", "weight_bytes_read_per_token", "weights", "kv", "draft", "context", "prompt_tokens",
              "gen_tokens", "repetitions", "test_pp", "test_tg", "error", "stats", "runs", "llama_cpp", "vs_llama_cpp",
              "decode_path", "prefill_path"}
POSITIVE_STATS = {"ttft_s", "ttft_s_min", "ttft_s_max", "prefill_tok_s", "decode_tok_s", "decode_tok_s_mean",
                  "decode_tok_s_min", "decode_tok_s_max", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99",
                  "peak_memory_bytes", "load_s", "weight_bytes", "weight_bytes_read_per_token", "kv_bytes_per_token",
                  "kv_cache_bytes", "mean_decode_context", "bytes_per_decoded_token", "bandwidth_gbs",
                  "roofline_tok_s", "roofline_pct", "achieved_gbs"}
MACHINE_FIELDS = {"cpu", "cpu_flags", "cpu_kernels", "cores_logical", "cores_physical", "threads", "ram_bytes", "gpu",
                  "device", "os", "python", "torch", "edgellm", "date", "load_average"}


def run_bench(monkeypatch, *argv) -> int:
    """The real CLI entry point, in process. cli.main appends the extension parsers to a module-level
    list on every call, so give each call a fresh list."""
    monkeypatch.setattr(cli, "EXTENSIONS", [])
    return cli.main(["bench", *argv])


def bench_json(monkeypatch, tmp_path, *argv) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    rc = run_bench(monkeypatch, *FAST, "--json", str(out), *argv)
    return rc, json.loads(out.read_text())


def test_json_schema_and_consistency(tiny_llama, tmp_path, monkeypatch, capsys):
    hf, gguf = tiny_llama
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(gguf), "--ctx", "40", "--note", "shared machine")
    out = capsys.readouterr().out
    assert rc == 0
    assert {"schema", "command", "machine", "bandwidth", "settings", "note", "notes", "rows"} <= set(doc)
    assert doc["note"] == "shared machine"
    assert MACHINE_FIELDS <= set(doc["machine"])
    assert doc["machine"]["threads"] == 2 and doc["machine"]["ram_bytes"] > 0 and doc["machine"]["torch"]
    from edgellm.kernels import matmul

    ext = matmul.cpu_extension()  # the build the rows ran on, by name (None where the kernels are off)
    assert doc["machine"]["cpu_kernels"] == (ext.isa() if ext is not None else None)
    bw = doc["bandwidth"]
    assert bw["copy_gbs"] > 0 and bw["triad_gbs"] > 0 and bw["bandwidth_gbs"] == max(bw["copy_gbs"], bw["triad_gbs"])

    rows = doc["rows"]
    assert [r["context"] for r in rows] == [16, 40]
    assert [(r["test_pp"], r["test_tg"]) for r in rows] == [("pp16", "tg6"), ("pp40", "tg6@ctx40")]
    for r in rows:
        assert ROW_FIELDS <= set(r)
        assert r["error"] is None, r["error"]
        assert r["weights"] == "auto" and r["kv"] == "auto=f16" and r["draft"] == "none"
        assert r["runs_as"] == "f32×10"  # a float GGUF stays float: 2 layers × 4 linears, the embedding, the head
        assert r["backend"] == "CPU" and r["threads"] == 2 and r["params"] > 0
        expected = {"name": "fused-cpu", "reason": ""} if has_cpu_kernel() else r["decode_path"]
        assert r["decode_path"] == expected and r["decode_path"]["name"] in ("fused-cpu", "eager")
        s = r["stats"]
        for k in POSITIVE_STATS:
            assert s[k] > 0, k
        assert s["acceptance_rate"] is None and s["draft_proposed"] == 0
        assert s["decode_tok_s_min"] <= s["decode_tok_s"] <= s["decode_tok_s_max"]
        assert s["ttft_s_min"] <= s["ttft_s"] <= s["ttft_s_max"]
        assert s["tpot_ms_p50"] <= s["tpot_ms_p90"] <= s["tpot_ms_p99"]
        assert len(r["runs"]) == 2
        for run in r["runs"]:  # tokens / time = tok/s, for both phases
            assert run["generated_tokens"] == 6 and run["decoded_tokens"] == 5
            assert run["prefill_tokens"] == r["context"]  # a full prefill each time (no prefix reuse)
            assert run["decoded_tokens"] / run["decode_s"] == pytest.approx(run["decode_tok_s"], rel=1e-9)
            assert run["prefill_tokens"] / run["prefill_s"] == pytest.approx(run["prefill_tok_s"], rel=1e-9)
            assert run["ttft_s"] == pytest.approx(run["prefill_s"])
        # median of 2 = their mean; no token takes longer than the whole decode of its run (a tiny model's
        # step is ~20 us, so one scheduler hiccup can put the mean rate 10x off the median token time: the
        # two are compared only through this bound)
        assert s["decode_tok_s"] == pytest.approx(sum(x["decode_tok_s"] for x in r["runs"]) / 2)
        assert 0 < s["tpot_ms_p99"] <= 1e3 * max(x["decode_s"] for x in r["runs"])
        assert s["achieved_gbs"] == pytest.approx(s["decode_tok_s"] * s["bytes_per_decoded_token"] / 1e9)

    # the table: a summary, two lines per row, llama-bench test names
    assert "memory bandwidth" in out and "roofline" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 2 * len(rows)
    assert any("| pp16 " in line for line in table) and any("tg6@ctx40" in line for line in table)
    assert all("%" in line for line in table if "tg6" in line)
    assert "| decode " in table[0]


def test_rows_name_the_decode_path_and_why(tiny_llama, tmp_path, monkeypatch, capsys):
    """--no-fused: the rows ran the eager model, and the JSON, the table and its footer say so and why."""
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "--no-fused")
    out = capsys.readouterr().out
    assert rc == 0
    assert [r["decode_path"] for r in doc["rows"]] == [{"name": "eager", "reason": "the fused CPU step is off"}]
    assert any(line.startswith("|") and "| eager " in line for line in out.splitlines())
    assert "decode eager: the fused CPU step is off" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_row(tiny_llama, tmp_path, monkeypatch):
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "--device", "cuda")
    r = doc["rows"][0]
    assert rc == 0 and r["error"] is None and r["backend"] == "CUDA" and doc["machine"]["gpu"]
    assert r["stats"]["peak_memory_bytes"] > 0 and r["stats"]["decode_tok_s"] > 0
    assert doc["bandwidth"]["device"].startswith("cuda") and doc["bandwidth"]["bandwidth_gbs"] > 50


def test_markdown_only_and_prompt_repetition(tiny_llama, tmp_path, monkeypatch, capsys):
    hf, _ = tiny_llama
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox jumps over the lazy dog.", encoding="utf-8")
    rc = run_bench(monkeypatch, *FAST, "-m", str(hf), "-p", "60", "--prompt-file", str(short), "--markdown")
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.strip().splitlines()
    assert all(line.startswith("|") for line in lines), out
    assert len(lines) == 4 and "pp60" in out

    loaded = load_model(hf)
    ids = bench.prompt_ids(loaded.tokenizer, short.read_text(), 60)
    body = loaded.tokenizer.encode(short.read_text(), add_bos=False)
    assert len(ids) == 60 and len(body) < 30
    assert ids[len(body):2 * len(body)] == body  # the text again, token for token (no BOS in this model)
    assert loaded.tokenizer.decode(ids).count("quick brown fox") >= 2  # real text, repeated


def test_roofline_against_hand_computation(tiny_models):
    # llama_gqa (untied): hidden 64, ffn 96, 2 layers, 4 heads of 16, 2 KV heads, fp32
    model = load_model(tiny_models["llama_gqa"][0]).model
    cfg = model.config
    V, d, f, L = cfg.vocab_size, 64, 96, 2
    per_layer = d * d + 2 * d * 32 + d * d + 3 * d * f + 2 * d
    params = L * per_layer + V * d + V * d + d
    total, read = bench.weight_bytes(model)
    assert total == 4 * params
    assert read == 4 * params - 4 * V * d + 4 * d  # the untied embedding: one row per token
    kv_per_token = 2 * L * 2 * 16 * 4  # K and V, per layer, per KV head, head dim 16, 4 bytes
    from edgellm.cache import KVCache

    assert KVCache(cfg, 8, model.dtype, "cpu").bytes_per_token == kv_per_token
    ctx = bench.mean_decode_context(100, 20)
    assert ctx == 110  # steps 1..19 attend to 101..119 positions: mean 110
    per_token = bench.bytes_per_decoded_token(read, kv_per_token, ctx)
    assert per_token == 4 * params - 4 * V * d + 4 * d + kv_per_token * 110
    assert bench.roofline_tok_s(10.0, per_token) == pytest.approx(10e9 / per_token)

    # tied embedding/LM head: stored once, read whole by the LM head
    tied = load_model(tiny_models["llama_tied"][0]).model
    total_t, read_t = bench.weight_bytes(tied)
    per_layer_t = 4 * d * d + 3 * d * f + 2 * d  # 4 KV heads: k and v are d × d too
    assert total_t == read_t == 4 * (L * per_layer_t + V * d + d)


def test_roofline_fields_of_a_row(tiny_llama, tmp_path, monkeypatch):
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]))
    r = doc["rows"][0]
    s = r["stats"]
    hand = s["weight_bytes_read_per_token"] + s["kv_bytes_per_token"] * (16 + 6 / 2)
    assert s["mean_decode_context"] == 19
    assert s["bytes_per_decoded_token"] == pytest.approx(hand)
    assert s["roofline_tok_s"] == pytest.approx(doc["bandwidth"]["bandwidth_gbs"] * 1e9 / hand)
    assert s["roofline_pct"] == pytest.approx(100 * s["decode_tok_s"] / s["roofline_tok_s"])


def test_combination_grid(tiny_llama, tmp_path, monkeypatch):
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "-r", "1", "--warmup", "0", "-n", "2",
                         "--weights", "fp,int8,int4", "--kv", "fp,f16,int8", "--draft", "none,lookup", "--ctx", "24")
    rows = doc["rows"]
    combos = [(r["weights"], r["kv"], r["draft"], r["context"]) for r in rows]
    expected = [(w, k, d, c) for w in ("fp", "int8", "int4") for k in ("fp", "f16", "int8")
                for d in ("none", "lookup") for c in (16, 24)]
    assert combos == expected  # rows = the product of the comma lists, in order
    assert rc == 0
    for r in rows:  # every format exists: each row runs (a missing one's reason: test_missing_formats_fail_...)
        assert r["error"] is None, r["error"]
        assert r["stats"]["decode_tok_s"] > 0


def test_missing_formats_fail_their_rows_only(tiny_llama, tmp_path, monkeypatch, capsys):
    # pretend the quantization, KV and speculative features are absent, whatever this tree has
    monkeypatch.setitem(sys.modules, "edgellm.quant.convert", None)
    monkeypatch.setitem(sys.modules, "edgellm.speculative", None)
    assert "not available" in bench.missing_feature("weights", "int4")
    assert "not available" in bench.missing_feature("draft", "self")
    assert bench.missing_feature("weights", "fp") is None and bench.missing_feature("draft", "none") is None
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "--weights", "fp,int4",
                         "--draft", "none,self")
    out = capsys.readouterr().out
    assert rc == 0
    by = {(r["weights"], r["draft"]): r for r in doc["rows"]}
    assert by[("fp", "none")]["error"] is None
    assert "--weights int4 not available" in by[("int4", "none")]["error"]
    assert "--draft self not available" in by[("fp", "self")]["error"]
    assert "n/a [" in out and "--weights int4 not available" in out  # shown in the table's footnotes


FAKE_LLAMA_CPP = """
import json, os, time

class Llama:  # records the call in $FAKE_LLAMA_LOG; "prefill" 4 ms, then a token every 2 ms
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, **kw):
        self.log = {"path": model_path, "threads": n_threads, "n_ctx": n_ctx, "prompts": []}
        self.ballast = bytearray(64 << 20)  # 64 MiB resident: the child's own peak RSS
        for i in range(0, len(self.ballast), 4096):
            self.ballast[i] = 1

    def reset(self):
        pass

    def generate(self, tokens, temp, top_k, reset):
        assert temp == 0.0 and top_k == 1
        self.log["prompts"].append(len(tokens))
        with open(os.environ["FAKE_LLAMA_LOG"], "w") as f:
            json.dump(self.log, f)
        time.sleep(0.004)
        while True:
            yield 1
            time.sleep(0.002)
"""


def _fake_llama_cpp(monkeypatch, tmp_path, source: str) -> Path:
    """A llama_cpp module on the PYTHONPATH of the child process bench runs llama.cpp in; returns its log path."""
    folder = tmp_path / "fake_site"
    folder.mkdir()
    (folder / "llama_cpp.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "llama_log.json"))
    return tmp_path / "llama_log.json"


def test_against_llama_cpp_missing(tiny_llama, tmp_path, monkeypatch, capsys):
    _fake_llama_cpp(monkeypatch, tmp_path, "raise ImportError('no llama.cpp here')\n")
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[1]), "--against", "llama.cpp")
    err = capsys.readouterr().err
    assert rc == 0
    assert "pip install llama-cpp-python" in err
    assert [n for n in doc["notes"] if "llama-cpp-python" in n]
    assert all(r["llama_cpp"] is None and r["error"] is None for r in doc["rows"])


def test_against_llama_cpp_stand_in(tiny_llama, tmp_path, monkeypatch, capsys):
    """A fake llama_cpp module in the child process: checks the call (threads, context, greedy, same prompt
    tokens), that each row carries llama.cpp's figures, its own peak RSS (its 64 MiB ballast, not our process's
    memory) and our ratios to them."""
    log = _fake_llama_cpp(monkeypatch, tmp_path, FAKE_LLAMA_CPP)
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[1]), "--ctx", "30", "--against", "llama.cpp")
    out = capsys.readouterr().out
    assert rc == 0
    seen = json.loads(log.read_text())
    assert seen["threads"] == 2 and seen["path"] == str(tiny_llama[1]) and seen["n_ctx"] >= 30 + 6
    assert set(seen["prompts"]) == {16, 30}
    for r in doc["rows"]:
        lc, s = r["llama_cpp"], r["stats"]
        assert 100 < lc["decode_tok_s"] < 600 and lc["prefill_tok_s"] == pytest.approx(r["context"] / lc["ttft_s"])
        assert r["vs_llama_cpp"]["decode"] == pytest.approx(s["decode_tok_s"] / lc["decode_tok_s"])
        assert r["vs_llama_cpp"]["ttft"] == pytest.approx(s["ttft_s"] / lc["ttft_s"])
        assert 64 << 20 < lc["peak_rss_bytes"] < (64 << 20) + s["peak_memory_bytes"] // 2  # its own, not ours
        assert r["vs_llama_cpp"]["peak_memory"] == pytest.approx(s["peak_memory_bytes"] / lc["peak_rss_bytes"])
    assert "llama.cpp t/s" in out and "× llama.cpp" in out and "llama.cpp MiB" in out and "peak MiB" in out


def test_against_llama_cpp_failure_keeps_our_rows(tiny_llama, tmp_path, monkeypatch, capsys):
    _fake_llama_cpp(monkeypatch, tmp_path, "class Llama:\n    def __init__(self, **kw):\n        raise ValueError('bad file')\n")
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[1]), "--against", "llama.cpp")
    assert rc == 0 and all(r["stats"] and r["llama_cpp"] is None for r in doc["rows"])
    assert [n for n in doc["notes"] if "failed" in n and "bad file" in n]


def test_against_needs_a_gguf(tiny_llama, tmp_path, monkeypatch, capsys):
    _fake_llama_cpp(monkeypatch, tmp_path, FAKE_LLAMA_CPP)
    rc, doc = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "--against", "llama.cpp")
    assert rc == 0 and "not a .gguf" in capsys.readouterr().err


def test_plot_without_matplotlib(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "b.png"
    rc, _ = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "--plot", str(png))
    assert rc == 0 and not png.exists()
    assert "pip install -e '.[plot]'" in capsys.readouterr().err


def test_plot_with_matplotlib(tiny_llama, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    rc, _ = bench_json(monkeypatch, tmp_path, "-m", str(tiny_llama[0]), "--ctx", "32", "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, needle", [
    (["--weights", "int3"], "--weights: unknown value 'int3'"),
    (["--kv", "fp,fp8"], "--kv: unknown value 'fp8'"),
    (["--draft", "bogus"], "--draft: unknown value 'bogus'"),
    (["-n", "0"], "-n/--n-gen"),
    (["-p", "0"], "-p/--n-prompt"),
    (["-r", "0"], "-r/--repetitions"),
    (["--ctx", "256,abc"], "--ctx: 'abc'"),
    (["--ctx", "0"], "--ctx: 0"),
    (["--against", "vllm"], "--against: unknown engine"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt"),
    (["--json", "/nonexistent/dir/b.json"], "--json"),
])
def test_bad_arguments(argv, needle, monkeypatch, capsys):
    assert run_bench(monkeypatch, *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgellm: error:") and needle in err[0], err


def test_bad_argument_from_the_shell():
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "bench", "--weights", "fp,int3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "edgellm: error: --weights: unknown value 'int3' (choose from auto, fp, int8, int4)"]


def test_percentile_and_spread():
    assert bench.percentile([1, 2, 3, 4, 5], 50) == 3
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench.percentile([0, 10], 90) == 9
    s = bench.spread([1.0, 2.0, 3.0])
    assert s == {"median": 2.0, "mean": 2.0, "min": 1.0, "max": 3.0, "std": 1.0}
    assert math.isclose(bench.spread([5.0])["std"], 0.0)
