"""`edgellm perplexity` against transformers' log-likelihood of the same windows."""
import json
import math
import subprocess
import sys

import torch

from edgellm.cache import KVCache
from edgellm.loading import load_model
from edgellm.perplexity import evaluate, windows
from tests.fixtures.tiny import CORPUS


def transformers_nll(folder, ids: list[int], ctx: int) -> tuple[float, int]:
    """The summed NLL of the scored half of every window by transformers in float64, and the token count."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows(ids, ctx, None):
            lp = torch.log_softmax(hf(torch.tensor([w])).logits[0], -1)
            for i in range(ctx // 2, ctx - 1):
                nll -= lp[i, w[i + 1]].item()
                n += 1
    return nll, n


def test_perplexity_matches_transformers(tiny_llama):
    folder = tiny_llama[0]
    lm = load_model(folder, max_seq_len=64)
    ids = lm.tokenizer.encode(CORPUS * 3)
    ctx = 32
    res = evaluate(lm.model, KVCache(lm.config, ctx, torch.float32, "cpu"), lm.tokenizer, ids, ctx)
    nll, n = transformers_nll(folder, ids, ctx)
    assert res.tokens_scored == n and res.windows == len(ids) // ctx
    assert math.isclose(res.perplexity, math.exp(nll / n), rel_tol=1e-4)


def test_decode_scoring_matches_transformers(tiny_llama):
    """--decode: the second half of each window fed one token at a time through the engine's decode step
    (the fused C++ step on CPU where the extension builds) gives the float64 transformers perplexity too,
    and the same log-probs as the one-pass forward; with an int4 cache, the decode path's own writes and
    attention stay close to the forward pass over the same format."""
    import transformers

    from edgellm.generate import Engine

    folder = tiny_llama[0]
    lm = load_model(folder, max_seq_len=64)
    ids = lm.tokenizer.encode(CORPUS * 3)
    ctx = 32
    cache = KVCache(lm.config, ctx, torch.float32, "cpu")
    forward = evaluate(lm.model, cache, lm.tokenizer, ids, ctx, reference=(lm.model, KVCache(lm.config, ctx, torch.float32, "cpu")))
    engine = Engine(lm.model, lm.tokenizer, cache=cache)
    decoded = evaluate(lm.model, cache, lm.tokenizer, ids, ctx, decode=engine,
                       reference=(lm.model, KVCache(lm.config, ctx, torch.float32, "cpu")))
    nll, n = transformers_nll(folder, ids, ctx)
    assert decoded.tokens_scored == n == forward.tokens_scored
    assert math.isclose(decoded.perplexity, math.exp(nll / n), rel_tol=1e-4)
    assert decoded.kl_mean < 1e-8 and decoded.top1_agreement == 1.0
    q_cache = KVCache(lm.config, ctx, torch.float32, "cpu", kv_format="int4")
    q_forward = evaluate(lm.model, q_cache, lm.tokenizer, ids, ctx)
    q_decoded = evaluate(lm.model, q_cache, lm.tokenizer, ids, ctx, decode=Engine(lm.model, lm.tokenizer, cache=q_cache))
    # the int4 cache moves this tiny model's perplexity by ~1%; decode vs forward over it: ~1e-6
    assert not math.isclose(q_decoded.perplexity, forward.perplexity, rel_tol=1e-3)
    assert math.isclose(q_decoded.perplexity, q_forward.perplexity, rel_tol=1e-4)


def test_kl_against_itself_is_zero_and_against_other_model_positive(tiny_models):
    a = load_model(tiny_models["llama_gqa"][0], max_seq_len=32)
    ids = a.tokenizer.encode(CORPUS * 2)
    cache = KVCache(a.config, 32, torch.float32, "cpu")
    same = evaluate(a.model, cache, a.tokenizer, ids, 32, reference=(a.model, KVCache(a.config, 32, torch.float32, "cpu")))
    assert same.kl_mean < 1e-9 and same.top1_agreement == 1.0
    b = load_model(tiny_models["mistral"][0], max_seq_len=32)  # same tokenizer, other weights
    other = evaluate(a.model, cache, a.tokenizer, ids, 32, reference=(b.model, KVCache(b.config, 32, torch.float32, "cpu")))
    assert other.kl_mean > 0.01 and other.top1_agreement < 1.0


def test_perplexity_cli_json(tiny_llama, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(CORPUS * 3)
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "perplexity", "-m", str(tiny_llama[1]), "-f", str(text),
                           "--ctx", "32", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["perplexity"] > 1 and out["windows"] >= 1 and out["scoring"] == "forward"
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "perplexity", "-m", str(tiny_llama[1]), "-f", str(text),
                           "--ctx", "32", "--json", "--decode"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    dec = json.loads(proc.stdout)
    assert dec["scoring"] == "decode" and math.isclose(dec["perplexity"], out["perplexity"], rel_tol=1e-4)
    missing = subprocess.run([sys.executable, "-m", "edgellm.cli", "perplexity", "-m", str(tiny_llama[1]), "-f",
                              str(tmp_path / "none.txt")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "none.txt" in missing.stderr


def test_precomputed_reference_matches_reference_model(tiny_models):
    from edgellm.perplexity import reference_logprobs

    a = load_model(tiny_models["llama_gqa"][0], max_seq_len=32)
    b = load_model(tiny_models["llama_gqa"][0], max_seq_len=32, weights="int4", group_size=32, symmetric=False)
    ids = a.tokenizer.encode(CORPUS * 2)
    cache = lambda: KVCache(a.config, 32, torch.float32, "cpu")  # noqa: E731
    ref = reference_logprobs(a.model, cache(), a.tokenizer, ids, 32)
    live = evaluate(b.model, cache(), b.tokenizer, ids, 32, reference=(a.model, cache()))
    stored = evaluate(b.model, cache(), b.tokenizer, ids, 32, reference=ref)
    assert live == stored and 0 < stored.kl_mean < 0.1


def test_perplexity_cli_quantization_options(tiny_llama, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(CORPUS * 3)
    base = [sys.executable, "-m", "edgellm.cli", "perplexity", "-m", str(tiny_llama[0]), "-f", str(text),
            "--ctx", "32", "--json", "--reference", "fp"]
    proc = subprocess.run(base + ["--weights", "int8", "--per-channel", "--embeddings", "int4", "--fast"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["group_size"] == "channel" and out["embeddings"] == "int4" and out["search"] is False
    assert set(out["stored_formats"]) == {"int8-channel-sym", "int4-g32-sym"}  # linears; embedding table and LM head
    assert 4 < out["bits_per_weight"] < 32 and 0 < out["kl_mean"] < 1  # random tiny weights: loose
    # the reference keeps fp32 K/V whatever the scored run's cache: the float16 cache's own cost shows (and is small)
    kv = {f: json.loads(subprocess.run(base + ["--weights", "fp", "--kv", f], capture_output=True, text=True,
                                       timeout=300, check=True).stdout) for f in ("fp", "f16")}
    assert kv["fp"]["kl_mean"] == 0 and 0 < kv["f16"]["kl_mean"] < 1e-4, kv
    bad = subprocess.run(base + ["--weights", "int4", "--per-channel"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--per-channel" in bad.stderr and "Traceback" not in bad.stderr
