"""The figures the status bar shows, as text: live while an answer streams, final after it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class LiveFigures:
    """Counts taken from the Token events as they arrive (the Done stats replace them at the end)."""

    tokens: int = 0
    first_t: float | None = None
    last_t: float = 0.0
    draft_tokens: int = 0
    target_tokens: int = 0  # tokens the target model chose itself (one per verification round + the first)
    prefill_tokens: int = 0
    reused_tokens: int = 0

    def add(self, token_id: int, t: float, from_draft: bool) -> None:
        if token_id < 0:
            return
        self.tokens += 1
        if self.first_t is None:
            self.first_t = t
        self.last_t = t
        if from_draft:
            self.draft_tokens += 1
        else:
            self.target_tokens += 1

    @property
    def ttft(self) -> float | None:
        return self.first_t

    @property
    def tok_s(self) -> float | None:
        if self.first_t is None or self.tokens < 2 or self.last_t <= self.first_t:
            return None
        return (self.tokens - 1) / (self.last_t - self.first_t)

    @property
    def rounds(self) -> int:
        """Verification rounds: every target-chosen token after the first ends one."""
        return max(self.target_tokens - 1, 0)


@dataclass
class AnswerFigures:
    """What line one of the status bar shows about the current/last answer."""

    ttft_s: float | None = None
    tok_s: float | None = None
    prefill_tok_s: float | None = None
    prefill_tokens: int | None = None
    reused_tokens: int | None = None
    generated: int = 0
    finish: str = ""  # "" while streaming
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rounds: int = 0
    mean_accepted: float = 0.0  # accepted drafts per verification round, as the engine reports it
    live_drafted: int | None = None  # while streaming with a draft on: tokens that came from accepted drafts
    streaming: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_stats(cls, s: Any, live: LiveFigures | None = None) -> "AnswerFigures":
        get = (lambda k, d=0: s.get(k, d)) if isinstance(s, dict) else (lambda k, d=0: getattr(s, k, d))
        # engines that count verification rounds report them; else count them from the token stream
        rounds = get("draft_rounds", 0) or (live.rounds if live is not None else 0)
        return cls(ttft_s=get("ttft_s"), tok_s=get("decode_tok_s"), prefill_tok_s=get("prefill_tok_s"),
                   prefill_tokens=get("prefill_tokens"), reused_tokens=get("reused_tokens"),
                   generated=get("generated_tokens"), finish=get("finish_reason", ""),
                   draft_proposed=get("draft_proposed"), draft_accepted=get("draft_accepted"),
                   draft_rounds=rounds or 0, mean_accepted=get("mean_accepted_length", 0.0) or 0.0)

    def draft_text(self) -> str:
        if not self.draft_proposed:
            # while streaming only the accepted drafts are known (the Done stats bring the rest)
            if self.live_drafted is not None and self.generated:
                return f"{self.live_drafted}/{self.generated} tokens from drafts"
            return ""
        pct = 100.0 * self.draft_accepted / self.draft_proposed
        text = f"draft {pct:.0f}% accepted"
        mean = self.mean_accepted or (self.draft_accepted / self.draft_rounds if self.draft_rounds else 0.0)
        if mean:
            text += f", {mean:.2f} per round"
        return text

    def line(self) -> str:
        parts: list[str] = []
        if self.ttft_s is None:
            if self.streaming:
                new = self.prefill_tokens or 0
                parts.append(f"prefilling {new} new tokens" + (f" ({self.reused_tokens} reused)" if self.reused_tokens else "") + "…")
            else:
                return "ready"
        else:
            parts.append(f"TTFT {self.ttft_s:.3f} s")
            parts.append(f"{self.tok_s:.1f} tok/s" if self.tok_s else "– tok/s")
            if self.prefill_tok_s:
                parts.append(f"prefill {self.prefill_tok_s:.0f} tok/s")
            if self.prefill_tokens is not None:
                parts.append(f"{self.prefill_tokens} new + {self.reused_tokens or 0} reused")
            parts.append(f"{self.generated} tokens" + (f" ({self.finish})" if self.finish else ""))
        draft = self.draft_text()
        if draft:
            parts.append(draft)
        return " · ".join(parts)


def message_footer(stats: dict[str, Any]) -> str:
    """The dim line under an answer (also shown for answers reopened from history)."""
    f = AnswerFigures.from_stats(stats)
    parts = [f"{f.generated} tokens"]
    if f.tok_s:
        parts.append(f"{f.tok_s:.1f} tok/s")
    if f.ttft_s is not None:
        parts.append(f"TTFT {f.ttft_s:.3f} s")
    if f.draft_proposed:
        parts.append(f.draft_text())
    if f.finish and f.finish not in ("eos",):
        parts.append({"stopped": "stopped", "length": "max tokens", "context": "context full",
                      "stop": "stop string"}.get(f.finish, f.finish))
    return " · ".join(parts)


def machine_line(*, ctx_used: int, ctx_max: int, kv_used: int, kv_total: int, memory: int | None,
                 device: str, dtype: str, weights: str, kv: str, draft: str, threads: int | None = None) -> str:
    parts = [f"ctx {ctx_used}/{ctx_max}", f"KV {fmt_bytes(kv_used)} / {fmt_bytes(kv_total)}"]
    if memory is not None:
        parts.append(f"mem {fmt_bytes(memory)}")
    parts.append(f"{device} {dtype}")
    if threads:
        parts.append(f"{threads} thread" + ("s" if threads > 1 else ""))
    parts.append(f"weights {weights}")
    parts.append(f"kv {kv}")
    if draft and draft != "none":
        parts.append(f"draft {draft}")
    return " · ".join(parts)
