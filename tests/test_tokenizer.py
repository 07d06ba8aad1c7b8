"""Tokenizer loading, streaming detokenization and the sandboxed chat template."""
import pytest

from edgellm.errors import TokenizerError
from edgellm.loading import load_model
from edgellm.tokenizer import render_template

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, again and again.",
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "chinese": "我能吞下玻璃而不伤身体。你好，世界！",
    "emoji": "Rockets 🚀🚀 and faces 😀👍🏽👨‍👩‍👧 mixed with text.",
    "code": "def f(x):\n    return {'a': [1, 2, 3]}[x]  # комментарий\n\tpass\n",
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_stream_decoder_concatenates_to_decode(bundled, name):
    tok = bundled.tokenizer
    ids = tok.encode(TEXTS[name])
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    for p in pieces:
        assert "\ufffd" not in p  # never half a UTF-8 character
    assert "".join(pieces) == tok.decode(ids) == TEXTS[name]


def test_stream_decoder_on_tiny_tokenizer(tiny_llama):
    tok = load_model(tiny_llama[0]).tokenizer
    for text in TEXTS.values():
        ids = tok.encode(text)
        stream = tok.stream()
        out = "".join(stream.push(i) for i in ids) + stream.flush()
        assert out == tok.decode(ids)


def test_gguf_and_folder_tokenizers_agree(tiny_llama):
    folder, gguf_path = tiny_llama
    a, b = load_model(folder).tokenizer, load_model(gguf_path).tokenizer
    for text in TEXTS.values():
        assert a.encode(text) == b.encode(text)
    assert a.eos_ids == b.eos_ids


def test_chat_template_is_sandboxed():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TokenizerError):
        render_template(evil, messages=[])
    with pytest.raises(TokenizerError):
        render_template("{{ raise_exception('no system role') }}", messages=[])


def test_spm_vocab_from_gguf_metadata():
    """A llama SentencePiece vocab (tokens + scores + byte fallback) built from GGUF-style metadata."""
    from edgellm.tokenizer import _gguf_spm

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "ld", "orld", "▁world"]
    scores = [0.0] * 259 + [-1, -2, -2, -2, -2, -2, -2, -2, -3, -3, -4, -5, -1.5, -3, -3, -3, -2.5, -1.2]
    types = [2, 3, 3] + [6] * 256 + [1] * 18
    tok = _gguf_spm(tokens, scores, types, add_space_prefix=True)
    enc = tok.encode("hello world", add_special_tokens=False)
    assert enc.tokens == ["▁hello", "▁world"]
    assert tok.decode(enc.ids) == "hello world"
    emoji = tok.encode("hi😀", add_special_tokens=False)
    assert "<0xF0>" in emoji.tokens  # unknown characters fall back to bytes
    assert tok.decode(emoji.ids) == "hi😀"


def test_llama3_vocabulary_takes_a_word_that_is_a_token_whole():
    """Llama 3's vocabulary (tiktoken's) has tokens no merge builds; llama.cpp (ignore_merges for the llama-bpe
    pre-tokenizers) and HF's tokenizer.json take a pre-token that is a token as that token. Its vocab test
    "Cửa Việt" → [34, 91163, 101798] came out as 5 tokens before (benchmarks/tokenizer_vs_llamacpp.py runs them
    all). Other vocabularies keep their merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    from edgellm.tokenizer import _gguf_bpe

    tokens = sorted(ByteLevel.alphabet()) + ["Ġw", "or", "Ġwor", "Ġworld"]  # no merge makes "Ġworld"
    merges = ["Ġ w", "o r", "Ġw or"]
    for pre, expected in (("llama-bpe", ["Ġworld"]), ("llama3", ["Ġworld"]), ("qwen2", ["Ġwor", "l", "d"])):
        assert _gguf_bpe(tokens, merges, pre).encode(" world").tokens == expected, pre


@pytest.mark.parametrize("pre, pieces", [
    ("tekken", ["Hello", "World", " I", "'M", " ", "1", "2", "3", "4", "5", " x", "/y", "\n"]),
    ("gpt-4o", ["Hello", "World", " I'M", " ", "123", "45", " x", "/y", "\n"]),
    ("llama-bpe", ["HelloWorld", " I", "'M", " ", "123", "45", " x", "/y", "\n"]),
])
def test_pre_tokenizers_split_words_as_llama_cpp(pre, pieces):
    """The GGUF pre-tokenizer names of Mistral Nemo / Small 3 (tekken), Phi-4-mini / Llama 4 (gpt-4o, llama4) and
    Llama 3 split text as llama.cpp does: case changes, digit groups, contractions. (These splits gave llama.cpp's
    own ids on its test strings with Llama 3's vocabulary relabelled: benchmarks/tokenizer_vs_llamacpp.py
    --peer-python.)"""
    from tokenizers.pre_tokenizers import ByteLevel

    from edgellm.tokenizer import _gguf_bpe

    backend = _gguf_bpe(sorted(ByteLevel.alphabet()), [], pre)
    split = backend.pre_tokenizer.pre_tokenize_str("HelloWorld I'M 12345 x/y\n")
    byte_level = ByteLevel(add_prefix_space=False, use_regex=False)
    assert [p for p, _ in split] == ["".join(q for q, _ in byte_level.pre_tokenize_str(p)) for p in pieces]
