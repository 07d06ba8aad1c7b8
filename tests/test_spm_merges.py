"""The merges of a SentencePiece vocabulary stored as pieces and scores (Llama 2, Mistral, Gemma, Phi-3 GGUFs):
the numpy derivation is the plain definition's list, item for item, and the tokenizer built from it encodes as
sentencepiece itself does."""
import io
import random

import pytest

from edgellm import spm_merges as sm
from edgellm.spm_merges import merges_by_loop, spm_merges

TEXT = "/usr/share/common-licenses/GPL-3"


def random_vocab(seed: int, size: int = 3000) -> tuple[list[str], list[float]]:
    """Pieces grown by concatenation (so most have several splits), with astral and combining characters, a
    piece listed twice, long pieces, and scores with ties."""
    rng = random.Random(seed)
    alphabet = list("abcde▁") + ["é", "😀", "\u0301", "中"]
    tokens = list(alphabet)
    while len(tokens) < size:
        t = rng.choice(tokens) + rng.choice(tokens)
        if len(t) <= 40:
            tokens.append(t)
    tokens += ["ab", "x" * 300, "x" * 150, "x" * 150 + "a"]  # "ab" twice; a long piece and its halves
    return tokens, [float(rng.randint(-50, 0)) for _ in tokens]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spm_merges_is_the_definition(seed):
    tokens, scores = random_vocab(seed)
    vocab = {t: i for i, t in enumerate(tokens)}
    expected = merges_by_loop(tokens, scores, vocab)
    assert len(expected) > 1000
    assert spm_merges(tokens, scores, vocab) == expected


def test_spm_merges_confirms_what_the_hashes_find(monkeypatch):
    """A multiplier of 1 makes the hash a sum of character codes: substrings that are no piece collide with pieces
    ("ba" with "ab") and are dropped by the character check; pieces that collide with each other send the whole
    vocabulary to the loop. Either way the list is the definition's."""
    monkeypatch.setattr(sm, "MULTIPLIER", sm.np.uint64(1))
    tokens = ["a", "b", "c", "ab", "abc", "bab"]  # "ba" (in "bab") sums as "ab" but is no piece
    scores = [-1.0, -1.0, -1.0, -2.0, -3.0, -4.0]
    vocab = {t: i for i, t in enumerate(tokens)}
    calls = []
    monkeypatch.setattr(sm, "merges_by_loop", lambda *a: calls.append(1) or merges_by_loop(*a))
    assert spm_merges(tokens, scores, vocab) == merges_by_loop(tokens, scores, vocab) == [
        ("a", "b"), ("ab", "c"), ("b", "ab")]
    assert not calls  # the character check, not the loop
    tokens, scores = random_vocab(3, size=500)  # here pieces collide with pieces
    vocab = {t: i for i, t in enumerate(tokens)}
    assert spm_merges(tokens, scores, vocab) == merges_by_loop(tokens, scores, vocab)
    assert calls


def test_spm_merges_of_small_and_odd_vocabularies():
    for tokens in (["a", "b", "a\0b", "\0b", "a\0"], ["a"], []):
        scores = [-float(i) for i in range(len(tokens))]
        vocab = {t: i for i, t in enumerate(tokens)}
        assert spm_merges(tokens, scores, vocab) == merges_by_loop(tokens, scores, vocab)


@pytest.mark.parametrize("vocab_size", [800, 2000])
def test_gguf_spm_vocab_encodes_as_sentencepiece(vocab_size):
    """A BPE model trained by sentencepiece with Llama's settings (no normalization, whitespace kept, byte
    fallback), given to edgellm as GGUF stores it (pieces, scores, types): the same ids as sentencepiece's own
    encoder on every line of the GPL, on runs of spaces, digits, emoji and characters it never saw."""
    spm = pytest.importorskip("sentencepiece")
    from edgellm.tokenizer import _gguf_spm

    lines = [ln for ln in open(TEXT, encoding="utf-8").read().splitlines() if ln.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, num_threads=1, minloglevel=2, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        hard_vocab_limit=False)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    tok = _gguf_spm([sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], types,
                    add_space_prefix=True)
    samples = lines + ["Hello wörld 😀, the GNU  General\tPublic License", "   three spaces", "x" * 50,
                       "1234567890", "ﬁ ligature Ⅻ 中文"]
    for s in samples:
        assert tok.encode(s, add_special_tokens=False).ids == sp.encode(s), s
