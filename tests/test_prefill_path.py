"""edgellm/prefill_path.py: the kernels it names for a prompt's forward pass are the ones that pass calls, for GGUF
blocks as stored, edgellm's own int8 / int4 and float weights, at row counts on each side of every switch (the row
kernels, the int8 prompt GEMM, the AMX kernel, the causal attention kernel); `edgellm info` and `edgellm bench` show
it."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from edgellm import cli
from edgellm.kernels import attention, gguf_ops, matmul
from edgellm.loading import load_model
from edgellm.prefill_path import FUSED, METHOD_NAMES, fused_prefill_rows, prefill_path
from tests.fixtures.tiny import make_gguf, make_hf_model
from tests.test_gguf_as_stored import K_MIX, SHAPE

# the extension's entry points → the name prefill_path gives them (quant_linear_prompt: by its amx argument)
KERNELS = {"gguf_linear": "int8 rows", "gguf_linear_prompt": "int8 GEMM", "gguf_linear_amx": "AMX bf16",
           "int8_gemm_variant": "int8 rows", "int4_gemm_variant": "int8 rows"}
ROWS = (1, 16, 20, gguf_ops.AMX_MIN_ROWS - 1, gguf_ops.AMX_MIN_ROWS, 70)


@pytest.fixture(scope="module")
def kmix_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill-path")
    folder = make_hf_model(root / "hf", "llama_gqa", seed=3, **SHAPE)
    return make_gguf(folder, root / "kmix.gguf", quant_types=K_MIX, seed=7)


@pytest.fixture
def ext():
    e = matmul.cpu_extension()
    if e is None:
        pytest.fail("the C++ CPU extension did not build")
    return e


def _spy(monkeypatch, ext) -> list[str]:
    """Record, by prefill_path's names, each linear kernel the extension runs."""
    calls: list[str] = []
    for name, shown in KERNELS.items():
        real = getattr(ext, name)
        monkeypatch.setattr(ext, name, lambda *a, _real=real, _shown=shown, **k: (calls.append(_shown),
                                                                                   _real(*a, **k))[1])
    real_prompt = ext.quant_linear_prompt

    def prompt(*a, **k):
        calls.append("AMX bf16" if (a[6] if len(a) > 6 else k.get("amx", False)) else "int8 GEMM")
        return real_prompt(*a, **k)

    monkeypatch.setattr(ext, "quant_linear_prompt", prompt)
    return calls


def _layer_linears(model):
    return [m for layer in model.layers for m in layer.modules() if hasattr(m, "in_features")]


@pytest.mark.parametrize("weights", ["auto", "int8", "int4", "fp"])
def test_each_linear_runs_the_kernel_named(kmix_path, ext, monkeypatch, weights):
    """Per linear of the layers and per row count: the kernel its forward calls (or none: the float GEMM) is the
    one prefill_path counts for it; and prefill_path counts every linear of the layers once."""
    model = load_model(kmix_path, weights=weights, max_seq_len=128).model
    linears = _layer_linears(model)
    assert len(linears) == 4 * model.config.n_layers  # wqkv, wo, w13, w2
    calls = _spy(monkeypatch, ext)
    seen = set()
    for rows in ROWS:
        path = prefill_path(model, rows)
        assert path.rows == rows and sum(path.linears.values()) == len(linears)
        ran: Counter[str] = Counter()
        for lin in linears:
            x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(rows))
            calls.clear()
            with torch.no_grad():
                lin(x)
            assert len(calls) <= 1, calls
            ran[calls[0] if calls else ("fp32 GEMM" if weights == "fp" else METHOD_NAMES["dense"])] += 1
        assert dict(ran) == path.linears, (weights, rows)
        seen |= set(ran)
    if weights == "fp":
        assert seen == {"fp32 GEMM"}
    else:  # decode-sized rows always take the row kernels
        assert prefill_path(model, 1).linears == {"int8 rows": len(linears)}
    if weights != "fp" and matmul.amx_kernels(ext):
        assert prefill_path(model, 70).linears == {"AMX bf16": len(linears)}
        assert prefill_path(model, gguf_ops.AMX_MIN_ROWS - 1).linears != {"AMX bf16": len(linears)}


def test_attention_kernel_named_is_the_one_called(kmix_path, ext, monkeypatch):
    """A prompt's forward pass: flash_causal (with amx=True where the AMX kernels run) from FLASH_MIN_ROWS rows
    on, as prefill_path says; below that, none (torch's attention)."""
    loaded = load_model(kmix_path, max_seq_len=128)
    model = loaded.model
    calls = []
    real = ext.flash_causal
    monkeypatch.setattr(ext, "flash_causal", lambda *a, **k: (calls.append(k.get("amx", False)), real(*a, **k))[1])
    from edgellm.generate import Engine

    engine = Engine(model, loaded.tokenizer)
    for rows in (attention.FLASH_MIN_ROWS - 1, attention.FLASH_MIN_ROWS, 70):
        calls.clear()
        engine.reset()
        with torch.inference_mode():
            engine.prefill([(5 * i + 3) % 200 + 3 for i in range(rows)])
        named = prefill_path(model, rows).attention
        if rows < attention.FLASH_MIN_ROWS:
            assert not calls and named == "torch SDPA"
        elif not ext.flash_causal_fast():
            assert not calls and named.startswith("torch")
        else:
            assert calls and set(calls) == {calls[0]}
            assert named == ("AMX bf16x3" if calls[0] else "C++ fp32")
            assert calls[0] == matmul.amx_kernels(ext)


def test_info_and_bench_show_the_prefill_path(kmix_path, tmp_path, capsys, monkeypatch):
    """`edgellm info` names a full chunk's path and the fused step's reach; bench rows name their prompt's: the
    fused decode step for 8 tokens, the layers' kernels for 40."""
    from edgellm.generate import Engine

    loaded = load_model(kmix_path)
    fused = fused_prefill_rows(Engine(loaded.model, loaded.tokenizer).compiled_step())
    assert fused == (16 if hasattr(matmul.cpu_extension(), "DecodePlan") else 0)
    monkeypatch.setattr(cli, "EXTENSIONS", [])  # cli.main appends the extension parsers on every call
    assert cli.main(["info", "-m", str(kmix_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["prefill path"] == str(prefill_path(loaded.model, fused_rows=fused))
    for tokens in (8, 40):
        out = tmp_path / f"bench{tokens}.json"
        monkeypatch.setattr(cli, "EXTENSIONS", [])
        assert cli.main(["bench", "-m", str(kmix_path), "-p", str(tokens), "-n", "2", "-r", "1", "--warmup", "0",
                         "--threads", "2", "--stream-mib", "8", "--no-progress", "--device", "cpu",
                         "--json", str(out)]) == 0
        row = json.loads(out.read_text())["rows"][0]
        path = prefill_path(loaded.model, tokens, fused)
        assert row["prefill_path"] == path.as_dict()
        assert f"prefill: {path}" in capsys.readouterr().out
        assert (path.linears == {FUSED: 8}) == (tokens <= fused)
