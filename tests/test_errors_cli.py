"""Bad input gets a one-line error naming the file, exit code 2, no traceback; the CLI's JSON shape."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.errors import ContextOverflowError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from edgellm.loading import load_model


def run_cli(*args, env=None, stdin=None):
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=stdin, timeout=300)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0]


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError):
        load_model(missing)
    assert_clean_error(run_cli("run", "hi", "-m", str(missing)), str(missing))


def test_empty_file(tmp_path):
    f = tmp_path / "empty.gguf"
    f.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="empty"):
        load_model(f)


def test_random_bytes_named_gguf(tmp_path):
    f = tmp_path / "random.gguf"
    f.write_bytes(os.urandom(4096))
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        load_model(f)
    assert_clean_error(run_cli("info", "-m", str(f)), str(f))


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.99])
def test_truncated_gguf(tiny_llama, tmp_path, fraction):
    data = tiny_llama[1].read_bytes()
    f = tmp_path / "cut.gguf"
    f.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelFormatError, match="cut.gguf"):
        load_model(f)


def test_truncated_safetensors(tiny_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama[0], folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        load_model(folder)
    assert_clean_error(run_cli("run", "hi", "-m", str(folder)), "model.safetensors")


def test_unsupported_architecture(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(folder)
    assert_clean_error(run_cli("info", "-m", str(folder)), "not supported")


def test_prompt_over_context(tiny_llama):
    from edgellm.generate import Engine

    lm = load_model(tiny_llama[0], max_seq_len=16)
    with pytest.raises(ContextOverflowError):
        list(Engine(lm.model, lm.tokenizer).generate(list(range(3, 40))))
    long_prompt = "word " * 100
    assert_clean_error(run_cli("run", long_prompt, "-m", str(tiny_llama[0]), "--ctx", "32"), "context")
    ok = run_cli("run", long_prompt, "-m", str(tiny_llama[0]), "--ctx", "32", "--truncate", "-n", "3", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["prompt_tokens"] == 31


def test_run_json_and_stdin(tiny_llama):
    proc = run_cli("run", "-", "-m", str(tiny_llama[1]), "-n", "8", "--json", "--temperature", "0",
                   stdin="Hello there")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "tokens", "prompt_tokens", "stats"}
    assert len(out["tokens"]) == out["stats"]["generated_tokens"] <= 8
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert out["stats"][key] >= 0
    assert out["stats"]["ttft_s"] > 0


def test_run_streams_text_and_stats_line(tiny_llama):
    proc = run_cli("run", "Hello", "-m", str(tiny_llama[0]), "-n", "5", "--raw")
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stderr and "decode" in proc.stderr and "tok/s" in proc.stderr


def test_info(tiny_llama):
    proc = run_cli("info", "-m", str(tiny_llama[1]), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "llama" and info["layers"] == "2" and info["format"] == "gguf"
    from edgellm.kernels import matmul

    build = matmul.cpu_kernel_build()  # the build this CPU gets (the CLI's process picks the same)
    assert info["CPU kernels"] == build if build else info["CPU kernels"].startswith("off")
    proc = run_cli("info", "-m", str(tiny_llama[1]), "--json", "--no-ext")
    assert proc.returncode == 0 and json.loads(proc.stdout)["CPU kernels"].startswith("off"), proc.stderr


def test_hub_id_resolves_from_local_cache(tiny_llama, tmp_path):
    """A model placed in a HF cache folder resolves by its id with HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(tiny_llama[0], snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = run_cli("run", "Hello", "-m", "tiny-org/tiny-llama", "-n", "3", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == str(snap)
    missing = run_cli("run", "Hello", "-m", "tiny-org/not-there", env=env)
    assert_clean_error(missing, "tiny-org/not-there")
