"""`edgellm bench`: single-user latency (TTFT, prefill and decode tok/s) next to the memory-bandwidth
limit of the machine, and optionally next to llama.cpp — as a llama-bench-like table and as JSON.

One row = one combination of the comma lists (--weights × --kv × --draft × context), where the
contexts are -p and every --ctx value. A row prefills a prompt of that many tokens of real text
(TTFT, "pp" test) and then decodes -n tokens after it ("tg" test). Decode at batch size 1 reads
every weight and the whole KV cache once per token, so its limit is
    roofline tok/s = measured bandwidth / (weight bytes read per token + KV bytes per token × context),
and each decode figure is printed as a percentage of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from .atomic import write_text_atomic
from .args import engine_from_options, load_from_options, options_from_args
from .errors import EdgeLLMError, ModelNotFoundError, OutputError
from .prefill_path import PrefillPath, fused_prefill_rows, prefill_path
from .device import reset_process_peak_rss
from .options import Options

WEIGHT_FORMATS = ("auto", "fp", "int8", "int4")
KV_FORMATS = ("auto", "fp", "f16", "int8", "int4")
DRAFT_KINDS = ("none", "self", "lookup")  # plus self:<spec> and a draft model path
AGAINST = ("llama.cpp",)
DEFAULT_PROMPT_FILE = Path("/usr/share/common-licenses/GPL-3")
SCHEMA_VERSION = 1
# Speculative verification may write a few positions past the last kept token: leave room for it.
CONTEXT_SLACK = 16
LLAMA_CPP_HINT = ("--against llama.cpp: llama-cpp-python is not installed; `pip install llama-cpp-python` "
                  "(builds llama.cpp from source in a few minutes) to compare")
PLOT_HINT = "--plot: matplotlib is not installed; `pip install -e '.[plot]'` (or `pip install matplotlib`) to draw it"


class BenchError(EdgeLLMError):
    """Bad `edgellm bench` arguments."""


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
@dataclass
class BenchPlan:
    weights: list[str]
    kv: list[str]
    draft: list[str]
    contexts: list[int]  # prompt lengths: -p first, then the --ctx sweep
    prompt_tokens: int
    gen_tokens: int
    reps: int
    warmup: int

    def rows(self) -> list[tuple[str, str, str, int]]:
        """Every combination of the lists, in table order (weights, kv, draft, context)."""
        return [(w, k, d, c) for w in self.weights for k in self.kv for d in self.draft for c in self.contexts]

    @property
    def max_context(self) -> int:
        return max(self.contexts) + self.gen_tokens + CONTEXT_SLACK


def parse_list(text: str, option: str, allowed: tuple[str, ...], extra: Callable[[str], bool] | None = None) -> list[str]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise BenchError(f"{option}: empty list (choose from {', '.join(allowed)})")
    for item in items:
        if item not in allowed and not (extra and extra(item)):
            raise BenchError(f"{option}: unknown value {item!r} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(items))


def parse_int_list(text: str | None, option: str) -> list[int]:
    if text in (None, ""):
        return []
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        mult = 1
        if item.endswith("k"):  # --ctx 2k,6k
            item, mult = item[:-1], 1024
        try:
            value = int(item) * mult
        except ValueError:
            raise BenchError(f"{option}: {item!r} is not a whole number") from None
        if value < 1:
            raise BenchError(f"{option}: {value} must be at least 1")
        out.append(value)
    return out


def _is_draft_spec(item: str) -> bool:
    return item.startswith("self:") or Path(item).expanduser().exists()


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Validate the options; every problem is a one-line BenchError (exit code 2)."""
    if args.n_prompt < 1:
        raise BenchError(f"-p/--n-prompt must be at least 1 (got {args.n_prompt})")
    if args.n_gen < 2:
        raise BenchError(f"-n/--n-gen must be at least 2: the first token comes from the prefill (got {args.n_gen})")
    if args.repetitions < 1:
        raise BenchError(f"-r/--repetitions must be at least 1 (got {args.repetitions})")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be 0 or more (got {args.warmup})")
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be at least 1 (got {args.threads})")
    if args.stream_mib is not None and args.stream_mib < 1:
        raise BenchError(f"--stream-mib must be at least 1 (got {args.stream_mib})")
    if args.against is not None and args.against.lower().replace("_", ".").replace("llamacpp", "llama.cpp") not in AGAINST:
        raise BenchError(f"--against: unknown engine {args.against!r} (choose from {', '.join(AGAINST)})")
    weights = parse_list(args.weights, "--weights", WEIGHT_FORMATS)
    kv = parse_list(args.kv, "--kv", KV_FORMATS)
    draft = parse_list(args.draft, "--draft", DRAFT_KINDS, extra=_is_draft_spec)
    contexts = list(dict.fromkeys([args.n_prompt] + parse_int_list(args.ctx, "--ctx")))
    for option, target in (("json", args.json), ("plot", args.plot)):
        if target and target != "-" and not Path(target).expanduser().resolve().parent.is_dir():
            raise OutputError(f"--{option} {target}: the folder does not exist")
    return BenchPlan(weights, kv, draft, contexts, args.n_prompt, args.n_gen, args.repetitions, args.warmup)


# ------------------------------------------------------------------------------------------------
# Is a format there yet? (each check looks for the real feature, so rows light up as they land)
# ------------------------------------------------------------------------------------------------
def missing_feature(kind: str, value: str, loaded=None) -> str | None:
    """None when `value` of `kind` (weights | kv | draft) can run, else a one-line reason."""
    if kind == "weights" and value not in ("fp", "auto"):
        # load_model(weights=...) quantizes through edgellm.quant.convert (QuantSettings, install_quantized)
        try:
            mod = importlib.import_module("edgellm.quant.convert")
        except ImportError as e:
            return f"--weights {value} not available yet (edgellm.quant.convert: {_first_line(e)})"
        if not all(hasattr(mod, a) for a in ("QuantSettings", "install_quantized")):
            return f"--weights {value} not available yet (edgellm.quant.convert lacks QuantSettings/install_quantized)"
    if kind == "kv" and value not in ("auto", "fp"):
        # engine_from_args builds KVCache(..., kv_format=value); it refuses formats it cannot store
        from .cache import KVCache

        if loaded is not None:
            try:
                KVCache(loaded.config, 1, loaded.model.dtype, "meta", kv_format=value)
            except (ValueError, NotImplementedError, ImportError, TypeError) as e:
                return f"--kv {value} not available yet ({_first_line(e)})"
    if kind == "draft" and value != "none":
        # engine_from_args calls edgellm.speculative.make_proposer(spec, loaded) and Engine(draft=...)
        try:
            mod = importlib.import_module("edgellm.speculative")
        except ImportError as e:
            return f"--draft {value} not available yet (edgellm.speculative: {_first_line(e)})"
        if not hasattr(mod, "make_proposer"):
            return f"--draft {value} not available yet (edgellm.speculative.make_proposer missing)"
        from .generate import Engine

        if "draft" not in inspect.signature(Engine).parameters:
            return f"--draft {value} not available yet (Engine takes no draft= argument)"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ------------------------------------------------------------------------------------------------
# The physics: bandwidth, bytes per token, roofline
# ------------------------------------------------------------------------------------------------
def measure_bandwidth(device: torch.device, mib: int | None = None, runs: int = 10) -> dict[str, float]:
    """STREAM-style copy (a→b: 2 arrays moved) and triad (a = b + s·c: 3 arrays moved) over fp32
    arrays much larger than the last-level cache; best of `runs` after one warm-up, in GB/s."""
    from .device import synchronize

    mib = mib or (256 if device.type == "cpu" else 1024)
    n = mib * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32, device=device)
    b = torch.full((n,), 2.0, dtype=torch.float32, device=device)
    c = torch.full((n,), 0.5, dtype=torch.float32, device=device)

    def best(op: Callable[[], Any], arrays: int) -> float:
        op()
        times = []
        for _ in range(runs):
            synchronize(device)
            t0 = time.perf_counter()
            op()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return arrays * n * 4 / min(times) / 1e9

    copy_gbs = best(lambda: b.copy_(a), 2)
    triad_gbs = best(lambda: torch.add(b, c, alpha=3.0, out=a), 3)
    del a, b, c
    return {"copy_gbs": copy_gbs, "triad_gbs": triad_gbs, "bandwidth_gbs": max(copy_gbs, triad_gbs),
            "array_mib": mib, "runs": runs}


def _storage_key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.data_ptr(), t.nbytes) if t.device.type != "meta" else (id(t),)


def _tensors(module: torch.nn.Module, skip_root_nonpersistent: bool) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for t in module.parameters():
        out[_storage_key(t)] = t.nbytes
    for name, t in module.named_buffers():
        if skip_root_nonpersistent and "." not in name and name in module._non_persistent_buffers_set:
            continue  # the RoPE cos/sin tables: sized by the context, one row read per token
        out[_storage_key(t)] = t.nbytes
    return out


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of weights in memory, bytes of weights read per decoded token).

    Memory: every unique parameter and buffer (a tied embedding/LM head counted once; the RoPE tables
    left out). Read per token: all of it, except that an untied embedding table is not read whole —
    the lookup reads one row."""
    all_tensors = _tensors(model, skip_root_nonpersistent=True)
    total = sum(all_tensors.values())
    read = total
    emb = getattr(model, "tok_embeddings", None)
    head = getattr(model, "output", None)
    if emb is not None:
        emb_tensors = _tensors(emb, False)
        tied = head is not None and bool(set(emb_tensors) & set(_tensors(head, False)))
        if not tied:
            emb_bytes = sum(emb_tensors.values())
            read = total - emb_bytes + math.ceil(emb_bytes / model.config.vocab_size)
    return total, read


def bytes_per_decoded_token(weight_read_bytes: int, kv_bytes_per_token: int, context: float) -> float:
    """Bytes a decode step moves: the weights once, plus the K/V of every position it attends to."""
    return weight_read_bytes + kv_bytes_per_token * context


def mean_decode_context(prompt_tokens: int, gen_tokens: int) -> float:
    """Mean number of cached positions a decode step attends to. The first token comes from the
    prefill; decode step k = 1..n-1 attends to prompt + k positions, whose mean is prompt + n/2."""
    return prompt_tokens + gen_tokens / 2


def roofline_tok_s(bandwidth_gbs: float, bytes_per_token: float) -> float:
    return bandwidth_gbs * 1e9 / bytes_per_token


# ------------------------------------------------------------------------------------------------
# Measuring one row
# ------------------------------------------------------------------------------------------------
def read_prompt_text(path: str | None) -> tuple[str, Path]:
    p = Path(path).expanduser() if path else DEFAULT_PROMPT_FILE
    if not p.is_file():
        hint = "" if path else " (the GPL-3 text Debian ships); pass --prompt-file FILE"
        raise ModelNotFoundError(f"{p}: prompt file not found{hint}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BenchError(f"{p}: the prompt file is not UTF-8 text") from None
    if not text.strip():
        raise BenchError(f"{p}: the prompt file is empty")
    return text, p


def prompt_ids(tokenizer, text: str, count: int) -> list[int]:
    """The first `count` tokens of the text (raw, no chat template), the text repeated if too short."""
    ids = tokenizer.encode(text)
    body = tokenizer.encode(text, add_bos=False)
    if not body:
        raise BenchError("the prompt text tokenises to nothing")
    while len(ids) < count:
        ids = ids + body
    return ids[:count]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "min": min(values),
            "max": max(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def run_once(engine, ids: list[int], n: int) -> tuple[Any, list[bool]]:
    """One full-prefill generation of exactly n tokens; (stats, from_draft flag per token)."""
    from .generate import Done, GenerationSettings

    engine.reset()  # a full prefill every time: the engine would otherwise reuse the cached prefix
    flags: list[bool] = []
    done = None
    with torch.inference_mode():
        for ev in engine.generate(ids, GenerationSettings(max_tokens=n, ignore_eos=True)):
            if isinstance(ev, Done):
                done = ev
            elif ev.id >= 0:
                flags.append(bool(getattr(ev, "from_draft", False)))
    return done.stats, flags


def measure_row(engine, ids: list[int], n: int, reps: int, warmup: int, advance: Callable[[], None]) -> dict:
    for _ in range(warmup):  # excluded: first-call allocations, caches, lazy kernel builds
        run_once(engine, ids, n)
        advance()
    runs = []
    latencies: list[float] = []
    proposed = accepted = rounds = 0
    peak = 0
    for _ in range(reps):
        st, flags = run_once(engine, ids, n)
        advance()
        decoded = len(st.token_latencies_s)
        if st.generated_tokens != n or st.prefill_tokens != len(ids) or decoded < 1:
            raise BenchError(f"the engine produced {st.generated_tokens} of {n} tokens "
                             f"({st.prefill_tokens} of {len(ids)} prefilled, finish: {st.finish_reason})")
        runs.append({"ttft_s": st.ttft_s, "prefill_s": st.prefill_s, "prefill_tokens": st.prefill_tokens,
                     "prefill_tok_s": st.prefill_tok_s, "decode_s": st.decode_s, "decoded_tokens": decoded,
                     "decode_tok_s": st.decode_tok_s, "generated_tokens": st.generated_tokens,
                     "peak_memory_bytes": st.peak_memory_bytes})
        latencies += st.token_latencies_s
        proposed += st.draft_proposed
        accepted += st.draft_accepted
        rounds += sum(1 for f in flags[1:] if not f)  # each verification round ends in one target token
        peak = max(peak, st.peak_memory_bytes)
    ttft = spread([r["ttft_s"] for r in runs])
    pp = spread([r["prefill_tok_s"] for r in runs])
    tg = spread([r["decode_tok_s"] for r in runs])
    stats = {
        "ttft_s": ttft["median"], "ttft_s_min": ttft["min"], "ttft_s_max": ttft["max"], "ttft_s_std": ttft["std"],
        "prefill_tok_s": pp["median"], "prefill_tok_s_std": pp["std"],
        "decode_tok_s": tg["median"], "decode_tok_s_mean": tg["mean"], "decode_tok_s_min": tg["min"],
        "decode_tok_s_max": tg["max"], "decode_tok_s_std": tg["std"],
        "tpot_ms_p50": 1e3 * percentile(latencies, 50), "tpot_ms_p90": 1e3 * percentile(latencies, 90),
        "tpot_ms_p99": 1e3 * percentile(latencies, 99),
        "peak_memory_bytes": peak,
        "draft_proposed": proposed, "draft_accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": accepted / rounds if proposed and rounds else None,
    }
    return {"stats": stats, "runs": runs}


# ------------------------------------------------------------------------------------------------
# llama.cpp, in a child process (edgellm/llama_cpp_peer.py): its peak RSS its own, ours ours
# ------------------------------------------------------------------------------------------------
def llama_cpp_available() -> bool:
    """Whether llama-cpp-python imports here, checked in a child as it will run (nothing of it enters this process)."""
    try:
        return subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_llama_cpp(path: Path, prompts: dict[int, list[int]], n: int, reps: int, warmup: int, threads: int,
                  n_ctx: int, gpu: bool, advance: Callable[[], None]) -> dict[int, dict]:
    """The same prompt tokens and n through llama_cpp.Llama, greedy, in a child process; per context: TTFT, tok/s,
    token latencies and the child's peak RSS."""
    job = {"path": str(path), "prompts": {str(c): ids for c, ids in prompts.items()}, "n": n, "reps": reps,
           "warmup": warmup, "threads": threads, "n_ctx": n_ctx, "gpu": gpu}
    result, failure = None, None
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a chatty child cannot block on it
        proc = subprocess.Popen([sys.executable, "-m", "edgellm.llama_cpp_peer"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
            for line in proc.stdout:
                word, _, rest = line.strip().partition(" ")
                if word == "tick":
                    advance()
                elif word == "result":
                    result = json.loads(rest)
                elif word in ("error", "missing"):
                    failure = rest
        finally:
            if proc.poll() is None and result is None:
                proc.kill()
            proc.wait()
        if result is None:
            err.seek(0)
            tail = [ln for ln in err.read().splitlines() if ln.strip()]
            raise RuntimeError(failure or (tail[-1] if tail else f"the llama.cpp process exited with {proc.returncode}"))
    out = {}
    for c, runs in result["contexts"].items():
        ttft = statistics.median(r["ttft_s"] for r in runs)
        decode, lat = [], []
        for r in runs:
            times = r["token_times_s"]
            decode.append((len(times) - 1) / (times[-1] - times[0]))
            lat += [b - a for a, b in zip(times, times[1:])]
        tg = spread(decode)
        out[int(c)] = {"ttft_s": ttft, "prefill_tok_s": int(c) / ttft, "decode_tok_s": tg["median"],
                       "decode_tok_s_std": tg["std"], "decode_tok_s_min": tg["min"], "decode_tok_s_max": tg["max"],
                       "tpot_ms_p50": 1e3 * percentile(lat, 50), "tpot_ms_p99": 1e3 * percentile(lat, 99),
                       "peak_rss_bytes": result["peak_rss_bytes"]}
    return out


# ------------------------------------------------------------------------------------------------
# Machine description
# ------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "asimd",
                                "sve") if f in have]
    return []


def machine_info(device: torch.device) -> dict[str, Any]:
    import psutil

    from .kernels import matmul

    try:
        from importlib.metadata import version

        edgellm_version = version("edgellm")
    except Exception:  # noqa: BLE001 — running from a source tree without metadata
        edgellm_version = "dev"

    gpu = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        gpu = "Apple Metal (MPS)"
    return {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(),
        "cpu_kernels": matmul.cpu_kernel_build() if device.type == "cpu" else None, "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False), "threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total, "gpu": gpu, "device": str(device),
        "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "edgellm": edgellm_version, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _pm(median: float, std: float) -> str:
    return f"{median:.2f} ± {std:.2f}"


def table_lines(rows: list[dict]) -> list[list[str]]:
    """Two table lines per row: pp<c> (prefill) and tg<n>[@ctx<c>] (decode), as llama-bench prints."""
    with_llama = any(r.get("llama_cpp") for r in rows)
    with_draft = any(r["draft"] != "none" for r in rows)
    head = ["model", "size", "params", "backend", "threads", "weights", "kv", "draft", "decode", "test", "t/s",
            "TTFT s", "roofline t/s", "% roofline", "peak MiB"]
    if with_draft:
        head.append("accepted")
    if with_llama:
        head += ["llama.cpp t/s", "× llama.cpp", "llama.cpp MiB"]
    out = [head]
    error_ids = error_footnotes(rows)
    for r in rows:
        common = [r["model"], _mib(r["weight_bytes"]) if r.get("weight_bytes") else "—",
                  _params(r["params"]) if r.get("params") else "—", r["backend"], str(r["threads"]),
                  _weights_cell(r), r["kv"], r["draft"], (r.get("decode_path") or {}).get("name") or "—"]
        if r.get("error"):
            line = common + [f"{r['test_pp']}+{r['test_tg']}", f"n/a [{error_ids[r['error']]}]", "", "", "", ""]
            out.append(line + ([""] if with_draft else []) + (["", "", ""] if with_llama else []))
            continue
        s, lc = r["stats"], r.get("llama_cpp")
        pp = common + [r["test_pp"], _pm(s["prefill_tok_s"], s["prefill_tok_s_std"]), f"{s['ttft_s']:.3f}", "", "", ""]
        tg = common + [r["test_tg"], _pm(s["decode_tok_s"], s["decode_tok_s_std"]), "",
                       f"{s['roofline_tok_s']:.1f}", f"{s['roofline_pct']:.0f}%",
                       f"{s['peak_memory_bytes'] / 2**20:.0f}" if s.get("peak_memory_bytes") else ""]
        if with_draft:
            pp.append("")
            acc = s.get("acceptance_rate")
            tg.append("" if acc is None else f"{100 * acc:.0f}% ({s['mean_accepted_length']:.2f})")
        if with_llama:
            if lc:
                pp += [f"{lc['prefill_tok_s']:.2f}", f"{r['vs_llama_cpp']['prefill']:.2f}", ""]
                tg += [f"{lc['decode_tok_s']:.2f}", f"{r['vs_llama_cpp']['decode']:.2f}",
                       f"{lc['peak_rss_bytes'] / 2**20:.0f}" if lc.get("peak_rss_bytes") else ""]
            else:
                pp += ["", "", ""]
                tg += ["", "", ""]
        out += [pp, tg]
    return out


def error_footnotes(rows: list[dict]) -> dict[str, int]:
    """Each distinct row error → its footnote number, in order of appearance."""
    ids: dict[str, int] = {}
    for r in rows:
        if r.get("error") and r["error"] not in ids:
            ids[r["error"]] = len(ids) + 1
    return ids


def markdown_table(rows: list[dict], footnotes: bool = True) -> str:
    lines = table_lines(rows)
    numeric = {"size", "params", "threads", "t/s", "TTFT s", "roofline t/s", "% roofline", "peak MiB", "llama.cpp t/s",
               "× llama.cpp", "llama.cpp MiB", "accepted"}
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) if h in numeric else c.ljust(w)  # noqa: E731
                                          for c, w, h in zip(cells, widths, lines[0])) + " |"
    sep = "| " + " | ".join(("-" * (w - 1) + ":") if h in numeric else "-" * w
                            for w, h in zip(widths, lines[0])) + " |"
    out = [fmt(lines[0]), sep] + [fmt(line) for line in lines[1:]]
    if footnotes:
        out += [f"[{i}] {e}" for e, i in error_footnotes(rows).items()]
    return "\n".join(out)


def summary_lines(doc: dict) -> list[str]:
    m, bw = doc["machine"], doc["bandwidth"]
    gpu = f" · GPU {m['gpu']}" if m["gpu"] else ""
    lines = [f"edgellm {m['edgellm']} bench · {m['cpu']} ({m['cores_logical']} cores, {m['threads']} threads, "
             f"{m['ram_bytes'] / 2**30:.0f} GiB){gpu} · torch {m['torch']} · {m['date']}",
             f"memory bandwidth ({bw['device']}, {bw['array_mib']} MiB arrays): copy {bw['copy_gbs']:.1f} GB/s, "
             f"triad {bw['triad_gbs']:.1f} GB/s → roofline = {bw['bandwidth_gbs']:.1f} GB/s ÷ bytes per decoded token",
             ""]
    return lines


def footer_lines(doc: dict) -> list[str]:
    s = doc["settings"]
    lines = ["", f"pp<N>: TTFT and prefill tok/s for an N-token prompt of {Path(s['prompt_file']).name} (median "
             f"± std of {s['repetitions']}); tg{s['n_gen']}: decode tok/s of the {s['n_gen']} tokens that follow "
             f"it (@ctxN: after an N-token prompt); roofline: bandwidth ÷ (weights read + KV × mean context) per token; "
             "peak MiB: this process's peak memory (CPU: RSS) by then; llama.cpp's, in its own process."]
    reasons = {(p["name"], p["reason"]) for r in doc["rows"] if (p := r.get("decode_path")) and p["reason"]}
    lines += [f"decode {name}: {reason}" for name, reason in sorted(reasons)]
    prefills = {str(PrefillPath(**p)) for r in doc["rows"] if (p := r.get("prefill_path"))}
    lines += [f"prefill: {p}" for p in sorted(prefills)]
    if doc.get("note"):
        lines.append(f"note: {doc['note']}")
    return lines


def draw_plot(path: Path, doc: dict) -> str | None:
    """Decode tok/s vs context, one line per format (dotted: its roofline); None, or a one-line note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_HINT
    series: dict[str, list[tuple[int, float, float]]] = {}
    llama: dict[int, float] = {}
    for r in doc["rows"]:
        if r.get("error"):
            continue
        key = f"weights {r['weights']} · kv {r['kv']} · draft {r['draft']}"
        series.setdefault(key, []).append((r["context"], r["stats"]["decode_tok_s"], r["stats"]["roofline_tok_s"]))
        if r.get("llama_cpp"):
            llama[r["context"]] = r["llama_cpp"]["decode_tok_s"]
    if not series:
        return "--plot: no successful rows to draw"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, pts in series.items():
        pts.sort()
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle=":", color=line.get_color(), alpha=0.6)
    if llama:
        xs = sorted(llama)
        ax.plot(xs, [llama[x] for x in xs], marker="s", linestyle="--", color="black", label="llama.cpp")
    first = doc["rows"][0]
    ax.set_xlabel("context (prompt tokens before decoding)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{first['model']} · {first['backend']} · {first['threads']} threads (dotted: roofline)")
    measured = [p[1] for pts in series.values() for p in pts] + list(llama.values())
    roofs = [p[2] for pts in series.values() for p in pts]
    if min(measured) > 0 and max(roofs) / min(measured) > 20:
        ax.set_yscale("log")  # far below the limit (e.g. launch-bound on a GPU): keep both readable
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write the plot ({_first_line(e)})") from e
    finally:
        plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------
def row_labels(plan: BenchPlan, context: int) -> tuple[str, str]:
    tg = f"tg{plan.gen_tokens}" if context == plan.prompt_tokens else f"tg{plan.gen_tokens}@ctx{context}"
    return f"pp{context}", tg


@dataclass
class BenchRun:
    """What every row of one `edgellm bench` needs: the options, the text, the device, the progress."""
    args: argparse.Namespace
    options: Options
    plan: BenchPlan
    text: str
    device: torch.device
    threads: int
    bandwidth_gbs: float
    advance: Callable[..., None]
    describe: Callable[[str], None]
    add_work: Callable[[int], None]
    debug: bool
    notes: list[str]
    llama_cpp: bool = False  # --against llama.cpp, and llama-cpp-python imports here
    llama_results: dict[int, dict] | None = None

    def fail(self, e: Exception, prefix: str = "") -> str:
        """A failed format costs its rows, not the bench (with --debug: the traceback)."""
        if self.debug:
            raise e
        return prefix + _first_line(e)


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .device import pick_device, set_threads

    plan = plan_from_args(args)
    options = options_from_args(args)
    text, prompt_path = read_prompt_text(args.prompt_file)
    set_threads(args.threads)
    try:
        device = pick_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise BenchError(str(e)) from e
    notes: list[str] = []
    llama_cpp = bool(args.against) and llama_cpp_available()
    if args.against and not llama_cpp:
        notes.append(LLAMA_CPP_HINT)

    rows: list[dict] = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=args.no_progress) as bar:
        task = bar.add_task("memory bandwidth", total=1 + len(plan.rows()) * (plan.reps + plan.warmup))
        bandwidth = measure_bandwidth(device, args.stream_mib)
        bandwidth["device"] = str(device)
        bar.advance(task)
        run = BenchRun(args, options, plan, text, device, torch.get_num_threads(), bandwidth["bandwidth_gbs"],
                       advance=lambda k=1: bar.advance(task, k),
                       describe=lambda d: bar.update(task, description=d),
                       add_work=lambda k: bar.update(task, total=bar.tasks[0].total + k),
                       debug=options.debug,
                       notes=notes, llama_cpp=llama_cpp)
        for weights in plan.weights:
            rows += bench_weights(run, weights)

    doc = {
        "schema": SCHEMA_VERSION,
        "command": shlex.join(sys.argv),
        "machine": machine_info(device),
        "bandwidth": bandwidth,
        "settings": {"model": args.model, "n_prompt": plan.prompt_tokens, "n_gen": plan.gen_tokens,
                     "repetitions": plan.reps, "warmup": plan.warmup, "weights": plan.weights, "kv": plan.kv,
                     "draft": plan.draft, "contexts": plan.contexts, "prompt_file": str(prompt_path),
                     "device": str(device), "dtype": args.dtype, "threads": run.threads, "against": args.against,
                     "activations": options.kernel.activations, "prefill": args.prefill,
                     "compile": options.decode.compile},
        "note": args.note,
        "notes": notes,
        "rows": rows,
    }
    emit(doc, args)
    return 0 if any(not r["error"] for r in rows) else 1


def bench_weights(run: BenchRun, weights: str) -> list[dict]:
    """Load the model once with this weight format, then every (kv, draft, context) row of it."""
    plan = run.plan
    options = dataclasses.replace(run.options, load=dataclasses.replace(run.options.load, weights=weights,
                                                                        ctx=plan.max_context))
    loaded, error = None, missing_feature("weights", weights)
    if error is None:
        run.describe(f"loading · weights {weights}")
        reset_process_peak_rss()  # the rows' peak memory: this format's load and runs only
        try:
            loaded = load_from_options(options)
        except Exception as e:  # noqa: BLE001
            error = run.fail(e, f"loading with --weights {weights}: ")
    info = _model_info(loaded, run.device, run.threads) if loaded else _model_info_unloaded(run.args, run.device, run.threads)
    prompts = {c: prompt_ids(loaded.tokenizer, run.text, c) for c in plan.contexts} if loaded else {}
    if loaded and run.llama_cpp and run.llama_results is None:
        run.llama_results = _maybe_llama(run, loaded, prompts) or {}
    rows = []
    for kv in plan.kv:
        for draft in plan.draft:
            rows += bench_engine(run, options, (weights, kv, draft), loaded, info, prompts, error)
    del loaded
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def bench_engine(run: BenchRun, options: Options, formats: tuple[str, str, str], loaded, info: dict,
                 prompts: dict[int, list[int]], error: str | None) -> list[dict]:
    """One engine (KV format, draft proposer) on the loaded model: a row per context."""
    plan, (weights, kv, draft) = run.plan, formats
    error = error or missing_feature("kv", kv, loaded) or missing_feature("draft", draft, loaded)
    engine = None
    if not error:
        try:
            engine = engine_from_options(options, loaded, kv=kv, draft=draft)
        except Exception as e:  # noqa: BLE001
            error = run.fail(e, f"--kv {kv} --draft {draft}: ")
    rows = []
    for c in plan.contexts:
        pp_name, tg_name = row_labels(plan, c)
        shown = f"auto={engine.cache.kv_format}" if kv == "auto" and engine is not None else kv
        row = {**info, "weights": weights, "kv": shown, "draft": draft, "context": c, "prompt_tokens": c,
               "gen_tokens": plan.gen_tokens, "repetitions": plan.reps, "test_pp": pp_name, "test_tg": tg_name,
               "error": error, "stats": None, "runs": None, "llama_cpp": None, "vs_llama_cpp": None}
        rows.append(row)
        if not error and c + plan.gen_tokens > engine.max_seq_len:
            row["error"] = f"{c} + {plan.gen_tokens} tokens exceed the context of {engine.max_seq_len} (the model's limit)"
        if row["error"]:
            run.advance(plan.reps + plan.warmup)
            continue
        run.describe(f"{weights}/{kv}/{draft} · {pp_name}+{tg_name}")
        try:
            row.update(measure_row(engine, prompts[c], plan.gen_tokens, plan.reps, plan.warmup, run.advance))
        except Exception as e:  # noqa: BLE001
            row["error"] = run.fail(e)
            continue
        _add_physics(row, engine, run.bandwidth_gbs)
        path = engine.decode_path
        row["decode_path"] = {"name": path.name, "reason": path.reason}
        row["prefill_path"] = prefill_path(engine.model, len(prompts[c]),
                                           fused_prefill_rows(engine.compiled_step())).as_dict()
        lc = (run.llama_results or {}).get(c)
        if lc:
            s = row["stats"]
            row["llama_cpp"] = lc
            row["vs_llama_cpp"] = {"decode": s["decode_tok_s"] / lc["decode_tok_s"],
                                   "prefill": s["prefill_tok_s"] / lc["prefill_tok_s"],
                                   "ttft": s["ttft_s"] / lc["ttft_s"],
                                   "peak_memory": s["peak_memory_bytes"] / lc["peak_rss_bytes"]}
    return rows


def _weights_cell(row: dict) -> str:
    """`auto` says what it ran as: auto=Q4_K+Q6_K."""
    if row["weights"] != "auto" or not row.get("runs_as"):
        return row["weights"]
    return "auto=" + "+".join(part.split("×")[0] for part in row["runs_as"].split(", "))


def emit(doc: dict, args: argparse.Namespace) -> None:
    """The plot, the notes (stderr), the JSON file, and the table (stdout)."""
    rows, notes = doc["rows"], doc["notes"]
    if args.plot:
        note = draw_plot(Path(args.plot).expanduser(), doc)
        if note:
            notes.append(note)
    for note in notes:
        print(note, file=sys.stderr)
    if args.json and args.json != "-":
        write_text_atomic(Path(args.json).expanduser(), json.dumps(doc, indent=1) + "\n")
    if args.json == "-":
        for e, i in error_footnotes(rows).items():
            print(f"[{i}] {e}", file=sys.stderr)
        print(json.dumps(doc, indent=1))
    elif args.markdown:
        print(markdown_table(rows))
    else:
        print("\n".join(summary_lines(doc) + [markdown_table(rows)] + footer_lines(doc)))


def _model_info(loaded, device: torch.device, threads: int) -> dict:
    model = loaded.model
    total, read = weight_bytes(model)
    return {"model": Path(loaded.path).name, "model_path": str(loaded.path), "model_format": loaded.source_format,
            "file_bytes": loaded.file_bytes, "tensor_types": loaded.tensor_types,
            "params": loaded.config.num_parameters(), "backend": device.type.upper(), "device": str(device),
            "dtype": str(model.dtype).replace("torch.", ""), "threads": threads, "load_s": loaded.load_seconds,
            "weight_bytes": total, "weight_bytes_read_per_token": read, "runs_as": loaded.runs_as_text()}


def _model_info_unloaded(args, device: torch.device, threads: int) -> dict:
    from .loading import resolve_model

    try:  # a local path or the bundled model: named without loading it
        path = str(resolve_model(args.model)) if args.model is None or Path(args.model).expanduser().exists() else args.model
    except EdgeLLMError:
        path = args.model or "(bundled)"
    return {"model": Path(path).name, "model_path": path, "model_format": None, "file_bytes": None, "tensor_types": None,
            "params": None, "backend": device.type.upper(), "device": str(device), "dtype": args.dtype,
            "threads": threads, "load_s": None, "weight_bytes": None, "weight_bytes_read_per_token": None,
            "runs_as": None}


def _add_physics(row: dict, engine, bandwidth_gbs: float) -> None:
    """KV bytes, bytes per decoded token, roofline and the measured % of it, into row['stats']."""
    s = row["stats"]
    kv_per_token = engine.cache.bytes_per_token
    ctx = mean_decode_context(row["prompt_tokens"], row["gen_tokens"])
    per_token = bytes_per_decoded_token(row["weight_bytes_read_per_token"], kv_per_token, ctx)
    roof = roofline_tok_s(bandwidth_gbs, per_token)
    s.update({"load_s": row["load_s"], "weight_bytes": row["weight_bytes"],
              "weight_bytes_read_per_token": row["weight_bytes_read_per_token"],
              "kv_bytes_per_token": kv_per_token, "kv_cache_bytes": engine.cache.nbytes,
              "mean_decode_context": ctx, "bytes_per_decoded_token": per_token, "bandwidth_gbs": bandwidth_gbs,
              "roofline_tok_s": roof, "roofline_pct": 100 * s["decode_tok_s"] / roof,
              "achieved_gbs": s["decode_tok_s"] * per_token / 1e9})


def _maybe_llama(run: BenchRun, loaded, prompts: dict[int, list[int]]) -> dict[int, dict] | None:
    """llama.cpp's figures per context on the same GGUF and prompt tokens, or None (with a note)."""
    path, plan = Path(loaded.path), run.plan
    if loaded.source_format != "gguf" or path.suffix.lower() != ".gguf":
        run.notes.append(f"--against llama.cpp: {path.name} is not a .gguf file; export one with "
                         "`edgellm quantize SRC -o model.gguf` and bench that")
        return None
    run.add_work(len(prompts) * (plan.reps + plan.warmup))
    run.describe("llama.cpp")
    try:
        return run_llama_cpp(path, prompts, plan.gen_tokens, plan.reps, plan.warmup, run.threads, plan.max_context,
                             run.device.type == "cuda", run.advance)
    except Exception as e:  # noqa: BLE001 — a llama.cpp failure only loses the comparison
        if run.debug:
            raise
        run.notes.append(f"--against llama.cpp: failed ({_first_line(e)})")
        return None


def add_parser(sub) -> None:
    from .args import add_model_options

    p = sub.add_parser("bench", help="latency table (TTFT, tok/s) next to the bandwidth roofline and llama.cpp",
                       conflict_handler="resolve",
                       description="Every combination of the comma lists is one row; pp = prefill, tg = decode.")
    add_model_options(p)
    g = p.add_argument_group("bench")
    g.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    g.add_argument("-n", "--n-gen", type=int, default=128, help="tokens to decode (default 128)")
    g.add_argument("-r", "--repetitions", type=int, default=5, help="measured runs per row (default 5)")
    g.add_argument("--warmup", type=int, default=1, help="unmeasured runs per row (default 1)")
    # replaces the shared --ctx (one int): here it is the sweep of prompt lengths
    g.add_argument("--ctx", default=None, help="comma list of prompt lengths to decode after, e.g. 256,2048,6144")
    g.add_argument("--weights", default="auto", help="comma list of auto,fp,int8,int4 (default auto: as stored)")
    g.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), help="int4/int8 group size")
    g.add_argument("--kv", default="auto", help="comma list of auto,fp,f16,int8,int4 (default auto: f16 on the CPU, "
                                                "else fp)")
    g.add_argument("--activations", default=None, choices=("int8", "int8x2", "fp32"),
                   help="CPU int8/int4 matmuls' activations (default int8; see edgellm run --help)")
    g.add_argument("--draft", default="none", help="comma list of none,self,lookup (default none)")
    g.add_argument("--prompt-file", default=None, help=f"prompt text (default {DEFAULT_PROMPT_FILE})")
    g.add_argument("--against", default=None, metavar="llama.cpp", help="also run llama-cpp-python on the same GGUF")
    g.add_argument("--json", default=None, metavar="FILE", help="write the rows and the machine as JSON (- = stdout)")
    g.add_argument("--markdown", action="store_true", help="print only the markdown table")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="decode tok/s vs context (needs matplotlib)")
    g.add_argument("--stream-mib", type=int, default=None, help="bandwidth test array size (default 256 CPU, 1024 GPU)")
    g.add_argument("--note", default=None, help="free text stored in the JSON (e.g. 'machine shared')")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


COMMANDS = {"bench": cmd_bench}
