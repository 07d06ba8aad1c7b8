"""`edgellm perplexity`: chunked perplexity as llama-perplexity computes it, and KL divergence /
top-1 agreement against a full-precision reference (as its --kl-divergence does).

The text is tokenised once and cut into windows of --ctx tokens; each window is evaluated from an
empty cache and only its second half is scored, so every scored token sees at least ctx/2 tokens
of context.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import EdgeLLMError, ModelNotFoundError
from .options import LoadOptions


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float
    tokens_scored: int
    windows: int
    ctx: int
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None
    reference_perplexity: float | None = None


def windows(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    n = len(ids) // ctx
    out = []
    for i in range(n):
        w = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:  # llama-perplexity starts each window with BOS when the model uses one
            w = [bos] + w[1:]
        out.append(w)
    return out


def window_logprobs(model, cache, window: list[int]) -> torch.Tensor:
    cache.reset()
    x = torch.tensor([window], dtype=torch.long, device=model.device)
    logits = model(x, cache, 0, all_logits=True)[0]
    return torch.log_softmax(logits.double(), dim=-1)


def window_logprobs_decoded(engine, window: list[int], first: int) -> torch.Tensor:
    """Log-probabilities of positions [first, len - 1) as generation computes them: the window's first
    `first` tokens prefilled, then one decode step per token (on CPU the fused C++ step: its matmul kernels,
    its KV writes and its attention), so the cache those positions read was written by the decode path too."""
    engine.reset()
    engine.prefill(window[:first])
    rows = []
    for t in window[first:-1]:
        token = torch.tensor([[t]], dtype=torch.long, device=engine.device)
        rows.append(engine.step(token).float().cpu().clone())  # the step's buffer is reused by the next one
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


def _windows(tokenizer, ids: list[int], ctx: int) -> list[list[int]]:
    ws = windows(ids, ctx, tokenizer.bos_id if tokenizer.add_bos else None)
    if not ws:
        raise EdgeLLMError(f"the text has {len(ids)} tokens, fewer than one window of --ctx {ctx}")
    return ws


def reference_logprobs(model, cache, tokenizer, ids: list[int], ctx: int) -> list[torch.Tensor]:
    """The scored half of every window's log-probabilities (float64, on the CPU): computed once, they
    serve as `evaluate(reference=...)` for many formats (benchmarks/quality.py)."""
    first = ctx // 2
    with torch.inference_mode():
        return [window_logprobs(model, cache, w)[first:ctx - 1].cpu() for w in _windows(tokenizer, ids, ctx)]


def evaluate(model, cache, tokenizer, ids: list[int], ctx: int, reference=None, progress=None,
             decode=None) -> PerplexityResult:
    """`reference`: an optional (model, cache) pair of the full-precision model for KL / top-1, or
    its log-probabilities from `reference_logprobs` over the same ids and ctx. `decode`: an Engine on
    `model` and `cache`: score the second half of each window token by token through its decode step
    (window_logprobs_decoded) instead of in the window's one forward pass. The reference is always the
    full-precision model's forward pass."""
    ws = _windows(tokenizer, ids, ctx)
    first = ctx // 2
    if isinstance(reference, list) and len(reference) != len(ws):
        raise EdgeLLMError(f"reference log-probs cover {len(reference)} windows, not {len(ws)}")
    nll_sum, ref_nll_sum, count = 0.0, 0.0, 0
    kls: list[torch.Tensor] = []
    agree = 0
    with torch.inference_mode():
        for i, w in enumerate(ws):
            if decode is not None:
                lp = window_logprobs_decoded(decode, w, first)
            else:
                lp = window_logprobs(model, cache, w)[first:ctx - 1]
            target = torch.tensor(w[first + 1:], device=lp.device)
            nll_sum -= lp.gather(-1, target[:, None]).sum().item()
            count += target.numel()
            if reference is not None:
                if isinstance(reference, list):
                    ref_lp = reference[i].to(lp.device)
                else:
                    ref_lp = window_logprobs(reference[0], reference[1], w)[first:ctx - 1]
                ref_nll_sum -= ref_lp.gather(-1, target[:, None]).sum().item()
                kls.append((ref_lp.exp() * (ref_lp - lp)).sum(-1).cpu())
                agree += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
            if progress:
                progress()
    nll = nll_sum / count
    res = PerplexityResult(math.exp(nll), nll, count, len(ws), ctx)
    if reference is not None:
        kl = torch.cat(kls)
        res.kl_mean = float(kl.mean())
        res.kl_p99 = float(kl.quantile(0.99))
        res.top1_agreement = agree / count
        res.reference_perplexity = math.exp(ref_nll_sum / count)
    return res


def weight_summary(load: LoadOptions, loaded) -> dict:
    """What the weights were quantized to, and what they cost: bytes in memory (a tied embedding / LM
    head counted once, norms included) and bits per weight over all parameters."""
    from .bench import weight_bytes
    from .quant.linear import QuantEmbedding, QuantLinear

    weights = load.weights
    total, _ = weight_bytes(loaded.model)
    # what the modules actually hold: a GGUF's Q4_1/Q8_0 blocks are kept as they are when the format
    # asked for has as many bits or more, whatever group or symmetry was asked
    stored: dict[str, int] = {}
    seen: set[int] = set()
    for m in loaded.model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and id(m.codes) not in seen:
            seen.add(id(m.codes))
            n = m.qtensor().shape[0] * m.qtensor().shape[1]
            stored[m._fmt()] = stored.get(m._fmt(), 0) + n
        for p, name in zip(getattr(m, "gguf_parts", []), getattr(m, "type_names", list)()):
            if id(p.raw) not in seen:  # GGUF blocks kept as stored (--weights auto)
                seen.add(id(p.raw))
                stored[name] = stored.get(name, 0) + p.rows * m.in_features
    out = {"weights": weights, "weight_bytes": total,
           "bits_per_weight": 8 * total / loaded.config.num_parameters(), "stored_formats": stored}
    if weights in ("int8", "int4"):
        out |= {"group_size": "channel" if load.per_channel else load.group_size,
                "symmetric": weights == "int8" or load.symmetric, "embeddings": load.embeddings,
                "search": load.search}
    return out


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    from .args import add_format_options, add_model_options, add_quant_options

    p = sub.add_parser("perplexity", help="perplexity (and KL vs full precision) over a text file")
    add_model_options(p)
    add_format_options(p)
    add_quant_options(p)
    p.add_argument("-f", "--file", required=True, help="text file to score (e.g. /usr/share/common-licenses/GPL-3)")
    p.add_argument("--reference", choices=["fp"], default=None,
                   help="also compare next-token distributions with the full-precision model (KL, top-1)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-windows", type=int, default=0, help="score only the first N windows (0 = all)")
    p.add_argument("--decode", action="store_true",
                   help="score the second half of each window one token at a time through the decode step, "
                        "as generation reads the model and its KV cache (slower; default: one forward pass)")
    p.set_defaults(ctx=None)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from .args import engine_from_options, load_from_options, options_from_args

    path = Path(args.file)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EdgeLLMError(f"{path}: not UTF-8 text") from e
    options = options_from_args(args)
    ctx = options.load.ctx or 512
    options = dataclasses.replace(options, load=dataclasses.replace(options.load, ctx=ctx))
    loaded = load_from_options(options)
    engine = engine_from_options(options, loaded, kv=args.kv)
    ids = loaded.tokenizer.encode(text, add_bos=False)
    reference = None
    if args.reference == "fp":
        ref = dataclasses.replace(options, load=dataclasses.replace(options.load, weights="fp", per_channel=False,
                                                                    dtype="fp32"))
        same = args.weights == "fp" and loaded.model.dtype == torch.float32
        ref_loaded = loaded if same else load_from_options(ref)  # same weights: only the KV cache differs
        reference = (ref_loaded.model, engine_from_options(ref, ref_loaded, kv="fp").cache)  # fp32 K/V too
    n_windows = len(ids) // ctx
    if args.max_windows:
        ids = ids[: args.max_windows * ctx]
        n_windows = min(n_windows, args.max_windows)
    with Progress(transient=True, disable=args.json or not sys.stderr.isatty()) as bar:
        task = bar.add_task("scoring", total=n_windows)
        res = evaluate(loaded.model, engine.cache, loaded.tokenizer, ids, ctx, reference,
                       progress=lambda: bar.advance(task), decode=engine if args.decode else None)
    out = asdict(res) | {"model": str(loaded.path), "file": str(path), "kv": args.kv,
                         "scoring": "decode" if args.decode else "forward"}
    out |= weight_summary(options.load, loaded)
    if args.json:
        print(json.dumps(out))
    else:
        line = f"perplexity {res.perplexity:.4f} over {res.tokens_scored} tokens ({res.windows} windows of {ctx})"
        if res.kl_mean is not None:
            line += (f" · reference ppl {res.reference_perplexity:.4f} · KL {res.kl_mean:.5f} "
                     f"(p99 {res.kl_p99:.4f}) · top-1 agreement {100 * res.top1_agreement:.2f}%")
        print(line)
    return 0


COMMANDS = {"perplexity": cmd_perplexity}
