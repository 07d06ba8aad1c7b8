"""Dependencies point down: the package's import graph has no cycles and follows a declared layer order.

Every module of the installed package (edgellm, edgellm.quant, edgellm.kernels, edgellm.tui, mapped from
their folders by pyproject.toml) is parsed with `ast`: top-level AND function-local imports, relative ones
resolved, plus `importlib.import_module("edgellm....")` names (cli.py loads its subcommands that way). A
function-local import is still a dependency: it only hides a cycle from the interpreter, not from a reader.
"""
from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module may import modules of its own layer and of the layers below it, never above.
# Every module must be named here (a new module is placed on purpose, not by a catch-all).
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["edgellm.errors", "edgellm.atomic", "edgellm.rss", "edgellm.device",
                    "edgellm.prefetch",  # (prefetch, torch_import: the standard library only, imported before torch)
                    "edgellm.torch_import",
                    "edgellm.hugepages"]),  # a model's weights onto 2 MiB pages while the engine is idle
    ("kernels", ["edgellm.kernels.*"]),  # the hot loops: import nothing of ours above the foundation
    ("options", ["edgellm.options"]),  # the frozen run options: the kernels' option types, composed
    ("config", ["edgellm.config"]),  # ModelConfig: what a model is, from HF config.json or GGUF metadata
    ("formats", ["edgellm.gguf_file",  # the one checked GGUF reader, GGUF type tables and row layout
                 "edgellm.file_checks",  # safetensors header checks; a file's config/tensors/tokenizer checked
                 "edgellm.early_repack",  # a GGUF's K-quants repacked while torch is imported (no torch)
                 # text <-> ids from a file's vocabulary (no torch): early_repack builds a GGUF's before torch's import
                 "edgellm.tokenizer", "edgellm.spm_merges", "edgellm.chat_template"]),
    ("quant", ["edgellm.quant.*"]),  # quantization math and the quantized modules (no whole model)
    ("model", ["edgellm.model", "edgellm.cache", "edgellm.kv_calibration", "edgellm.decode_step", "edgellm.prefill_path",
               "edgellm.sampling"]),
    ("loading", ["edgellm.loading", "edgellm.quantized_format", "edgellm.gguf_export",
                 "edgellm.weight_calibration"]),  # whole models from files, and back to files
    ("generate", ["edgellm.generate", "edgellm.speculative"]),
    ("args", ["edgellm.args"]),  # argparse -> Options, and the loaders the commands share
    ("apps", ["edgellm.bench", "edgellm.llama_cpp_peer", "edgellm.quantize", "edgellm.perplexity", "edgellm.serve", "edgellm.serve_worker",
              "edgellm.openai_schema", "edgellm.serve_cli", "edgellm.tui.*"]),
    ("cli", ["edgellm.cli"]),
    ("entry", ["edgellm.entry"]),  # the console script: the prefetch and the early repack, then the CLI (and torch)
]

# ------------------------------------------------------------------------------------------------
# The graph
# ------------------------------------------------------------------------------------------------
def package_folders() -> dict[str, Path]:
    """{package: folder} as pyproject.toml installs them."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool.get("package-dir", {})
    return {pkg: ROOT / dirs.get(pkg, pkg.replace(".", "/")) for pkg in tool["packages"]}


def module_files() -> dict[str, Path]:
    """{dotted module name: file} for every module of the package (package __init__s included)."""
    out = {}
    for pkg, folder in package_folders().items():
        for f in folder.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> dict[str, str]:
    """{imported module of ours: how ("line 12" / "line 40, dynamic")} for one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: dict[str, str] = {}

    def add(target: str, node: ast.AST, how: str = "") -> None:
        # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, f"line {node.lineno}{how}")

    dynamic = any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                stem = f"{base}.{node.module}" if node.module else base
            else:
                stem = node.module or ""
            for alias in node.names:
                add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem, node)
        elif dynamic and isinstance(node, ast.Constant) and node.value in modules:
            add(node.value, node, ", dynamic")  # a module name handed to importlib.import_module
    return found


def import_graph() -> dict[str, dict[str, str]]:
    files = module_files()
    names = set(files)
    return {name: imports_of(name, f, names) for name, f in sorted(files.items())}


def layer_of(module: str) -> int | None:
    hits = [i for i, (_, patterns) in enumerate(LAYERS) for p in patterns if fnmatch.fnmatchcase(module, p)]
    return hits[0] if len(set(hits)) == 1 else None


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(_path_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path_through(graph: dict[str, dict[str, str]], component: set[str]) -> list[str]:
    """A shortest closed path a -> ... -> a inside the component (what to show a reader)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a component of > 1 has one


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------
def test_the_graph_sees_every_kind_of_import():
    """The parser itself: relative, absolute, function-local, `from . import x` and dynamic names."""
    graph = import_graph()
    assert "edgellm.errors" in graph["edgellm.atomic"]  # top-level `from .errors import`
    assert "edgellm.kernels.matmul" in graph["edgellm.quant.linear"]  # `from ..kernels import matmul as K`
    assert "edgellm.tui.history" in graph["edgellm.tui.app"]  # `from .history import`
    assert "edgellm.generate" in graph["edgellm.tui.session"]  # absolute `from edgellm.generate import`
    assert "edgellm.speculative" in graph["edgellm.generate"]  # function-local
    assert "edgellm.bench" in graph["edgellm.cli"] and "dynamic" in graph["edgellm.cli"]["edgellm.bench"]


def test_every_module_has_one_layer():
    unplaced = [m for m in import_graph() if layer_of(m) is None and m not in package_folders()]
    assert not unplaced, f"modules in no layer (or in two) of LAYERS: {unplaced}"


def test_package_inits_import_nothing():
    """Edges to a package mean its __init__; they are empty, so a layer check of them would check nothing."""
    graph = import_graph()
    assert {pkg: graph[pkg] for pkg in package_folders() if graph[pkg]} == {}


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_dependencies_point_down():
    graph = import_graph()
    violations = []
    for module, deps in graph.items():
        here = layer_of(module)
        for dep, how in sorted(deps.items()):
            there = layer_of(dep)
            if here is None or there is None or there <= here:
                continue
            violations.append(f"  {module} ({LAYERS[here][0]}) imports {dep} ({LAYERS[there][0]}), {how}")
    assert not violations, f"{len(violations)} imports point up:\n" + "\n".join(violations)

