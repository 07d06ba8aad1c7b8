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
from .device import now, peak_memory_bytes, reset_peak_memory
from .errors import ContextOverflowError
from .sampling import Sampler, SamplingSettings

PREFILL_CHUNK = 512  # bounds activation/mask memory of long prompts; big enough for full GEMM speed


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


class Engine:
    """A model, its tokenizer and its KV cache, generating for one user."""

    def __init__(self, model, tokenizer, max_seq_len: int | None = None, cache: KVCache | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len or model.rope_len
        self.cache = cache or KVCache(model.config, self.max_seq_len, model.dtype, model.device)
        self.cached_ids: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.device = model.device

    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache.reset()
        self.cached_ids = []

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
        """Run the uncached part of `prompt` through the model; returns the last position's logits [V]."""
        start = self._reuse_prefix(prompt)
        logits = None
        for i in range(start, len(prompt), PREFILL_CHUNK):
            chunk = prompt[i:i + PREFILL_CHUNK]
            x = torch.tensor([chunk], dtype=torch.long, device=self.device)
            logits = self.model(x, self.cache, i)
            self.cached_ids.extend(chunk)
        return logits[0, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token (a [1, 1] tensor) at the end of the cache; returns logits [V]."""
        pos = self.cache.length
        logits = self.model(token, self.cache, pos)
        return logits[0, -1]

    # ------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], settings: GenerationSettings | None = None,
                 stop: threading.Event | None = None) -> Iterator[Event]:
        settings = settings or GenerationSettings()
        self.check_fits(len(prompt))
        stats = GenerationStats(prompt_tokens=len(prompt))
        sampler = Sampler(settings.sampling, self.device)
        penalty = settings.sampling.repeat_penalty != 1.0
        last_n = settings.sampling.repeat_last_n
        eos = set() if settings.ignore_eos else self.tokenizer.eos_ids
        detok = self.tokenizer.stream()
        stops = StopStringMatcher(settings.stop_strings)
        out_ids: list[int] = []
        text_parts: list[str] = []
        token_buf = torch.empty((1, 1), dtype=torch.long, device=self.device)

        reset_peak_memory(self.device)
        t0 = now(self.device)
        reused = self._reuse_prefix(prompt)
        stats.reused_tokens, stats.prefill_tokens = reused, len(prompt) - reused
        logits = self.prefill(prompt)

        def recent() -> torch.Tensor | None:
            if not penalty:
                return None
            ids = (prompt + out_ids)[-last_n:]
            return torch.tensor(ids, dtype=torch.long, device=self.device)

        t_prev = t0
        t_first = t0
        finish = "length"
        try:
            while len(out_ids) < settings.max_tokens:
                next_id = sampler(logits, recent())
                tid = int(next_id)  # the one host sync per token: we must see the id to stream it
                t = now()
                if not out_ids:
                    t_first = t
                    stats.ttft_s = stats.prefill_s = t - t0
                else:
                    stats.token_latencies_s.append(t - t_prev)
                t_prev = t
                if tid in eos:
                    finish = "eos"
                    break
                out_ids.append(tid)
                piece = stops.feed(detok.push(tid))
                text_parts.append(piece)
                yield Token(tid, piece, t - t0)
                if stops.stopped:
                    finish = "stop"
                    break
                if stop is not None and stop.is_set():
                    finish = "stopped"
                    break
                if len(out_ids) >= settings.max_tokens:
                    break
                if self.cache.length >= self.max_seq_len:
                    finish = "context"
                    break
                token_buf.fill_(tid)
                logits = self.step(token_buf)
                self.cached_ids.append(tid)
        finally:
            # an interrupt mid-forward leaves K/V past `length`: harmless, but keep ids in step
            del self.cached_ids[self.cache.length:]
        if not stops.stopped:
            tail = stops.feed(detok.flush()) + stops.flush()
            if tail:
                text_parts.append(tail)
                yield Token(-1, tail, now() - t0)  # trailing text (no new token)
        stats.finish_reason = finish
        stats.generated_tokens = len(out_ids)
        if not out_ids:
            stats.ttft_s = stats.prefill_s = now(self.device) - t0
        stats.prefill_tok_s = stats.prefill_tokens / stats.prefill_s if stats.prefill_s > 0 else 0.0
        stats.decode_s = t_prev - t_first
        n_decoded = len(stats.token_latencies_s)
        stats.decode_tok_s = n_decoded / stats.decode_s if stats.decode_s > 0 else 0.0
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
        yield Done(stats, "".join(text_parts), out_ids)
