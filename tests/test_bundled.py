"""The bundled SmolLM2-135M-Instruct GGUF against transformers reading the same file."""
import pytest
import torch

from edgellm.generate import Done, Engine, GenerationSettings

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Tell me a long story about a brave little robot who learns to paint."]
MULTILINGUAL = ("Hello world! Привет, как дела? 你好，世界。こんにちは。 Ça va très bien, naïve café. "
                "Emoji 😀🚀👍🏽 and code: def f(x):\n    return x ** 2  # 12345 67.89\n\t tabs  and   spaces")


@pytest.fixture(scope="module")
def hf(bundled_path):
    import transformers

    folder, name = bundled_path.parent, bundled_path.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


@pytest.mark.slow
def test_greedy_64_tokens_match_transformers(bundled, hf):
    hf_tok, hf_model = hf
    engine = Engine(bundled.model, bundled.tokenizer)
    eos = sorted(bundled.tokenizer.eos_ids)
    lengths = []
    for prompt in PROMPTS:
        ids = bundled.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        ours = list(engine.generate(ids, GenerationSettings(max_tokens=64)))[-1].tokens
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
        while ref and ref[-1] in eos:  # HF keeps the EOS it stopped on; we do not emit it
            ref.pop()
        assert ours == ref, prompt
        lengths.append(len(ours))
    assert max(lengths) == 64  # at least one answer runs the full 64 tokens


def test_tokenizer_ids_match_transformers(bundled, hf):
    hf_tok, _ = hf
    ours = bundled.tokenizer.encode(MULTILINGUAL)
    assert ours == hf_tok.encode(MULTILINGUAL, add_special_tokens=False)
    assert bundled.tokenizer.decode(ours) == hf_tok.decode(ours)


def test_chat_template_matches_transformers(bundled, hf):
    hf_tok, _ = hf
    for messages in ([{"role": "user", "content": "Hi!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]):
        ours = bundled.tokenizer.render_chat(messages)
        ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == ref
        assert bundled.tokenizer.encode_chat(messages) == hf_tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_eos_is_end_of_turn(bundled):
    tok = bundled.tokenizer
    assert tok.backend.token_to_id("<|im_end|>") in tok.eos_ids
