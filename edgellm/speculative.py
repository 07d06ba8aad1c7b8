"""Speculative decoding: draft proposers and exact verification (Leviathan et al. 2023; Chen et al. 2023).

A proposer guesses the next k tokens cheaply; the target checks all of them in one forward pass over
[last token + k drafts] (T = k+1), which at batch 1 costs little more than one decode step because
decode is memory-bound. Acceptance is exact:
  greedy    accept while draft == target argmax (after the repetition penalty the plain path applies);
  sampling  accept draft d with probability min(1, p(d)/q(d)); on the first rejection draw from
            norm(max(0, p - q)); when every draft is accepted, draw a bonus token from the last position.
p and q come from `sampling.probabilities` with the same settings, so temperature / top-k / top-p / min-p
are applied identically to both, and the emitted tokens follow exactly the target's distribution.

Proposers (one interface, `propose(context_ids, k) -> (tokens [k'], probs [k', V] | None)`):
  DraftModelProposer   any model edgellm loads that shares the target's tokenizer; its own KV cache,
                       kept in sync with the accepted tokens by a common-prefix check (truncate on rejection).
  SelfDraftProposer    an int4 (group 32) copy of the target's layers, optionally only the first n, sharing
                       the target's embedding, norms and RoPE tables; by default it also reads the target's
                       KV cache for the accepted context (no draft prefill, no second cache) and writes its
                       K/V for the guessed positions there, which the verification pass then overwrites.
  PromptLookupProposer n-gram match of the last tokens against prompt + text so far; no model, one-hot q.

The engine (generate.py) owns the one loop, plain decoding being speculation with no drafts; `Drafting`
is an answer's speculative side: it asks a `GammaController` how many drafts to request, gets them from
the proposer and verifies them; the engine runs the verification pass, rolls the cache back with
`truncate`, and emits tokens through the same stop checks as a plain step's, so stops inside an accepted
run behave exactly as without speculation.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .cache import KVCache
from .decode_step import Decoder
from .device import now, prefill_chunk
from .errors import EdgeLLMError
from .quant.linear import set_kernel_options
from .sampling import Sampler, SamplingSettings, apply_repeat_penalty, argmax, probabilities

__all__ = ["Proposer", "DraftModelProposer", "SelfDraftProposer", "PromptLookupProposer", "GammaController",
           "VerifyCosts", "Drafting", "make_proposer", "build_self_draft", "check_tokenizers", "residual",
           "verify_greedy", "verify_sampled", "max_draft_tokens", "GAMMA_MIN", "GAMMA_MAX", "GAMMA_START"]

GAMMA_START, GAMMA_MIN, GAMMA_MAX = 4, 1, 16


# ------------------------------------------------------------------------------------------------
# The interface
# ------------------------------------------------------------------------------------------------
class Proposer:
    """Guesses the next tokens. The engine calls `bind(engine)` once, `begin(...)` at the start of each
    generation, then `propose(context, k)` once per round. Between two `begin` calls the context only
    grows by appending (accepted tokens); a proposer may rely on that to keep its state in sync."""

    name = "draft"
    # True where proposing costs nothing (prompt lookup): the engine then asks for as many tokens as it could
    # verify and lets the γ controller cut the proposal to the length that pays for this kind of guess
    free_proposals = False
    # what kind of guess the last `propose` made (lookup: the length of the matched n-gram), or None;
    # the γ controller keeps a separate acceptance estimate per kind
    kind: Any = None

    def bind(self, engine: Any) -> None:
        """Called by Engine.__init__: the target model, its cache and device are `engine.model` etc."""
        self.target_vocab = engine.model.config.vocab_size
        self.device = engine.device
        self.engine = engine  # its compile_mode applies to a draft model's steps too

    def begin(self, prompt: list[int], settings: SamplingSettings, sampler: Sampler) -> None:
        self.settings, self.sampler = settings, sampler

    def propose(self, context: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to k guessed next tokens (1-D long tensor, maybe fewer, maybe none) and the distribution
        each was drawn from, [k', target vocab] (None: one-hot on the tokens, i.e. deterministic)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget any state tied to the engine's cache (Engine.reset)."""


def _empty(device) -> tuple[torch.Tensor, None]:
    return torch.empty(0, dtype=torch.long, device=device), None


# ------------------------------------------------------------------------------------------------
# Draft models
# ------------------------------------------------------------------------------------------------
def check_tokenizers(draft_tok: Any, target_tok: Any, draft_vocab: int, target_vocab: int,
                     draft_name: str = "the draft model", target_name: str = "the target model") -> int:
    """Refuse a draft whose token ids mean other strings than the target's. Returns the number of ids
    compared (the common prefix of the two embedding tables: padding rows beyond it are never drafted)."""
    n = min(draft_vocab, target_vocab)

    def id_to_str(tok: Any) -> dict[int, str]:
        backend = getattr(tok, "backend", None)
        if backend is not None and hasattr(backend, "get_vocab"):
            return {i: s for s, i in backend.get_vocab(with_added_tokens=True).items() if i < n}
        return {i: s for i in range(n) if (s := tok.id_to_token(i)) is not None}

    d, t = id_to_str(draft_tok), id_to_str(target_tok)
    if not d or not t:
        raise EdgeLLMError(f"{draft_name}: cannot read its tokenizer's vocabulary to check it against {target_name}")
    bad = [i for i in sorted(set(d) | set(t)) if d.get(i) != t.get(i)]
    if bad:
        i = bad[0]
        raise EdgeLLMError(
            f"{draft_name}: its tokenizer does not match {target_name}'s ({len(bad)} of {n} token ids differ, "
            f"first id {i}: {d.get(i)!r} vs {t.get(i)!r}); a draft model must share the target's tokenizer")
    return n


class DraftModelProposer(Proposer):
    """A smaller model of the same tokenizer, with its own KV cache (or, `share_cache=True`, writing its
    guesses into the target's cache: only for drafts whose layers mirror the target's, see SelfDraftProposer)."""

    name = "model"

    def __init__(self, model: Any, tokenizer: Any = None, target_tokenizer: Any = None,
                 max_seq_len: int | None = None, share_cache: bool = False, name: str | None = None):
        self.model = model
        self.name = name or self.name
        self.share_cache = share_cache
        self.common_vocab = model.config.vocab_size
        self._target_tokenizer_check = (tokenizer, target_tokenizer)
        self.max_seq_len = max_seq_len
        self.cache: KVCache | None = None
        self.ids: list[int] = []  # tokens whose K/V the draft's own cache holds
        self._trusted = 0  # ids[:_trusted] are known to equal the current context's prefix
        self.settings, self.sampler = SamplingSettings(), None
        self.decoder = Decoder(model)  # the draft's one-token steps: fused C++ on CPU, a CUDA graph on CUDA

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        self.decoder = Decoder(self.model, engine.options)  # the draft runs with the target's settings
        set_kernel_options(self.model, engine.options.kernel)
        tok, target_tok = self._target_tokenizer_check
        if tok is not None and target_tok is not None:
            self.common_vocab = check_tokenizers(tok, target_tok, self.model.config.vocab_size, self.target_vocab)
        else:
            self.common_vocab = min(self.model.config.vocab_size, self.target_vocab)
        if self.share_cache:
            self.cache = engine.cache
        else:
            n = min(self.max_seq_len or engine.max_seq_len, self.model.rope_len, engine.max_seq_len)
            if self.cache is None or self.cache.max_seq_len != n:
                self.cache = KVCache(self.model.config, n, self.model.dtype, self.model.device)
        self.reset()

    def reset(self) -> None:
        if self.cache is not None and not self.share_cache:
            self.cache.reset()
        self.ids, self._trusted = [], 0

    def begin(self, prompt: list[int], settings: SamplingSettings, sampler: Sampler) -> None:
        """Prefill the draft's own cache with the prompt (only what its kept prefix lacks)."""
        super().begin(prompt, settings, sampler)
        self._trusted = 0  # a new prompt: compare the whole kept prefix once
        if not self.share_cache and prompt and len(prompt) <= self.cache.max_seq_len:
            with torch.no_grad():
                self._sync(prompt)

    # -- keeping the draft's own cache in step with the context --------------------------------------
    def _sync(self, context: list[int]) -> torch.Tensor:
        """Feed the draft the part of `context` its cache lacks; the logits after the last token [V_d]."""
        m = min(len(self.ids), len(context) - 1, self.cache.length)
        n = min(self._trusted, m)
        while n < m and self.ids[n] == context[n]:
            n += 1
        self.cache.truncate(n)
        del self.ids[n:]
        logits, size = None, prefill_chunk(self.model.device, self.model.config.intermediate_size)
        for i in range(n, len(context), size):
            chunk = context[i:i + size]
            x = torch.tensor([chunk], dtype=torch.long, device=self.model.device)
            logits = self.model(x, self.cache, i, logits=i + size >= len(context))
            self.ids.extend(chunk)
        self._trusted = len(context)
        return logits[0, -1]

    def _room(self, context: list[int], k: int) -> int:
        """How many drafts fit: feeding d1..d_{k-1} after the context must fit the cache."""
        return min(k, self.cache.max_seq_len - len(context) + 1)

    # -- proposing -----------------------------------------------------------------------------------
    def propose(self, context: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = self._room(context, k)
        if k <= 0 or not context:
            return _empty(self.device)
        with torch.no_grad():
            return self._draft(context, k)

    def _draft(self, context: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.settings
        if self.share_cache:
            start = len(context) - 1
            if self.cache.length != start:
                raise RuntimeError(f"shared-cache draft: the target cache holds {self.cache.length} positions, "
                                   f"expected {start}")
            x = torch.tensor([[context[-1]]], dtype=torch.long, device=self.model.device)
            logits = self.decoder(x, self.cache, start, self.engine.compile_mode)
        else:
            start = len(context) - 1
            logits = self._sync(context)
        penalty = s.repeat_penalty != 1.0
        history = context[-s.repeat_last_n:] if penalty else []
        tokens: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            lg = logits[:self.common_vocab]
            if penalty:
                recent = torch.tensor(history[-s.repeat_last_n:] if history else [], dtype=torch.long,
                                      device=lg.device)
                lg = apply_repeat_penalty(lg, recent[recent < lg.shape[-1]], s.repeat_penalty)
            if s.greedy:
                tok = argmax(lg)
            else:
                q = probabilities(lg, s)
                tok = self.sampler.draw(q.to(self.sampler.generator.device)).to(lg.device)
                qs.append(q)
            tokens.append(tok)
            if penalty:
                history.append(int(tok))
            if i + 1 < k:  # (the step's logits buffer is reused: lg and q are done with by now)
                logits = self.decoder(tok.view(1, 1), self.cache, start + 1 + i, self.engine.compile_mode)
        out = torch.stack(tokens)
        if self.share_cache:
            self.cache.truncate(start)  # the verification pass rewrites these positions with the target's K/V
        else:
            self.ids.extend(out[:-1].tolist())
        probs = None
        if qs:
            probs = torch.stack(qs)
            if probs.shape[-1] != self.target_vocab:
                probs = F.pad(probs, (0, self.target_vocab - probs.shape[-1]))
            probs = probs.to(self.device)
        return out.to(self.device), probs


# ------------------------------------------------------------------------------------------------
# Self-draft: an int4 copy of the target (optionally its first n layers)
# ------------------------------------------------------------------------------------------------
def _quant_copy(module: torch.nn.Module, bits: int, group_size: int, symmetric: bool, search: bool):
    """An int-`bits` copy of a linear (float or already quantized); an already quantized linear that is
    at least as small is shared, not copied."""
    from .quant.groups import quantize
    from .quant.linear import QuantLinear

    if isinstance(module, QuantLinear):
        if module.bits <= bits and module.group_size <= group_size:
            return module
        with torch.no_grad():
            w = module.dequantized_weight(torch.float32)
            qt = quantize(w, bits, group_size, symmetric=symmetric or bits == 8, search=search)
        bias = None if module.bias is None else module.bias.clone()
        return QuantLinear(qt, bias)
    if hasattr(module, "gguf_parts"):  # GGUF blocks as stored (K-quants, ...): requantize a float copy
        with torch.no_grad():
            qt = quantize(module.dequantized_weight(torch.float32), bits, group_size,
                          symmetric=symmetric or bits == 8, search=search)
        return QuantLinear(qt, None if module.bias is None else module.bias.clone())
    return QuantLinear.from_linear(module, bits, group_size, symmetric=symmetric or bits == 8, search=search)


def build_self_draft(target: torch.nn.Module, bits: int = 4, group_size: int = 32, n_layers: int | None = None,
                     symmetric: bool = False, search: bool = True, head_bits: int = 8) -> torch.nn.Module:
    """A Transformer whose layers are int4 (group 32) copies of the target's first `n_layers` layers and
    whose embedding, norms and RoPE tables are the target's own tensors (not copies). The LM head is an
    int`head_bits` copy (int8 g32 by default, as `--embeddings` defaults for quantized models: an int4 head
    cost the bundled model ~10 points of acceptance for 0.3 ms less per draft token). The target keeps
    its weights."""
    from .model import Transformer

    cfg = target.config
    n = cfg.n_layers if n_layers is None else n_layers
    if not 1 <= n <= cfg.n_layers:
        raise EdgeLLMError(f"self-draft: {n} layers asked, the model has {cfg.n_layers}")
    with torch.device("meta"):
        draft = Transformer(dataclasses.replace(cfg, n_layers=n, layer_windows=cfg.layer_windows[:n]))
    draft.tok_embeddings = target.tok_embeddings
    draft.norm = target.norm
    q = dict(bits=bits, group_size=group_size, symmetric=symmetric, search=search)
    for i in range(n):
        src, dst = target.layers[i], draft.layers[i]
        for norm in ("attention_norm", "ffn_norm", "post_attention_norm", "post_ffn_norm"):  # (post: Gemma)
            if hasattr(src, norm):
                setattr(dst, norm, getattr(src, norm))
        for norm in ("q_norm", "k_norm"):  # Qwen3, Gemma 3
            if hasattr(src.attention, norm):
                setattr(dst.attention, norm, getattr(src.attention, norm))
        dst.attention.wqkv = _quant_copy(src.attention.wqkv, **q)
        dst.attention.wo = _quant_copy(src.attention.wo, **q)
        dst.feed_forward.w13 = _quant_copy(src.feed_forward.w13, **q)
        dst.feed_forward.w2 = _quant_copy(src.feed_forward.w2, **q)
    draft.output = _quant_copy(target.output, **{**q, "bits": max(bits, head_bits)})
    draft.register_buffer("rope_cos", target.rope_cos, persistent=False)
    draft.register_buffer("rope_sin_signed", target.rope_sin_signed, persistent=False)
    if hasattr(target, "rope_cos_local"):  # Gemma 3's sliding layers
        draft.register_buffer("rope_cos_local", target.rope_cos_local, persistent=False)
        draft.register_buffer("rope_sin_local", target.rope_sin_local, persistent=False)
    draft.rope_len = target.rope_len
    left = [name for name, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"self-draft left tensors unset: {left[:3]}")
    return draft.eval().requires_grad_(False)


class SelfDraftProposer(DraftModelProposer):
    """The target's own int4 copy as the draft (`--draft self`, `self:int4`, `self:int4:L<n>`)."""

    def __init__(self, target: torch.nn.Module, bits: int = 4, group_size: int = 32, n_layers: int | None = None,
                 share_cache: bool = True, symmetric: bool = False, search: bool = False):
        draft = build_self_draft(target, bits, group_size, n_layers, symmetric, search)
        n = draft.config.n_layers
        name = f"self:int{bits}" + (f":L{n}" if n != target.config.n_layers else "")
        super().__init__(draft, share_cache=share_cache, name=name)
        self.target = target

    def bind(self, engine: Any) -> None:
        if self.share_cache and engine.model is not self.target:
            raise EdgeLLMError("a self-draft sharing the KV cache must be used with the model it was built from")
        super().bind(engine)


# ------------------------------------------------------------------------------------------------
# Prompt lookup
# ------------------------------------------------------------------------------------------------
class PromptLookupProposer(Proposer):
    """Find the last tokens earlier in prompt + output and propose what followed them. Summaries, edits and
    code repeat their input, so this costs nothing and is often right.

    The match: the longest n-gram (n = max_ngram..min_ngram) ending the context that occurred before; for a
    full max_ngram match, the occurrence (of the last `SCAN` ones) whose agreement with the context goes
    furthest back (up to `max_match` tokens; ties: the latest), else the latest occurrence. The kind of the
    guess is that agreement's length, bucketed (`MATCH_KINDS`): the γ controller keeps one acceptance
    estimate per kind, because a longer agreement is likelier to go on (replay of the bundled model's answer
    to benchmarks/speculative.py's edit prompt: the first guess was right 36% of the time after a 1-token
    agreement, 64% after 2, 88-92% after 3-9 (runs of 5-6 tokens on average), 78% after 10 or more).

    Edits and rewrites copy a source with changes (a corrected word, an inserted comma). Once the answer has
    followed a guess for `MIN_RUN` tokens, the source position it has reached is its cursor. Where the
    answer then leaves the source and the last tokens agree for fewer than 3 tokens with anything earlier:
    - a short match is taken at its occurrence nearest the cursor, not the latest (kind "near");
    - with no match at all, within `RESYNC_AFTER` tokens of leaving, the source resumes one token past the
      cursor (a substituted word), or at it when the answer's token is punctuation and the source's a word
      (an inserted comma) (kind "resync"; each resume position is guessed once).
    benchmarks/lookup_replay.py (17 greedy answers of the bundled model: edits, summaries, rewrites, code,
    chat; the CPU's verification costs): edits 1.45x -> 1.60x and 1.92x -> 2.45x, the rest -4..+2% (chat and
    code lose 1-3% to guesses that do not pay), geometric mean 1.262x -> 1.280x (an oracle γ on the same
    guesses: 1.572x -> 1.635x).
    A guess stops after an end-of-turn token: nothing after it is ever generated."""

    name = "lookup"
    free_proposals = True
    MATCH_KINDS = (1, 2, 3, 4, 7)  # kind = the largest of these ≤ the agreement's length
    SCAN = 16  # occurrences of the max_ngram-gram compared, latest first
    # the γ controller's starting (accepted, first rejections) per kind, before this answer has shown any:
    # roughly the replays' rates above, light enough that a few rounds of the answer outweigh them; a 2-token
    # agreement starts at α 0.5, below its 64% on edits: in chat such matches are common phrases that do not
    # go on, and a first verified guess costs ~1.4x a further one (replay of 19 answers at the measured costs:
    # 1.180x -> 1.197x overall)
    KIND_PRIORS = {1: (0.5, 1.5), 2: (1.0, 1.0), 3: (3.0, 1.0), 4: (6.0, 1.0), 7: (6.0, 1.0),
                   "near": (2.0, 1.0), "resync": (1.5, 1.0)}  # replays: first guess right 54% / 44%
    MIN_RUN = 2  # tokens the answer must follow a guess before its source position is trusted as the cursor
    NEAR_WINDOW = 8  # a "near" occurrence ends at most this far past the cursor
    RESYNC_AFTER = 2  # resume the source only this soon after leaving it (later: the answer has moved on)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_match: int = 32):
        self._tokenizer: Any = None  # set by bind: without it (bare use), a resync always skips a token
        self._stops: frozenset[int] = frozenset()
        self._texts: dict[int, str] = {}
        if not 1 <= min_ngram <= max_ngram <= max_match:
            raise EdgeLLMError(f"prompt lookup: bad n-gram range {min_ngram}..{max_ngram} (max_match {max_match})")
        self.ngrams = range(max_ngram, min_ngram - 1, -1)
        self.max_match = max_match
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []
        # n → {n-gram: starts of its occurrences that have a following token, oldest first}
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.ngrams}
        self._trusted = 0
        # (source position, context length) of the last guess; of the last one the answer followed:
        # (source position reached, context position reached, its context length, where it started)
        self._guess: tuple[int, int] | None = None
        self._anchor: tuple[int, int, int, int] | None = None
        self._resumed: int | None = None  # the last source position a "resync" guess resumed at

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        self._tokenizer = engine.tokenizer  # token texts for _resume_at
        self._stops = frozenset(engine.tokenizer.eos_ids)

    def begin(self, prompt: list[int], settings: SamplingSettings, sampler: Sampler) -> None:
        super().begin(prompt, settings, sampler)
        self._trusted = 0
        self._guess = self._anchor = self._resumed = None  # a new answer: no cursor yet

    def kind_prior(self, kind: Any) -> tuple[float, float]:
        return self.KIND_PRIORS.get(kind, (1.5, 1.0))

    def _sync(self, context: list[int]) -> None:
        m = min(len(self.ids), len(context))
        n = min(self._trusted, m)
        while n < m and self.ids[n] == context[n]:
            n += 1
        if n < len(self.ids):  # the context diverged from what we indexed: start over (rare: new chat)
            self.reset()
        start = len(self.ids)
        self.ids.extend(context[start:])
        ids = self.ids
        # an n-gram is indexed once the token after it exists (so the current suffix never matches itself)
        for q in range(max(start, 1), len(ids)):
            for n_ in self.ngrams:
                if q - n_ >= 0:
                    self.index[n_].setdefault(tuple(ids[q - n_:q]), []).append(q - n_)
        self._trusted = len(context)

    def _agreement(self, context: list[int], p: int, n: int) -> int:
        """How many tokens before (and including) the n-gram at p agree with the end of the context."""
        L, end = n, len(context)
        while L < self.max_match and p - (L - n) - 1 >= 0 and context[p - (L - n) - 1] == context[end - L - 1]:
            L += 1
        return L

    def _follow(self, j: int, t: int, limit: int, context: list[int]) -> tuple[int, int]:
        """Walk source position j (< limit) and context position t on while the context repeats the source:
        the (source position, context position) reached."""
        while t < len(context) and j < limit and context[t] == self.ids[j]:
            j, t = j + 1, t + 1
        return j, t

    def _cursor(self, context: list[int]) -> tuple[int | None, int]:
        """(the source position the answer has reached, tokens written since it left the source), or
        (None, 0) where no guess has been followed for MIN_RUN tokens or the answer has long moved on.
        The anchor keeps how far it has been followed, so each call walks only the new tokens."""
        if self._anchor is not None:
            j, t, limit, t0 = self._anchor
            self._anchor = (*self._follow(j, t, limit, context), limit, t0)
        if self._guess is not None:  # followed for a token at least: the new anchor, unless it only goes
            start, n = self._guess  # on the anchor's own run (reaching no further)
            j, t = self._follow(start, n, n, context)
            if t > n and (self._anchor is None or self._anchor[1] < t):
                self._anchor = (j, t, n, n)
            self._guess = None
        if self._anchor is None:
            return None, 0
        j, t, _, t0 = self._anchor
        if t - t0 < self.MIN_RUN:
            return None, 0
        if len(context) - t > self.RESYNC_AFTER + 3:
            self._anchor = None
            return None, 0
        return j, len(context) - t

    def _text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self._tokenizer.decode([token])
        return self._texts[token]

    def _resume_at(self, context: list[int], j: int) -> int:
        """Where the source goes on after the answer left it at j: past the source's token (a substitution),
        or at it where the answer's token is punctuation and the source's a word (an insertion)."""
        if self._tokenizer is not None:
            mine, theirs = self._text(context[-1]).strip(), self._text(context[j]).strip()
            if mine and not any(c.isalnum() for c in mine) and theirs[:1].isalnum():
                return j
        return j + 1

    def propose(self, context: list[int], k: int) -> tuple[torch.Tensor, None]:
        self._sync(context)
        self.kind = None
        if k <= 0:
            return _empty(self.device)
        cursor, since = self._cursor(context)
        weak = None  # a short match far from the cursor: the guess of last resort
        for n in self.ngrams:
            if len(context) <= n:
                continue
            starts = self.index[n].get(tuple(context[-n:]))
            if not starts:
                continue
            p, agree = starts[-1], n
            if n == self.ngrams[0]:  # a full match: the occurrence that agrees furthest back
                for q in reversed(starts[-self.SCAN:]):
                    a = self._agreement(context, q, n)
                    if a > agree:
                        p, agree = q, a
            kind = max(b for b in self.MATCH_KINDS if b <= agree)
            if agree >= 3 or cursor is None:
                return self._guess_from(context, p + n, k, kind)
            near = starts[bisect.bisect_left(starts, cursor - n):bisect.bisect_right(starts, cursor + self.NEAR_WINDOW)]
            if near:
                return self._guess_from(context, min(near, key=lambda q: abs(q + n - cursor)) + n, k, "near")
            weak = weak or (p + n, kind)
        if cursor is not None and 0 < since <= self.RESYNC_AFTER:
            s = self._resume_at(context, cursor)
            if s < len(context) - since and s != self._resumed:
                self._resumed = s
                return self._guess_from(context, s, k, "resync")
        if weak is not None:
            start, kind = weak
            return self._guess_from(context, start, k, kind)
        return _empty(self.device)

    def _guess_from(self, context: list[int], start: int, k: int, kind: Any) -> tuple[torch.Tensor, None]:
        """Up to k tokens of the context from `start`, ending after an end-of-turn token if one comes."""
        self.kind = kind
        self._guess = (start, len(context))
        cont = context[start:start + k]
        for i, t in enumerate(cont):
            if t in self._stops:
                cont = cont[:i + 1]
                break
        return torch.tensor(cont, dtype=torch.long, device=self.device), None


# ------------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------------
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to draw from after rejecting a draft: norm(max(0, p - q))."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if float(total) > 0 else p  # zero mass: rejection had probability 0 (rounding)


def _penalised(logits: torch.Tensor, history: list[int], drafts: list[int], s: SamplingSettings) -> torch.Tensor:
    """Apply the repetition penalty to each row i with the tokens before position i, as the plain path does."""
    if s.repeat_penalty == 1.0:
        return logits
    rows = []
    for i in range(logits.shape[0]):
        recent = (history + drafts[:i])[-s.repeat_last_n:]
        rows.append(apply_repeat_penalty(logits[i], torch.tensor(recent, dtype=torch.long, device=logits.device),
                                         s.repeat_penalty))
    return torch.stack(rows)


def verify_greedy(logits: torch.Tensor, drafts: list[int], history: list[int],
                  s: SamplingSettings) -> tuple[int, int]:
    """logits [γ+1, V] of the target after [last, d1..dγ]. → (drafts accepted, the target's next token)."""
    if s.repeat_penalty == 1.0:
        best = argmax(logits).tolist()
    else:  # row by row, stopping at the first mismatch: the penalty depends on the accepted prefix
        best = []
        for i in range(logits.shape[0]):
            best.append(int(argmax(_penalised(logits[i:i + 1], history + drafts[:i], [], s)[0])))
            if i < len(drafts) and best[i] != drafts[i]:
                break
    for i, d in enumerate(drafts):
        if best[i] != d:
            return i, best[i]
    return len(drafts), best[len(drafts)]


def verify_sampled(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, history: list[int],
                   s: SamplingSettings, sampler: Sampler) -> tuple[int, int]:
    """Rejection sampling. logits [γ+1, V]; q [γ, V] the draft distributions (None: one-hot on the drafts).
    → (drafts accepted, the next token drawn from the residual or, all accepted, from the last position)."""
    p = probabilities(_penalised(logits, history, drafts, s), s)
    g = len(drafts)
    if g:
        idx = torch.tensor(drafts, dtype=torch.long, device=p.device)[:, None]
        p_d = p[:g].gather(1, idx).squeeze(1)
        q_d = torch.ones_like(p_d) if q is None else q.gather(1, idx).squeeze(1)
        u = torch.rand(g, generator=sampler.generator, device=sampler.generator.device).to(p.device)
        rejected = (u * q_d >= p_d).tolist()  # accept with probability min(1, p/q)
        for i, rej in enumerate(rejected):
            if rej:
                q_i = F.one_hot(idx[i, 0], p.shape[-1]).to(p.dtype) if q is None else q[i]
                return i, int(sampler.draw(residual(p[i], q_i)))
    return g, int(sampler.draw(p[g]))


# ------------------------------------------------------------------------------------------------
# Adaptive draft length
# ------------------------------------------------------------------------------------------------
def max_draft_tokens(model: torch.nn.Module) -> int:
    """The most drafts one verification pass may check while staying exact: every position's logits must
    be computed as a one-token decode step computes them, or greedy output could differ from plain
    decoding at a near-tie. On CPU, verification goes through the fused step's multi-token call (each row
    bit for bit a one-token step) for up to 16 tokens (kernels/cpu_decode.h kDecodeMaxRows, also the int
    kernels' CPU_KERNEL_MAX_M); beyond that the model's forward would round differently. So a CPU target
    verifies at most 16 tokens (γ + 1) per pass."""
    from .kernels import matmul

    if model.device.type == "cpu":
        return min(GAMMA_MAX, matmul.CPU_KERNEL_MAX_M - 1)
    return GAMMA_MAX


@dataclasses.dataclass
class VerifyCosts:
    """What the γ controller has measured about this engine: seconds of a verification pass per T and per
    draft token (decayed means)."""
    c_verify: dict[int, float] = dataclasses.field(default_factory=dict)
    c_draft: float | None = None


class GammaController:
    """Picks γ (drafts per round) to maximise expected tokens per second:
        E[tokens | α, γ] = (1 - α^(γ+1)) / (1 - α)        (Leviathan et al. 2023, eq. 1)
        cost(γ)          = γ · c_draft + c_verify(γ + 1)
    α: acceptance rate, estimated from a decayed count of accepted drafts and of first rejections (the
    drafts after a rejection are never tested, so proposed-minus-accepted would bias α low);
    c_draft: decayed mean seconds per draft token; c_verify(T): decayed mean seconds of a verification
    pass per T seen so far, linear between and beyond the measured T (prior slope VERIFY_SLOPE · c(T)
    per extra token until two T have been measured). `fixed` pins γ (--draft-tokens N).
    Free proposals (prompt lookup) get γ per kind of guess from that kind's own α (gamma_for), and may
    get 0: no verified guess that round, a plain step."""

    DECAY = 0.9
    VERIFY_SLOPE = 0.05  # prior: each extra verified token costs 5% of a pass (memory-bound decode)
    HYSTERESIS = 1.03
    # gamma_for: one guess every 32 rounds of a kind not worth guessing for (each costs a pass's first-row
    # premium, ~1 ms on the CPU; benchmarks/lookup_replay.py, 17 answers: every 8 rounds 1.272x, 16 1.278x,
    # 32 1.280x, never 1.280x geometric mean, no answer slower at 32 than at 8)
    EXPLORE = 32
    PRIOR = (1.5, 1.0)  # decayed (accepted, first rejections) before any round: α ≈ 0.6, soon forgotten

    def __init__(self, fixed: int | None = None, start: int = GAMMA_START, lo: int = GAMMA_MIN, hi: int = GAMMA_MAX,
                 costs: VerifyCosts | None = None, kind_prior: Callable[[Any], tuple[float, float]] | None = None,
                 free: bool = False):
        """`costs`: measured costs to start from and to keep updating (an Engine's, shared by its answers:
        they belong to the model and machine, not to one prompt); α always starts from the prior.
        `kind_prior(kind)`: the (accepted, first rejections) a kind of free proposal starts from (the
        proposer's knowledge of its kinds; default PRIOR). `free`: the proposals cost nothing (prompt
        lookup), so γ is chosen per round by gamma_for and update() leaves it alone."""
        if fixed is not None and fixed < 1:
            raise EdgeLLMError(f"--draft-tokens must be at least 1 (got {fixed})")
        if fixed is not None:
            fixed = min(fixed, hi)  # beyond `hi` verification would not be exact (max_draft_tokens)
        self.fixed, self.lo, self.hi, self.free = fixed, lo, hi, free
        self.gamma = fixed if fixed is not None else min(start, hi)
        self.succ, self.fail = self.PRIOR
        self.kind_prior = kind_prior or (lambda kind: self.PRIOR)
        self.by_kind: dict[Any, list[float]] = {}  # proposal kind → its own [succ, fail], from kind_prior
        self.skipped: dict[Any, int] = {}  # proposal kind → rounds gamma_for answered 0
        self.costs = costs if costs is not None else VerifyCosts()
        self.c_verify = self.costs.c_verify  # seconds of a verification pass per T (decayed means)
        self._cost_of = [1.0] * (hi + 2)  # verify_cost(T) for T = 0..hi+1, refitted after an update
        self._stale = bool(self.c_verify)
        self.history: list[int] = []

    @property
    def alpha(self) -> float:
        return self.succ / (self.succ + self.fail)

    @property
    def c_draft(self) -> float | None:  # decayed mean seconds per draft token
        return self.costs.c_draft

    @c_draft.setter
    def c_draft(self, value: float | None) -> None:
        self.costs.c_draft = value

    def alpha_of(self, kind: Any) -> float:
        succ, fail = self.by_kind[kind] if kind in self.by_kind else self.kind_prior(kind)
        return succ / (succ + fail)

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float, kind: Any = None) -> None:
        T = proposed + 1
        old = self.c_verify.get(T)
        self.c_verify[T] = verify_s if old is None else self.DECAY * old + (1 - self.DECAY) * verify_s
        self._stale = True  # refitted when next asked (a lookup round with no guess never asks)
        if proposed:
            missed = 1.0 if accepted < proposed else 0.0
            self.succ = self.DECAY * self.succ + accepted
            self.fail = self.DECAY * self.fail + missed
            if kind is not None:
                succ, fail = self.by_kind[kind] if kind in self.by_kind else self.kind_prior(kind)
                self.by_kind[kind] = [self.DECAY * succ + accepted, self.DECAY * fail + missed]
            per = draft_s / proposed
            self.c_draft = per if self.c_draft is None else self.DECAY * self.c_draft + (1 - self.DECAY) * per
        if self.fixed is None and not self.free:
            self.gamma = self.choose()

    def _fit_verify_cost(self) -> None:
        """verify_cost(T) for T ≤ hi + 1, tabulated once per update (γ choices look it up ~20 times a round):
        a T's own decayed mean where it has been measured (the costs are not linear in T: on the CPU the first
        extra row costs ~1.5x the next ones, measured T=1..4 2.78 / 3.47 / 3.88 / 4.28 ms), else the line
        ym + slope (T - xm) fitted through the measured ones; never less than a smaller T's."""
        pts = sorted(self.c_verify.items())
        if len(pts) == 1:
            t0, c0 = pts[0]
            base = c0 / (1 + self.VERIFY_SLOPE * (t0 - 1))
            xm, ym, slope = 1.0, base, base * self.VERIFY_SLOPE
        else:
            xs = [t for t, _ in pts]
            ys = [c for _, c in pts]
            xm, ym = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - xm) ** 2 for x in xs)
            slope = max(0.0, sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / var)
        table, floor = [], 1e-9
        for T in range(1, self.hi + 2):
            floor = max(floor, self.c_verify.get(T, ym + slope * (T - xm)))
            table.append(floor)
        self._cost_of = table[:1] + table  # [0] is never asked for (T ≥ 1)
        self._stale = False

    def verify_cost(self, T: int) -> float:
        if not self.c_verify:
            return 1.0
        if self._stale:
            self._fit_verify_cost()
        if T < len(self._cost_of):
            return self._cost_of[T]
        return self._cost_of[-1] + (self._cost_of[-1] - self._cost_of[-2]) * (T - len(self._cost_of) + 1)

    def expected_tokens(self, gamma: int, alpha: float | None = None) -> float:
        a = min(max(self.alpha if alpha is None else alpha, 1e-3), 0.995)
        return (1 - a ** (gamma + 1)) / (1 - a)

    def rate(self, gamma: int, alpha: float | None = None) -> float:
        """Expected tokens per second at this γ under the current estimates."""
        cost = gamma * (self.c_draft or 0.0) + self.verify_cost(gamma + 1)
        return self.expected_tokens(gamma, alpha) / cost

    def _best(self, alpha: float) -> tuple[int, float, float]:
        """(best γ in lo..hi, its rate, the rate of γ 0) under α."""
        best = max(range(self.lo, self.hi + 1), key=lambda g: self.rate(g, alpha))
        return best, self.rate(best, alpha), self.rate(0, alpha)

    def gamma_for(self, kind: Any) -> int:
        """γ for a free proposal of this kind (Proposer.free_proposals): the best rate under that kind's own
        acceptance estimate, chosen afresh each round (no hysteresis: nothing is paid to switch). 0 (verify
        nothing, a plain step) where even one guess costs more than it is expected to bring, but every
        EXPLORE-th such round still tries one, so that kind's estimate can recover."""
        if self.fixed is not None or kind is None or not self.c_verify:
            return self.gamma
        best, best_rate, rate0 = self._best(self.alpha_of(kind))
        if best_rate < rate0:
            skipped = self.skipped[kind] = self.skipped.get(kind, 0) + 1
            if skipped % self.EXPLORE:
                return 0
        self.gamma = best
        return best

    def choose(self) -> int:
        if self.c_draft is None:
            return self.gamma
        best, best_rate, _ = self._best(self.alpha)
        if best_rate > self.HYSTERESIS * self.rate(self.gamma):
            return best
        return self.gamma

    def speedup_estimate(self) -> float:
        """Expected tokens per second at the current γ over one plain decode step per token."""
        if self.c_draft is None:
            return 1.0
        return self.rate(self.gamma) * self.verify_cost(1)


# ------------------------------------------------------------------------------------------------
# One answer's rounds
# ------------------------------------------------------------------------------------------------
class Drafting:
    """The speculative side of one answer (Engine.generate's loop): each round `propose` asks the proposer
    for up to γ guesses, `verify` checks them against the target's logits of [last token + guesses], and
    `end_round` records the round (the γ controller's costs and acceptance, the answer's stats). A round
    whose proposal is empty takes the engine's plain one-token step instead of a verification pass."""

    def __init__(self, engine: Any, prompt: list[int], settings: SamplingSettings, sampler: Sampler, stats: Any):
        proposer = engine.draft
        self.proposer, self.prompt, self.settings, self.sampler, self.stats = proposer, prompt, settings, sampler, stats
        self.device = engine.device
        self.ctl = GammaController(engine.draft_tokens, hi=engine.draft_max, costs=engine.draft_costs,
                                   kind_prior=getattr(proposer, "kind_prior", None), free=proposer.free_proposals)
        stats.draft = getattr(proposer, "name", "draft")
        self.begun = False  # proposer.begin runs before the first round (an answer that ends at once never asks)
        self.gamma, self.q, self.kind = 0, None, None  # this round's γ, draft distributions, kind of guess
        self.t_propose = self.t_verify = 0.0

    def propose(self, context: list[int], room: int) -> list[int]:
        """Up to min(γ, room) guessed next tokens after `context` (maybe none)."""
        if not self.begun:
            self.proposer.begin(self.prompt, self.settings, self.sampler)
            self.begun = True
        ctl = self.ctl
        free = self.proposer.free_proposals and ctl.fixed is None
        gamma = min(ctl.hi if free else ctl.gamma, room)
        self.t_propose = now(self.device)
        drafts: list[int] = []
        self.q = self.kind = None
        if gamma > 0:
            with torch.no_grad():
                d, q = self.proposer.propose(context, gamma)
            self.kind = self.proposer.kind
            if free:  # as many as pay for this kind of guess
                gamma = min(ctl.gamma_for(self.kind), gamma)
            drafts = d.tolist()[:gamma]
            self.q = None if q is None else q[:len(drafts)]
        self.gamma = gamma
        self.t_verify = now(self.device)
        return drafts

    def verify(self, logits: torch.Tensor, drafts: list[int], context: list[int]) -> tuple[int, int]:
        """logits [γ+1, V] of [context[-1]] + drafts → (drafts accepted, the target's next token)."""
        s = self.settings
        history = context[-s.repeat_last_n:] if s.repeat_penalty != 1.0 else []
        if s.greedy:
            return verify_greedy(logits, drafts, history, s)
        return verify_sampled(logits, drafts, self.q, history, s, self.sampler)

    def end_round(self, proposed: int, accepted: int) -> None:
        """After the round's verification (or plain step) and its token: time it, and let γ follow."""
        t_done = now(self.device)
        draft_s, verify_s = self.t_verify - self.t_propose, t_done - self.t_verify
        self.ctl.update(proposed, accepted, draft_s, verify_s, self.kind)
        stats = self.stats
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.draft_gamma_history.append(self.gamma)
        if proposed:
            stats.draft_rounds += 1
            stats.draft_proposed += proposed
            stats.draft_accepted += accepted

    def finish(self) -> None:
        """The answer's acceptance figures and the γ controller's last word, into the stats."""
        stats = self.stats
        if stats.draft_proposed:
            stats.acceptance_rate = stats.draft_accepted / stats.draft_proposed
            stats.mean_accepted_length = stats.draft_accepted / max(stats.draft_rounds, 1)
        stats.draft_gamma = self.ctl.gamma
        stats.speedup_estimate = self.ctl.speedup_estimate()


# ------------------------------------------------------------------------------------------------
# From the command line
# ------------------------------------------------------------------------------------------------
SELF_SPEC = re.compile(r"^self(?::int(?P<bits>4|8))?(?::(?P<kind>sym|asym))?(?::[lL](?P<layers>\d+))?$")


def make_proposer(spec: str | None, target_loaded: Any, loader: Callable[..., Any] | None = None) -> Proposer | None:
    """`--draft` → a proposer: none | self | self:int4 | self:int8 | self:int4:L<n> | lookup | MODEL
    (a model path or hub id, loaded on the target's device and dtype; its tokenizer must match)."""
    spec = (spec or "none").strip()
    if spec in ("", "none"):
        return None
    if spec == "lookup":
        return PromptLookupProposer()
    m = SELF_SPEC.match(spec)
    if m:
        layers = int(m["layers"]) if m["layers"] else None
        n_total = target_loaded.model.config.n_layers
        if layers is not None and not 1 <= layers <= n_total:
            raise EdgeLLMError(f"--draft {spec}: the model has {n_total} layers (use L1..L{n_total})")
        return SelfDraftProposer(target_loaded.model, bits=int(m["bits"] or 4), n_layers=layers,
                                 symmetric=m["kind"] == "sym")
    if spec.startswith("self"):
        raise EdgeLLMError(f"--draft {spec}: expected self[:int4|:int8][:asym|:sym][:L<n>]")
    if loader is None:
        from .loading import load_model as loader
    target = target_loaded.model
    draft = loader(spec, device=target.device, dtype=target.dtype, max_seq_len=target.rope_len)
    name = str(getattr(draft, "path", spec))
    check_tokenizers(draft.tokenizer, target_loaded.tokenizer, draft.model.config.vocab_size,
                     target.config.vocab_size, f"draft {name}", str(getattr(target_loaded, "path", "the target")))
    return DraftModelProposer(draft.model, draft.tokenizer, target_loaded.tokenizer, name=f"model:{name}")
