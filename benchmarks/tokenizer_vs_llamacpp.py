"""edgellm's GGUF tokenizers against llama.cpp's own tokenizer tests: the vocabulary-only GGUFs of real models in
llama.cpp's models/ folder (Llama 2 and 3, Qwen2, Phi-3, GPT-2, StarCoder, ...), each with test strings (.inp) and
the ids llama.cpp's test-tokenizer-0 expects (.out). The files come in llama-cpp-python's source archive:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/sdist && tar xzf /tmp/sdist/llama_cpp_python-*.tar.gz -C /tmp/sdist
    python benchmarks/tokenizer_vs_llamacpp.py /tmp/sdist/llama_cpp_python-*/vendor/llama.cpp/models \
        [--json benchmarks/results/tokenizer-vs-llamacpp.json]

Per vocabulary: strings encoded to llama.cpp's ids, the first that is not, and the time to read the header and
build the tokenizer. Vocabularies of a tokenizer model or pre-tokenizer edgellm does not know are listed as such.

With `--peer-python` (an interpreter with llama-cpp-python), the pre-tokenizers no test file covers are checked
against llama.cpp itself: Llama 3's vocabulary relabelled with each name of PRE_NAMES, the test strings and some
mixed-case / digit / contraction ones tokenized by both (llama.cpp loads the vocabulary alone).
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
PRE_NAMES = ["tekken", "gpt-4o", "llama4", "dbrx", "smaug-bpe", "deepseek-r1-qwen", "smollm", "codeshell"]
EXTRA = ["HelloWorld ABCdef aBC \u00c9COLE \u00c9cole", "I'M HERE, you're THEY'LL", "1234567 12 3.14159",
         "x/y/z\r\n/path", "na\u00efve caf\u00e9 Vi\u1ec7t Nam", "MixedCASEWords andCamelCase"]
PEER = """import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=False) for t in json.load(sys.stdin)]))"""


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
    return row | compared(tok, texts, expected)  # the .inp ends with a separator: one text more than lines


def compared(tok, texts: list[str], want: list[list[int]]) -> dict:
    """How many of `texts` (as many as `want` has ids for) `tok` encodes to llama.cpp's ids, and the first it does
    not."""
    pairs = list(zip(texts, want))
    wrong = [(t, w, got) for t, w in pairs if (got := tok.encode(t, add_bos=False)) != w]
    row = {"strings": len(pairs), "equal": len(pairs) - len(wrong)}
    if wrong:
        text, ids, got = wrong[0]
        row["first_difference"] = {"text": text, "llama.cpp": ids, "edgellm": got}
    return row


def check_live(vocab: Path, pre: str, peer_python: str, work: Path) -> dict:
    """`vocab` relabelled as `pre`: edgellm's ids against llama.cpp's (run by `peer_python`) on the test strings."""
    import subprocess

    from edgellm.tokenizer import tokenizer_from_gguf

    import gguf

    from gguf_copy import write_copy  # benchmarks/, this script's folder

    out = work / f"vocab-{pre}.gguf"
    write_copy(gguf.GGUFReader(str(vocab)), out, {"tokenizer.ggml.pre": pre})  # the vocabulary, relabelled
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split(SEPARATOR) + EXTRA
    proc = subprocess.run([peer_python, "-c", PEER, str(out)], input=json.dumps(texts), capture_output=True,
                          text=True, check=True)
    want = json.loads(proc.stdout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = tokenizer_from_gguf(VocabOnly(out))
    return {"vocab": f"{vocab.name} as {pre!r}", "pre": pre, "warnings": [str(w.message) for w in caught]} | \
        compared(tok, texts, want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", type=Path, help="llama.cpp's models/ folder (ggml-vocab-*.gguf with .inp / .out)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--peer-python", default=None, help="an interpreter with llama-cpp-python: also check PRE_NAMES")
    args = ap.parse_args()
    rows = []
    jobs = [lambda v=v: check(v) for v in sorted(args.models.glob("ggml-vocab-*.gguf"))
            if Path(f"{v}.inp").exists() and Path(f"{v}.out").exists()]
    if args.peer_python:
        import tempfile

        work = Path(tempfile.mkdtemp())
        jobs += [lambda p=p: check_live(args.models / "ggml-vocab-llama-bpe.gguf", p, args.peer_python, work)
                 for p in PRE_NAMES]
    for job in jobs:
        r = job()
        rows.append(r)
        took = f", {r['load_s']:.3f} s" if "load_s" in r else ""
        print(f"{r['vocab']:40} " + (f"refused: {r['refused'][:80]}" if "refused" in r else
              f"{r['equal']}/{r['strings']} equal, pre {r['pre']!r}{took}"
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
