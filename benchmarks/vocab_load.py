"""What a GGUF vocabulary costs at load, old way against new, in one process, runs alternated: the header's string
arrays read by the Python loop or vectorized (`gguf_file._Reader._strings_vectorized`), and a SentencePiece
vocabulary's merges by the plain loop (`spm_merges.merges_by_loop`) or in numpy (`spm_merges.spm_merges`).

    python benchmarks/vocab_load.py /tmp/sdist/llama_cpp_python-*/vendor/llama.cpp/models [--runs 5] \
        [--json benchmarks/results/vocab-load.json]

The files: llama.cpp's vocabulary-only GGUFs of real models (see tokenizer_vs_llamacpp.py for where they come
from). Gemma 4's file holds a 262144-piece list: its pieces with scores -id stand for a Gemma 2/3 SentencePiece
vocabulary of that size (its own tokenizer is BPE with merges, and its header is one edgellm refuses).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def alternate(old, new, runs: int) -> dict:
    """Median seconds of each, run old / new / new / old ...; both results must be equal."""
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(runs):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t0 = time.perf_counter()
            out = (old if name == "old" else new)()
            times[name].append(time.perf_counter() - t0)
            if name == "old":
                expected = out
            else:
                got = out
    assert got == expected, "the two ways disagree"
    return {k: round(statistics.median(v), 4) for k, v in times.items()} | {"runs": runs}


def main() -> None:
    import gguf

    from edgellm.gguf_file import GGUFFile, _Reader
    from edgellm.spm_merges import merges_by_loop, spm_merges

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    vectorized = _Reader._strings_vectorized

    def header(path: Path, fast: bool):
        _Reader._strings_vectorized = vectorized if fast else (lambda self, count: None)
        try:
            return GGUFFile(path).fields
        finally:
            _Reader._strings_vectorized = vectorized

    rows = []
    for name in ("llama-spm", "phi-3", "llama-bpe", "qwen2", "command-r"):
        path = args.models / f"ggml-vocab-{name}.gguf"
        row = {"vocab": path.name, "header": alternate(lambda: header(path, False), lambda: header(path, True),
                                                       args.runs)}
        fields = GGUFFile(path).fields
        row["tokens"] = len(fields["tokenizer.ggml.tokens"])
        if fields.get("tokenizer.ggml.model") == "llama":
            tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
            vocab = {t: i for i, t in enumerate(tokens)}
            row["spm_merges"] = alternate(lambda: merges_by_loop(tokens, scores, vocab),
                                          lambda: spm_merges(tokens, scores, vocab), args.runs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    tokens = gguf.GGUFReader(str(args.models / "ggml-vocab-gemma-4.gguf")).fields["tokenizer.ggml.tokens"].contents()
    scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    rows.append({"vocab": "ggml-vocab-gemma-4.gguf's pieces as a SentencePiece vocabulary", "tokens": len(tokens),
                 "spm_merges": alternate(lambda: merges_by_loop(tokens, scores, vocab),
                                         lambda: spm_merges(tokens, scores, vocab), args.runs)})
    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        doc = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": platform.processor() or platform.machine(), "rows": rows}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
