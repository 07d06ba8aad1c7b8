"""End-to-end TTFT (and decode) of one GGUF file under two revisions of edgellm, fresh processes alternating:
what a change to the C++ kernels or the Python glue buys a user, measured as the other A/B scripts cannot (they
compare settings of one build, or one kernel file).

    python benchmarks/revisions_ab.py FILE.gguf --old REV [--new REV] [--rounds 4] [--ttft 512,2048] [--reps 3]
                                      [--decode 128] [--threads 2] [--json benchmarks/results/NAME.json]

--old / --new: git revisions, checked out as temporary worktrees; --new left out is the working tree as it is
(uncommitted changes included). Each child imports edgellm from its own tree (the extension builds once per source
hash, in the shared cache), loads the file with `--weights auto`, warms up, then times --reps prompts of each --ttft
length (GPL-3 text, as benchmarks/gguf_vs_llamacpp.py) and, with --decode N, N greedy tokens after the chat prompt.
Rounds alternate which revision goes first; the ratio is the medians' new / old (below 1: the new one is faster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from run_record import CHILD_ENV, run_child, write_run  # benchmarks/, this script's folder

ROOT = Path(__file__).resolve().parents[1]
TEXT = "/usr/share/common-licenses/GPL-3"
CHAT = "Tell me a random fun fact about the Roman Empire"

# The child: edgellm's packages mapped to the given tree (as pyproject's package-dir maps them for an install).
CHILD = r"""
import importlib.util, json, statistics, sys, tomllib
from pathlib import Path
root = Path(sys.argv[1])
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

class TreeFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in dirs:
            return None
        folder = root / dirs[name]
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])

sys.meta_path.insert(0, TreeFinder)
from edgellm.args import engine_from_args, load_from_args
from edgellm.bench import run_once
from edgellm.cli import build_parser
import edgellm
assert Path(edgellm.__file__).resolve().is_relative_to(root.resolve()), edgellm.__file__
model, threads, lengths, reps, decode = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
args = build_parser().parse_args(["run", "x", "-m", model, "--ctx", str(max(lengths + [512]) + 512), "--threads", threads])
loaded = load_from_args(args)
engine = engine_from_args(args, loaded)
tok = loaded.tokenizer
text = tok.encode(open(%(text)r).read())
chat = tok.encode_chat([{"role": "user", "content": %(chat)r}])
run_once(engine, chat, 8)
out = {}
if decode:
    out["decode_tok_s"] = statistics.median(run_once(engine, chat, decode)[0].decode_tok_s for _ in range(reps))
for n in lengths:
    out[f"ttft_{n}_s"] = statistics.median(run_once(engine, text[:n], 1)[0].ttft_s for _ in range(reps))
print(json.dumps(out))
""" % {"text": TEXT, "chat": CHAT}


def measure(tree: Path, args: argparse.Namespace) -> dict:
    code, out, err, _ = run_child([sys.executable, "-c", CHILD, str(tree), args.model, str(args.threads),
                                   json.dumps(args.ttft), str(args.reps), str(args.decode)], env=CHILD_ENV)
    if code != 0:
        raise SystemExit(f"{tree}: the child failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def worktree(rev: str, parent: Path) -> Path:
    path = parent / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=None, help="a revision (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ttft", type=lambda s: [int(v) for v in s.split(",") if v], default=[512])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="edgellm-ab-") as tmp:
        trees = {"old": worktree(args.old, Path(tmp))}
        trees["new"] = worktree(args.new, Path(tmp)) if args.new else ROOT
        try:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    runs[which].append(measure(trees[which], args))
                    print(f"round {r + 1} {which}: {runs[which][-1]}", flush=True)
        finally:
            for which in ("old", "new"):
                if trees[which] != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[which])],
                                   capture_output=True)
    medians = {w: {k: statistics.median(run[k] for run in runs[w]) for k in runs[w][0]} for w in runs}
    ratio = {k: medians["new"][k] / medians["old"][k] for k in medians["old"]}
    for k in ratio:
        print(f"{k:16s} old {medians['old'][k]:9.3f}  new {medians['new'][k]:9.3f}  new/old x{ratio[k]:.3f}")
    if args.json:
        write_run(args.json, [{"file": args.model, "old": args.old, "new": args.new or "working tree",
                               "runs": runs, "median": medians, "new_over_old": ratio}], args.threads)


if __name__ == "__main__":
    main()
