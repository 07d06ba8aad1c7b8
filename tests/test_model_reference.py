"""Our forward pass against Hugging Face transformers on the same weights (the independent reference)."""
import pytest
import torch

from edgellm.cache import KVCache
from edgellm.loading import load_model
from tests.fixtures.tiny import VARIANTS

TOKENS = [5, 17, 42, 99, 3, 250, 7, 81, 120, 64, 33, 11]


def hf_logits(folder, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(tiny_models, variant, source):
    folder, gguf_path = tiny_models[variant]
    ref = hf_logits(folder, TOKENS)
    loaded = load_model(folder if source == "safetensors" else gguf_path, max_seq_len=64)
    model = loaded.model
    assert loaded.source_format == source
    # prefill: all positions at once
    cache = KVCache(model.config, 64, torch.float32, "cpu")
    logits = model(torch.tensor([TOKENS]), cache, 0, all_logits=True)[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # prefill a prefix, then decode one token at a time against the cache
    cache = KVCache(model.config, 64, torch.float32, "cpu")
    split = 5
    first = model(torch.tensor([TOKENS[:split]]), cache, 0)
    torch.testing.assert_close(first[0, -1], ref[split - 1], atol=1e-4, rtol=1e-4)
    for pos in range(split, len(TOKENS)):
        step = model(torch.tensor([[TOKENS[pos]]]), cache, pos)
        torch.testing.assert_close(step[0, -1], ref[pos], atol=1e-4, rtol=1e-4)
    assert cache.length == len(TOKENS)
    # several tokens on top of a kept prefix (causal mask against the cache)
    cache.truncate(7)
    chunk = model(torch.tensor([TOKENS[7:11]]), cache, 7, all_logits=True)[0]
    torch.testing.assert_close(chunk, ref[7:11], atol=1e-4, rtol=1e-4)


def test_config_flags(tiny_models):
    assert load_model(tiny_models["qwen2_bias"][1]).config.attention_bias
    assert load_model(tiny_models["llama_tied"][0]).config.tie_embeddings
    cfg = load_model(tiny_models["llama3_rope"][0]).config
    assert cfg.rope_scaling["rope_type"] == "llama3"
