"""Activation-aware quantization (--calibrate): the importance it measures, the objective it changes,
and the whole path from the command line."""
import json
import subprocess
import sys

import pytest
import torch

from edgellm.errors import EdgeLLMError
from edgellm.loading import load_model
from edgellm.weight_calibration import activation_importance, calibration_tokens
from edgellm.quant.groups import dequantize, quantize

from tests.test_quant_convert import kl, logits_of


def test_importance_matches_transformers_activations(tiny_llama):
    """E[x^2] per input channel of layer 0's q/k/v input and of the LM head input, against the same
    activations taken from transformers (its layer-0 input norm; its last hidden state, already normed)."""
    import transformers

    loaded = load_model(tiny_llama[0])
    ids = [5, 17, 42, 99, 3, 250, 7, 81, 120, 64, 33, 11, 9, 200, 31, 77, 4, 150]
    imp = activation_importance(loaded.model, [ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama[0], torch_dtype=torch.float64).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        x0 = hf.model.layers[0].input_layernorm(hs[0])[0]
    torch.testing.assert_close(imp["layers.0.attention.wqkv.weight"].double(), x0.square().mean(0),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(imp["output.weight"].double(), hs[-1][0].square().mean(0), rtol=1e-4, atol=1e-6)
    assert set(imp) >= {f"layers.{i}.{n}.weight" for i in range(loaded.config.n_layers)
                        for n in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")}


@pytest.mark.parametrize("symmetric", [True, False])
def test_importance_weighted_search_lowers_the_weighted_error(symmetric):
    """With a few channels weighing 100x, the calibrated search's weighted error is below both
    round-to-nearest's and the unweighted search's (what it optimises), per the float64 dequantization."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    imp = torch.ones(256)
    imp[torch.randperm(256, generator=g)[:16]] = 100.0

    def weighted_err(qt):
        return float(((dequantize(qt).double() - w.double()) ** 2 * imp.double()).sum())

    calibrated = weighted_err(quantize(w, 4, 32, symmetric, True, importance=imp))
    assert calibrated < 0.9 * weighted_err(quantize(w, 4, 32, symmetric, False))
    assert calibrated < 0.95 * weighted_err(quantize(w, 4, 32, symmetric, True))


def test_calibration_text_errors(tiny_llama, tmp_path):
    tok = load_model(tiny_llama[0]).tokenizer
    assert sum(map(len, calibration_tokens(tok, "builtin"))) >= 16
    with pytest.raises(EdgeLLMError, match="no-such-file"):
        calibration_tokens(tok, str(tmp_path / "no-such-file.txt"))
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(EdgeLLMError, match="at least 16"):
        calibration_tokens(tok, str(tmp_path / "short.txt"))


def test_quantize_cli_with_calibration_round_trips(tiny_llama, tmp_path):
    """The calibrated model `edgellm quantize` writes loads back as the same calibration gives in memory. Both
    run the float model on the same thread count: its sums' order (and so an importance's last bits, and so a
    near-tie in the scale search) depends on it; measured: an AVX2 build's GEMMs on 1 and 2 threads pick other
    scales for 2 of the tiny model's matrices, as any ulp-level change of the activations may."""
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "quantize", str(tiny_llama[0]), "-o", str(out),
                           "--weights", "int4", "--calibrate", str(text), "--threads", str(torch.get_num_threads())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "calibrated on" in proc.stderr
    meta = json.loads((out / "edgellm.json").read_text())
    assert meta["quantization"]["calibration"] == str(text)
    in_memory = load_model(tiny_llama[0], weights="int4", calibration=str(text))
    assert torch.equal(logits_of(load_model(out)), logits_of(in_memory))


@pytest.mark.slow
def test_calibration_helps_the_bundled_model(bundled_path):
    """int4 g32 symmetric of the bundled model's linears, calibrated on the built-in text, is closer to the
    float model than the uncalibrated search on other text (KL of next-token distributions). (Loading the
    bundled GGUF with --weights int4 keeps its Q4_1 blocks, so the weights are requantized here directly.)"""
    import copy

    fp = load_model(bundled_path, weights="fp")
    imp = activation_importance(fp.model, calibration_tokens(fp.tokenizer, "builtin"))
    text = ("In the beginning the universe was created. This has made a lot of people very angry and been "
            "widely regarded as a bad move. Many were increasingly of the opinion that they'd all made a big "
            "mistake in coming down from the trees in the first place.")
    ids = fp.tokenizer.encode(text)
    ref = logits_of(fp, ids)
    kls = []
    for use in (False, True):
        m = copy.deepcopy(fp)
        for name, mod in m.model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
                w = mod.weight.detach()
                qt = quantize(w, 4, 32, True, True, importance=imp[name + ".weight"] if use else None)
                mod.weight.data = dequantize(qt)
        kls.append(kl(ref, logits_of(m, ids)))
    assert kls[1] < 0.8 * kls[0]
