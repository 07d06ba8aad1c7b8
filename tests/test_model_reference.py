"""Our forward pass against Hugging Face transformers on the same weights (the independent reference)."""
import pytest
import torch

from edgellm.cache import KVCache
from edgellm.loading import load_model
from tests.fixtures.tiny import VARIANTS

TOKENS = [5, 17, 42, 99, 3, 250, 7, 81, 120, 64, 33, 11]


def hf_logits(folder, ids):
    import transformers

    # eager: transformers' SDPA path has no soft-capping (Gemma 2); the reference must compute what the model says
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
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
    # a prompt in chunks as Engine.prefill runs it: the first without logits (its last layer writes K/V only), the
    # second with the last position's (its last layer's attention output and MLP for that row alone), then decode
    cache = KVCache(model.config, 64, torch.float32, "cpu")
    mlp_rows = []
    hook = model.layers[-1].feed_forward.register_forward_hook(lambda mod, args, out: mlp_rows.append(args[0].shape[1]))
    try:
        assert model(torch.tensor([TOKENS[:4]]), cache, 0, logits=False) is None
        last = model(torch.tensor([TOKENS[4:9]]), cache, 4)
    finally:
        hook.remove()
    assert mlp_rows == [1] and last.shape[1] == 1 and cache.length == 9
    torch.testing.assert_close(last[0, -1], ref[8], atol=1e-4, rtol=1e-4)
    step = model(torch.tensor([[TOKENS[9]]]), cache, 9)
    torch.testing.assert_close(step[0, -1], ref[9], atol=1e-4, rtol=1e-4)


def test_config_flags(tiny_models):
    assert load_model(tiny_models["qwen2_bias"][1]).config.attention_bias
    assert load_model(tiny_models["llama_tied"][0]).config.tie_embeddings
    cfg = load_model(tiny_models["llama3_rope"][0]).config
    assert cfg.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("source", [0, 1], ids=["safetensors", "gguf"])
def test_family_switches_from_both_sources(tiny_models, source):
    """The switches each family's logits depend on, read alike from config.json and from GGUF metadata (the
    logits test above shows they are the right ones; this one that both sources say the same)."""
    qwen3 = load_model(tiny_models["qwen3"][source]).config
    assert qwen3.arch == "qwen3" and qwen3.qk_norm and qwen3.head_dim == 24 and not qwen3.attention_bias
    g2 = load_model(tiny_models["gemma2"][source]).config
    assert (g2.arch, g2.layer_windows, g2.attn_softcap, g2.final_softcap) == ("gemma2", [4, 0], 5.0, 3.0)
    assert g2.query_scale == pytest.approx(24.0)  # (GGUF: the scale 24 ** -0.5 as a float32)
    assert g2.post_norms and g2.hidden_act == "gelu_tanh" and g2.embed_scale == 8.0 and g2.tie_embeddings
    g3 = load_model(tiny_models["gemma3"][source]).config
    assert (g3.layer_windows, g3.rope_local_theta, g3.rope_theta, g3.rope_scaling["factor"]) == (
        [4, 4, 0], 10000.0, 1e6, 2.0)
    assert g3.qk_norm and not g3.attn_softcap and g3.local_rope(0) and not g3.local_rope(2)
    phi = load_model(tiny_models["phi3"][source]).config
    assert phi.rope_scaling["rope_type"] == "longrope" and phi.rope_scaling["original_max_position_embeddings"] == 8
    phi4 = load_model(tiny_models["phi4_partial"][source]).config
    assert (phi4.rotary_dim, phi4.head_dim, phi4.layer_windows) == (8, 16, [6, 6])


def test_engine_prefill_runs_in_the_cpu_chunk_size(tiny_models, monkeypatch):
    """Engine.prefill takes a long prompt in chunks of device.prefill_chunk rows: 512, or on the CPU the smaller
    chunk where 512 rows' gate/up product passes the temporaries budget (forced here with a budget of 0 and a
    smaller chunk of 4 rows). Chunked, the last position's logits are still transformers'."""
    from edgellm import device, generate
    from edgellm.generate import Engine

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert device.prefill_chunk(cpu, 1536) == 512  # SmolLM2: 6 MB at 512 rows
    assert device.prefill_chunk(cpu, 4864) == device.prefill_chunk(cpu, 8192) == 256  # Qwen2.5-0.5B, Llama-3.2-1B
    assert device.prefill_chunk(cuda, 8192) == 512
    monkeypatch.setattr(device, "PREFILL_TEMPORARIES_BYTES", 0)
    monkeypatch.setattr(device, "CPU_MIN_PREFILL_CHUNK", 4)
    monkeypatch.setattr(generate, "FUSED_PREFILL", False)  # 12 tokens: else the fused step's (test_decode_step)
    folder, _ = tiny_models["llama_gqa"]
    ref = hf_logits(folder, TOKENS)
    loaded = load_model(folder, max_seq_len=64)
    engine = Engine(loaded.model, loaded.tokenizer, 64)
    rows = []
    hook = loaded.model.layers[0].register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[1]))
    try:
        logits = engine.prefill(TOKENS)
    finally:
        hook.remove()
    assert rows == [4, 4, 4]
    torch.testing.assert_close(logits, ref[-1], atol=2e-3, rtol=2e-3)  # (the CPU default cache: K/V in fp16)
