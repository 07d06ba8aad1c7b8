"""Prefill + decode on a static KV cache, as one stream of events (mlx-lm's stream_generate idea).

The CLI, the chat app and the bench all consume `Engine.generate()`: `Token` events as tokens arrive,
then one `Done` with the stats. The engine keeps the cache's token ids, so the next prompt that
starts with them (the next chat turn) only prefills what is new.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .cache import KVCache
from .decode_step import DecodePath, Decoder
from .device import now, peak_memory_bytes, prefill_chunk, reset_peak_memory
from .errors import ContextOverflowError
from .options import Options
from .prefill_path import fused_prefill_rows
from .sampling import Sampler, SamplingSettings
from .speculative import Drafting

@dataclass
class GenerationSettings:
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from the kept prefix)
    reused_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    token_latencies_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    finish_reason: str = ""  # eos | stop | length | context | stopped
    draft_proposed: int = 0
    draft_accepted: int = 0
    # speculative decoding (zero / empty without a draft)
    draft: str = ""  # the proposer's name
    draft_rounds: int = 0  # verification passes that checked at least one draft
    acceptance_rate: float = 0.0  # draft_accepted / draft_proposed
    mean_accepted_length: float = 0.0  # accepted drafts per verification round
    draft_gamma: int = 0  # the draft length asked for last (adaptive or fixed)
    draft_gamma_history: list[int] = field(default_factory=list)  # γ asked for, per round
    draft_s: float = 0.0  # time spent proposing
    verify_s: float = 0.0  # time spent in the target's verification passes
    speedup_estimate: float = 0.0  # the γ controller's expected tokens/s over plain decoding

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("token_latencies_s")
        return d


@dataclass
class Token:
    id: int
    text: str  # the text this token adds (may be "" while a character or stop string is incomplete)
    t: float  # seconds since generate() started
    from_draft: bool = False


@dataclass
class Done:
    stats: GenerationStats
    text: str
    tokens: list[int]


Event = Token | Done


class StopStringMatcher:
    """Holds back text that could be the start of a stop string; cuts at the first full match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                self.stopped = True
                out, self.pending = self.pending[:i], ""
                return out
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut = len(self.pending) - self.hold
        safe = max(cut, 0)
        # only hold back a tail that really is a prefix of some stop string
        while safe < len(self.pending) and not any(s.startswith(self.pending[safe:]) for s in self.stops):
            safe += 1
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# Prompt parts of up to the fused step's max_rows tokens through the fused CPU step (Engine.prefill); False: the
# eager model for every prompt (A/B switch: benchmarks/chat_turn_ttft.py --eager-too).
FUSED_PREFILL = True


class Engine:
    """A model, its tokenizer and its KV cache, generating for one user."""

    def __init__(self, model, tokenizer, max_seq_len: int | None = None, cache: KVCache | None = None,
                 draft=None, draft_tokens: int | None = None, options: Options | None = None):
        """`draft`: a speculative proposer (edgellm.speculative), or None for plain decoding;
        `draft_tokens`: a fixed draft length (None: adaptive, starting at 4); `options`: the decode step's
        settings (compile mode, fused step, kernel activations; default: edgellm's defaults)."""
        self.options = options or Options()
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len or model.rope_len
        self.cache = cache or KVCache(model.config, self.max_seq_len, model.dtype, model.device, kv_format="auto")
        self.cache.prepare(model)  # a quantized cache's K/V centres now, not inside the first answer's TTFT
        self.cached_ids: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.device = model.device
        self.idle_work = None  # chat / serve: hugepages.when_idle(model), told when each generation starts and ends
        # the decode step as one unit (decode_step.py: fused C++ on CPU, a CUDA graph on CUDA) where it
        # applies: "auto", "inductor" (CUDA: torch.compile inside the graph) or "off" (op by op)
        self.compile_mode = self.options.decode.compile
        self._decoder = Decoder(model, self.options)
        self.draft = draft
        self.draft_tokens = draft_tokens
        if draft is not None:
            from .speculative import GammaController, VerifyCosts, max_draft_tokens

            self.draft_max = max_draft_tokens(model)  # drafts per verification pass that keep it exact
            self.draft_costs = VerifyCosts()  # measured by each answer's γ controller, kept for the next
            GammaController(draft_tokens, hi=self.draft_max)  # validates draft_tokens now, not at the first answer
            draft.bind(self)

    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache.reset()
        self.cached_ids = []
        if self.draft is not None:
            self.draft.reset()

    def check_fits(self, n_prompt: int) -> None:
        if n_prompt >= self.max_seq_len:
            raise ContextOverflowError(
                f"the prompt has {n_prompt} tokens but the context holds {self.max_seq_len} "
                f"(use --ctx to enlarge it or --truncate to keep the end)")

    def _reuse_prefix(self, prompt: list[int]) -> int:
        """Keep the cached tokens that the new prompt starts with; at least one token is recomputed
        so that we have logits to sample from."""
        n = 0
        limit = min(len(prompt) - 1, len(self.cached_ids), self.cache.length)
        while n < limit and self.cached_ids[n] == prompt[n]:
            n += 1
        self.cache.truncate(n)
        del self.cached_ids[n:]
        return n

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Run the uncached part of `prompt` through the model; returns the last position's logits [V], valid
        until the next step (a short part's come in the fused step's buffer)."""
        start = self._reuse_prefix(prompt)
        # (a step not built yet stays so: the first prompt's TTFT would pay the fused plan's build, ~75 ms on SmolLM2,
        # which the first decode step pays as before)
        step = self._decoder.built(self.cache, self.compile_mode)
        if FUSED_PREFILL and 0 < len(prompt) - start <= fused_prefill_rows(step) and len(prompt) <= step.limit:
            # a chat turn after its cached prefix (or a short prompt once the step is built): the fused step over its
            # tokens (the cache read in place, no graph; GGUF blocks from 8 tokens on through the prompt GEMM) and the
            # LM head over the last row: after 1500 cached tokens 0.38-0.69x the eager pass's TTFT (SmolLM2 Q4_K_M),
            # 0.72-0.80x (a 1B Q4_K_M with a 128K vocabulary; benchmarks/results/chat-turn-ttft-amx-host.json)
            new = prompt[start:]
            logits = step.prefill(torch.tensor(new, dtype=torch.long), start)
            self.cached_ids.extend(new)
            return logits
        logits, size = None, prefill_chunk(self.device, self.model.config.intermediate_size)
        for i in range(start, len(prompt), size):
            chunk = prompt[i:i + size]
            x = torch.tensor([chunk], dtype=torch.long, device=self.device)
            logits = self.model(x, self.cache, i, logits=i + size >= len(prompt))  # only the last chunk's
            self.cached_ids.extend(chunk)
        return logits[0, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token (a [1, 1] tensor) at the end of the cache; returns logits [V]."""
        return self._decoder(token, self.cache, self.cache.length, self.compile_mode)  # valid until the next step

    def verify_logits(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [T, V] of x [1, T] at positions [start, start+T): through the compiled step's multi-token
        call where it has one (the fused CPU step: each row bit for bit a one-token step, so greedy
        speculation equals plain decoding exactly), else one causal forward of the model."""
        step = self.compiled_step()
        many = getattr(step, "many", None)
        T = x.shape[1]
        if many is not None and T <= step.max_rows and start + T <= step.limit:
            return many(x[0], start)
        return self.model(x, self.cache, start, all_logits=True)[0]

    def compiled_step(self):
        """The decode step as one unit for the current cache (built on first use), or None."""
        return self._decoder.compiled(self.cache, self.compile_mode)

    @property
    def decode_path(self) -> DecodePath:
        """Which decode step serves this engine's cache, and why not a faster one (decode_step.DecodePath)."""
        self.compiled_step()
        return self._decoder.path

    # ------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], settings: GenerationSettings | None = None,
                 stop: threading.Event | None = None) -> Iterator[Event]:
        """Prefill, then rounds until a finish: each round emits its tokens one by one through the stop checks,
        then computes the next ones. Plain decoding is speculation with zero drafts: without a proposer (or
        when it guesses nothing) a round is the one-token step and one sample; with guesses, one target pass
        over [last token + guesses] verifies them (speculative.py) and the cache is rolled back to the
        accepted ones. Either way the cache ends holding exactly what plain decoding of the emitted tokens
        leaves (every emitted token but the last; all of them after EOS)."""
        work = self.idle_work  # (hugepages.IdleCollapser: its copies wait until the engine has been idle a while)
        if work is not None:
            work.busy()
        try:
            yield from self._generate(prompt, settings, stop)
        finally:
            if work is not None:
                work.idle()

    def _generate(self, prompt: list[int], settings: GenerationSettings | None,
                  stop: threading.Event | None) -> Iterator[Event]:
        settings = settings or GenerationSettings()
        self.check_fits(len(prompt))
        s = settings.sampling
        stats = GenerationStats(prompt_tokens=len(prompt))
        sampler = Sampler(s, self.device)
        drafting = None if self.draft is None else Drafting(self, prompt, s, sampler, stats)
        penalty = s.repeat_penalty != 1.0
        eos = set() if settings.ignore_eos else self.tokenizer.eos_ids
        detok = self.tokenizer.stream()
        stops = StopStringMatcher(settings.stop_strings)
        P = len(prompt)
        out_ids: list[int] = []
        context = list(prompt)  # prompt + out_ids, grown as tokens are emitted
        text_parts: list[str] = []
        token_buf = torch.empty((1, 1), dtype=torch.long, device=self.device)

        def sample(logits: torch.Tensor) -> int:
            """The next token from one position's logits: the one host sync of a plain step (we must see the
            id to stream it)."""
            recent = torch.tensor(context[-s.repeat_last_n:], dtype=torch.long, device=self.device) if penalty else None
            return int(sampler(logits, recent))

        reset_peak_memory(self.device)
        t0 = now(self.device)
        reused = self._reuse_prefix(prompt)
        stats.reused_tokens, stats.prefill_tokens = reused, P - reused
        with torch.no_grad():
            logits = self.prefill(prompt)
        pending: list[tuple[int, bool]] = []  # this round's tokens: (id, from a draft)
        finish = "length"
        if settings.max_tokens > 0:
            pending, finish = [(sample(logits), False)], ""
        t_prev = t_first = t0
        first_round = True
        try:
            while not finish:
                # -- emit this round's tokens, each through the stop checks --------------------------
                t_round = now()
                share = (t_round - t_prev) / len(pending)  # a round's time, spread over its tokens
                if first_round:
                    t_first = t_round
                    stats.ttft_s = stats.prefill_s = t_round - t0
                for i, (tid, from_draft) in enumerate(pending):
                    if not first_round:
                        # the last token handled takes what is left, so the latencies sum to the time
                        last = i + 1 == len(pending) or tid in eos
                        stats.token_latencies_s.append(t_round - t_prev - share * i if last else share)
                    if tid in eos:
                        finish = "eos"
                        break
                    out_ids.append(tid)
                    context.append(tid)
                    piece = stops.feed(detok.push(tid))
                    text_parts.append(piece)
                    yield Token(tid, piece, t_round - t0, from_draft)
                    if stops.stopped:
                        finish = "stop"
                    elif stop is not None and stop.is_set():
                        finish = "stopped"
                    elif len(out_ids) >= settings.max_tokens:
                        finish = "length"
                    elif P + len(out_ids) - 1 >= self.max_seq_len:  # the cache is full
                        finish = "context"
                    if finish:
                        if not first_round:
                            stats.token_latencies_s[-1] = t_round - t_prev - share * i
                        break
                first_round = False
                t_prev = t_round
                if finish:
                    break
                # -- the next round: guesses verified in one pass, or the one-token step -------------
                start = len(context) - 1  # the last token is not in the cache yet
                drafts: list[int] = []
                if drafting is not None:
                    drafts = drafting.propose(context, min(settings.max_tokens - len(out_ids) - 1,
                                                           self.max_seq_len - len(context)))
                if drafts:
                    with torch.no_grad():
                        x = torch.tensor([[context[-1]] + drafts], dtype=torch.long, device=self.device)
                        logits = self.verify_logits(x, start)
                    n_ok, next_id = drafting.verify(logits, drafts, context)
                    self.cache.truncate(start + n_ok + 1)  # keep [last, accepted drafts]; drop the rest
                    self.cached_ids.extend(([context[-1]] + drafts)[:n_ok + 1])
                    pending = [(t, True) for t in drafts[:n_ok]] + [(next_id, False)]
                else:
                    n_ok = 0
                    if self.cache.length > start:  # a shared-cache draft's guesses past it (self-draft)
                        self.cache.truncate(start)
                    token_buf.fill_(context[-1])
                    pending = [(sample(self.step(token_buf)), False)]
                    self.cached_ids.append(context[-1])
                if drafting is not None:
                    drafting.end_round(len(drafts), n_ok)
        finally:
            # what plain decoding leaves: every emitted token but the last in the cache (all of them after
            # EOS, which was computed from the last one); an interrupt (Ctrl-C inside a step, draft or
            # verification pass, or the consumer closing the stream) leaves the verified prefix: a shared-
            # cache draft's guesses and unchecked verification K/V past `cached_ids` are dropped
            if finish:
                keep = max(P, P + len(out_ids) - (finish != "eos"))
                self.cache.truncate(min(self.cache.length, keep))
            del self.cached_ids[self.cache.length:]
            self.cache.truncate(min(self.cache.length, len(self.cached_ids)))
        if not stops.stopped:
            tail = stops.feed(detok.flush()) + stops.flush()
            if tail:
                text_parts.append(tail)
                yield Token(-1, tail, now() - t0)  # trailing text (no new token)
        self._finish_stats(stats, finish, len(out_ids), t0, t_first, t_prev)
        if drafting is not None:
            drafting.finish()
        yield Done(stats, "".join(text_parts), out_ids)

    def _finish_stats(self, stats: GenerationStats, finish: str, generated: int, t0: float, t_first: float,
                      t_prev: float) -> None:
        """The totals of a finished generation: rates from its timestamps (t0 start, t_first the first
        token, t_prev the last one), and the peak memory."""
        stats.finish_reason = finish
        stats.generated_tokens = generated
        if not generated:
            stats.ttft_s = stats.prefill_s = now(self.device) - t0
        stats.prefill_tok_s = stats.prefill_tokens / stats.prefill_s if stats.prefill_s > 0 else 0.0
        stats.decode_s = t_prev - t_first
        n_decoded = len(stats.token_latencies_s)
        stats.decode_tok_s = n_decoded / stats.decode_s if stats.decode_s > 0 else 0.0
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
