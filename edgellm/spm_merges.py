"""The merges of a SentencePiece BPE vocabulary that GGUF stores as pieces and scores only (Llama 2, Mistral,
Gemma, Phi-3): every split of a piece into two pieces of the vocabulary, ranked as sentencepiece applies them.

A Gemma vocabulary (262k pieces) has 1.2M (piece, cut) candidates and 515k merges; trying each as Python strings
took 1.3-1.5 s of every load. Here the candidates are screened in numpy with a 64-bit polynomial hash of every
prefix, each hit is confirmed character by character against the piece its hash found, and the merges are pairs
of the pieces' own strings (no string is cut). Exact: equal strings hash alike, so no merge is missed, and
the confirmation drops any collision; a vocabulary whose own pieces collide takes the plain loop
(`merges_by_loop`), which is the definition.
"""
from __future__ import annotations

import numpy as np

__all__ = ["spm_merges", "merges_by_loop"]

MULTIPLIER = np.uint64(0x100000001B3)  # odd: every step of the hash is a bijection modulo 2**64


def merges_by_loop(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) with left + right a piece and both pieces, by the piece's score, highest first (ties:
    the piece's id in `vocab`, then the shorter left)."""
    merges = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[piece], left, right))
    merges.sort(key=lambda m: (-m[0], m[1]))
    return [(a, b) for _, _, a, b in merges]


def spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`merges_by_loop`'s list, made in numpy. `vocab`: piece → id (the last id of a piece listed twice)."""
    n = len(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    joined = "".join(tokens)
    if n == 0 or lengths.max() < 2:
        return merges_by_loop(tokens, scores, vocab)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    chars = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    prefix = _prefix_hashes(chars.astype(np.uint64) + np.uint64(1), starts, lengths)
    pieces = np.flatnonzero(lengths > 0)
    whole = np.zeros(n, dtype=np.uint64)
    whole[pieces] = prefix[starts[pieces] + lengths[pieces] - 1]
    order = pieces[np.argsort(whole[pieces], kind="stable")]
    table = whole[order]
    same = np.flatnonzero(table[1:] == table[:-1])
    if any(tokens[order[i]] != tokens[order[i + 1]] for i in same):  # two pieces share a hash
        return merges_by_loop(tokens, scores, vocab)

    def found(hashes: np.ndarray, begin: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The piece chars[begin : begin + length] is, or -1 (its hash in the table, then its characters)."""
        by_hash = np.argsort(hashes)  # sorted keys: numpy's search starts each from the last (2.5x faster here)
        at = np.empty(len(hashes), dtype=np.int64)
        at[by_hash] = np.minimum(np.searchsorted(table, hashes[by_hash]), len(table) - 1)
        hit = np.flatnonzero(table[at] == hashes)
        match = order[at[hit]]
        same_length = lengths[match] == length[hit]
        hit, match = hit[same_length], match[same_length]
        same_chars = _equal_runs(chars, begin[hit], starts[match], length[hit])
        piece_id = np.full(len(hashes), -1, dtype=np.int64)
        piece_id[hit[same_chars]] = match[same_chars]
        return piece_id

    cuts_per = np.maximum(lengths - 1, 0)
    piece = np.repeat(np.arange(n), cuts_per)  # one row per (piece, cut)
    cut = np.arange(len(piece)) - np.repeat(np.cumsum(cuts_per) - cuts_per, cuts_per) + 1
    left = prefix[starts[piece] + cut - 1]
    left_id = found(left, starts[piece], cut)
    keep = left_id >= 0
    piece, cut, left, left_id = piece[keep], cut[keep], left[keep], left_id[keep]
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64
        powers = np.cumprod(np.full(int(lengths.max()), MULTIPLIER, dtype=np.uint64))
        right = whole[piece] - left * np.concatenate(([np.uint64(1)], powers))[lengths[piece] - cut]
    right_id = found(right, starts[piece] + cut, lengths[piece] - cut)
    keep = right_id >= 0
    piece, cut, left_id, right_id = piece[keep], cut[keep], left_id[keep], right_id[keep]
    ids = piece if len(vocab) == n else np.fromiter(map(vocab.__getitem__, tokens), dtype=np.int64, count=n)[piece]
    rank = np.lexsort((cut, ids, -np.asarray(scores, dtype=np.float64)[piece]))
    lefts = map(tokens.__getitem__, left_id[rank].tolist())  # the pieces' own strings: none made here
    rights = map(tokens.__getitem__, right_id[rank].tolist())
    return list(zip(lefts, rights))


def _prefix_hashes(codes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """At each character, the hash of its piece up to and including it (Horner, modulo 2**64)."""
    out = np.empty_like(codes)
    with np.errstate(over="ignore"):
        for p in range(int(lengths.max())):
            at = starts[lengths > p] + p
            out[at] = codes[at] if p == 0 else out[at - 1] * MULTIPLIER + codes[at]
    return out


def _equal_runs(chars: np.ndarray, a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """chars[a[i] : a[i] + length[i]] == chars[b[i] : b[i] + length[i]] for each i (lengths >= 1)."""
    if len(length) == 0:
        return np.zeros(0, dtype=bool)
    first = np.cumsum(length) - length
    step = np.arange(int(length.sum())) - np.repeat(first, length)
    equal = chars[np.repeat(a, length) + step] == chars[np.repeat(b, length) + step]
    return np.logical_and.reduceat(equal, first)
