"""The families beside Llama's graph (Qwen3, Gemma 2/3, Phi-3/3.5/4-mini) through the rest of the engine: int8 / int4
weights, speculative decoding with a self-draft, the edgellm quantized format, and their chat templates as
transformers renders them. (Logits against transformers: test_model_reference.py; the fused CPU step and quantized
KV caches: test_decode_step.py.)"""
import pytest
import torch

from edgellm.cache import KVCache
from edgellm.errors import QuantizationError, TokenizerError
from edgellm.generate import Done, Engine, GenerationSettings
from edgellm.loading import load_model
from edgellm.speculative import SelfDraftProposer
from tests.fixtures.tiny import FAMILIES

IDS = [5, 17, 42, 99, 3, 250, 7, 81, 120, 64, 33, 11]


def logits_of(loaded):
    cache = KVCache(loaded.config, 64, torch.float32, "cpu")
    return loaded.model(torch.tensor([IDS]), cache, 0, all_logits=True)[0]


def kl(p_logits, q_logits):
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def generate(engine, prompt, n=20):
    events = list(engine.generate(prompt, GenerationSettings(max_tokens=n, ignore_eos=True)))
    assert isinstance(events[-1], Done)
    return events[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_weights(tiny_models, family, exact_matmul):
    """int8 / int4 weights (and the int8 embedding / LM head) stay close to the float model, int8 ten times closer
    than int4, and the fused step on them gives the eager model's logits (the norms, soft caps and windows around
    the quantized matmuls are the family's). (These tiny models' random weights make sharp distributions: int8
    measures KL 3e-4 to 3.5e-3, int4 0.03 to 0.6, Gemma 3's the most; a broken layout costs nats.)"""
    ref = logits_of(load_model(tiny_models[family][0], max_seq_len=64))  # (one context: LongRoPE's factors use it)
    kls = {}
    for weights in ("int8", "int4"):
        q = load_model(tiny_models[family][0], weights=weights, max_seq_len=64, options=exact_matmul)
        kls[weights] = kl(ref, logits_of(q))
        engine = Engine(q.model, q.tokenizer, options=exact_matmul)
        assert engine.compiled_step() is not None
        engine.prefill(IDS[:5])
        cache = KVCache(q.config, 64, torch.float32, "cpu", kv_format="auto")  # as the engine's
        q.model(torch.tensor([IDS[:5]]), cache, 0)
        for pos in range(5, len(IDS)):
            fused = engine.step(torch.tensor([[IDS[pos]]]))
            eager = q.model(torch.tensor([[IDS[pos]]]), cache, pos)[0, -1]
            # (both on Engine's default float16 cache: K/V from two fp32 summation orders can round to neighbouring
            # halves, which moved one logit of phi4_partial by 1.3e-4)
            torch.testing.assert_close(fused, eager, atol=5e-4, rtol=1e-4)
    assert kls["int8"] < 5e-3 and kls["int4"] < 1.0 and kls["int8"] < kls["int4"] / 10, kls


@pytest.mark.parametrize("family", FAMILIES)
def test_self_draft_speculation_greedy_identical(tiny_models, family):
    """Speculative decoding with the model's own int4 copy as the draft (its norms, q/k norms and RoPE tables
    shared): token for token plain greedy decoding, with some drafts accepted."""
    loaded = load_model(tiny_models[family][0])
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    plain = generate(Engine(loaded.model, loaded.tokenizer, 96), prompt)
    spec = generate(Engine(loaded.model, loaded.tokenizer, 96, draft=SelfDraftProposer(loaded.model), draft_tokens=3),
                    prompt)
    assert spec.tokens == plain.tokens
    assert spec.stats.draft_accepted > 0
    short = generate(Engine(loaded.model, loaded.tokenizer, 96, draft=SelfDraftProposer(loaded.model, n_layers=1)),
                     prompt)  # the first layer only (Gemma 3: a sliding one, with the local RoPE table)
    assert short.tokens == plain.tokens


def test_edgellm_format_round_trip(tiny_models, tmp_path):
    """A quantized Gemma 3 (q/k norms, post norms, two RoPE tables, tied int8 embeddings) saved in the edgellm
    format and loaded back gives the same logits, without requantizing."""
    from edgellm.quant.convert import QuantSettings
    from edgellm.quantized_format import save_edgellm

    direct = load_model(tiny_models["gemma3"][0], weights="int4", max_seq_len=64)
    out = save_edgellm(direct, tmp_path / "g3", QuantSettings(weights="int4"))
    again = load_model(out, max_seq_len=64)
    assert again.source_format == "edgellm" and again.config == direct.config
    torch.testing.assert_close(logits_of(again), logits_of(direct), atol=0, rtol=0)


def test_gguf_export_refuses_other_families(tiny_models, tmp_path):
    from edgellm.gguf_export import export_gguf

    loaded = load_model(tiny_models["gemma2"][0], weights="int4")
    with pytest.raises(QuantizationError, match="gemma2"):
        export_gguf(loaded, tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()


# Gemma's templates as the checkpoints ship them: Gemma 2's refuses a system role, Gemma 3's folds it into the
# first user turn; both call the assistant "model".
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")
CHAT = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! "},
        {"role": "user", "content": "  Tell me a joke.  "}]
SYSTEM = [{"role": "system", "content": "Be brief."}] + CHAT


@pytest.mark.parametrize("family,template", [("gemma2", GEMMA2_TEMPLATE), ("gemma3", GEMMA3_TEMPLATE)])
def test_gemma_chat_templates_as_transformers_renders_them(tiny_models, tmp_path, family, template):
    """The template from the model's files, rendered as transformers' apply_chat_template renders it; a system
    message does what the template does with it (Gemma 2: refused, as a one-line error; Gemma 3: folded into
    the first user turn)."""
    import json
    import shutil

    import transformers

    folder = tmp_path / family
    shutil.copytree(tiny_models[family][0], folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, bos_token="<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = load_model(folder).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in (CHAT, SYSTEM):
        try:
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own raise_exception
            assert family == "gemma2" and messages is SYSTEM and "System role not supported" in str(e)
            with pytest.raises(TokenizerError, match="System role not supported"):
                ours.render_chat(messages)
            continue
        assert ours.render_chat(messages) == want
        assert want.endswith("<start_of_turn>model\n") and "<start_of_turn>model\nHi!<end_of_turn>" in want
    if family == "gemma3":
        assert "<start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>" in ours.render_chat(SYSTEM)
