"""edgellm's GGUF tokenizers against llama.cpp's own tokenizer tests: the vocabulary-only GGUFs of real models in
llama.cpp's models/ folder (Llama 2 and 3, Qwen2, Phi-3, GPT-2, StarCoder, ...), each with test strings (.inp) and
the ids llama.cpp's test-tokenizer-0 expects (.out). The files come in llama-cpp-python's source archive:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/sdist && tar xzf /tmp/sdist/llama_cpp_python-*.tar.gz -C /tmp/sdist
    python benchmarks/tokenizer_vs_llamacpp.py /tmp/sdist/llama_cpp_python-*/vendor/llama.cpp/models \
        [--json benchmarks/results/tokenizer-vs-llamacpp.json]

Per vocabulary: strings encoded to llama.cpp's ids, the first that is not, and the time to read the header and
build the tokenizer. Vocabularies of a tokenizer model or pre-tokenizer edgellm does not know are listed as such.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SEPARATOR = "\n__ggml_vocab_test__\n"  # llama.cpp's tests/test-tokenizer-0 splits the .inp file on this


class VocabOnly:
    """What tokenizer_from_gguf reads of a source (`field`, `path`), for a GGUF without tensors."""

    def __init__(self, path: Path):
        from edgellm.gguf_file import GGUFFile

        self.path, self.fields = path, GGUFFile(path).fields

    def field(self, key: str, default=None):
        return self.fields.get(key, default)


def check(vocab: Path) -> dict:
    from edgellm.errors import EdgeLLMError
    from edgellm.tokenizer import tokenizer_from_gguf

    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    expected = [[int(t) for t in line.split()] for line in Path(f"{vocab}.out").read_text().splitlines()]
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tok = tokenizer_from_gguf(VocabOnly(vocab))
    except EdgeLLMError as e:
        return {"vocab": vocab.name, "refused": str(e).split(": ", 1)[-1]}
    load_s = time.perf_counter() - t0
    row = {"vocab": vocab.name, "model": tok.meta.get("model"), "pre": tok.meta.get("pre"),
           "tokens": tok.vocab_size, "load_s": round(load_s, 3), "warnings": [str(w.message) for w in caught]}
    pairs = list(zip(texts, expected))  # the .inp ends with a separator: one text more than lines
    wrong = [(t, e, tok.encode(t, add_bos=False)) for t, e in pairs if tok.encode(t, add_bos=False) != e]
    row |= {"strings": len(pairs), "equal": len(pairs) - len(wrong)}
    if wrong:
        text, want, got = wrong[0]
        row["first_difference"] = {"text": text, "llama.cpp": want, "edgellm": got}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", type=Path, help="llama.cpp's models/ folder (ggml-vocab-*.gguf with .inp / .out)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for vocab in sorted(args.models.glob("ggml-vocab-*.gguf")):
        if Path(f"{vocab}.inp").exists() and Path(f"{vocab}.out").exists():
            rows.append(check(vocab))
            r = rows[-1]
            print(f"{r['vocab']:34} " + (f"refused: {r['refused'][:80]}" if "refused" in r else
                  f"{r['equal']}/{r['strings']} equal, pre {r['pre']!r}, {r['load_s']:.3f} s"
                  + (" (unknown pre-tokenizer)" if r["warnings"] else "")), flush=True)
    if args.json:
        doc = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": platform.processor() or platform.machine(), "rows": rows}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
