"""edgellm/prefetch.py: which files a command line names, and that the prefetch really brings a file that is not in
the page cache into it (checked with mincore), before torch is imported."""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from edgellm import prefetch as pf


def resident_share(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore on a mapping that touches none of them)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            buf = ctypes.c_char.from_buffer(m)
            try:
                assert libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0, \
                    os.strerror(ctypes.get_errno())
            finally:
                del buf
        finally:
            m.close()
    return sum(v & 1 for v in vec) / pages


def evicted_file(tmp_path: Path, mib: int = 48) -> Path:
    path = tmp_path / "model.gguf"
    with open(path, "wb") as f:
        f.write(os.urandom(mib << 20))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_share(path) > 0.1:  # tmpfs and some overlay filesystems keep every page: nothing to measure there
        pytest.skip(f"{tmp_path}'s filesystem keeps dropped pages cached")
    return path


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/BSD only")
def test_prefetch_reads_a_file_out_of_the_page_cache_into_it(tmp_path):
    path = evicted_file(tmp_path)
    before = resident_share(path)
    thread = pf.prefetch([path])
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()
    deadline = time.monotonic() + 20  # the thread only queues the reads; the disk finishes them (~0.1 s here)
    while (after := resident_share(path)) < 0.95 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert before < 0.1 and after > 0.95, (before, after)  # one fadvise of the whole range reads ~8 MiB of it


def test_prefetch_skips_files_bigger_than_half_the_free_memory(tmp_path, monkeypatch):
    path = tmp_path / "big.gguf"
    path.write_bytes(b"\0" * (1 << 20))
    monkeypatch.setattr(pf, "available_bytes", lambda: 1 << 20)
    assert pf.prefetch([path]) is None
    monkeypatch.setattr(pf, "available_bytes", lambda: 4 << 20)
    thread = pf.prefetch([path]) if hasattr(os, "posix_fadvise") else None
    assert thread is None or (thread.join(5) or not thread.is_alive())


def test_files_named_in_a_command_line(tmp_path):
    gguf = tmp_path / "m.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF")
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors", "config.json"):
        (folder / name).write_bytes(b"{}")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"GGUF")
    shards = [folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"]
    assert pf.files_named_in(["run", "hello", "-m", str(gguf)]) == [gguf]
    assert pf.files_named_in(["chat", f"--model={gguf}", "--draft", str(draft)]) == [gguf, draft]
    assert pf.files_named_in(["run", "hi", "-m", str(folder)]) == shards
    assert pf.files_named_in(["bench", "-m", f"{gguf},{folder}"]) == [gguf] + shards
    assert pf.files_named_in(["quantize", str(folder), "-o", str(out)]) == shards  # not the output it replaces
    assert pf.files_named_in(["quantize", str(gguf), f"--output={out}"]) == [gguf]
    # a hub id not in the cache or a missing file: nothing here to read (and not the bundled model: -m was given)
    assert pf.files_named_in(["run", "hi", "-m", "nobody-here/nothing"]) == []
    assert pf.files_named_in(["run", "x" * 5000, "-m", str(tmp_path / "missing.gguf")]) == []  # no OSError
    assert pf.files_named_in(["run", "a\0b", "-m", "~nobody-here/m.gguf"]) == []


def test_the_bundled_model_when_no_model_is_named():
    bundled = pf.bundled_files()
    assert [p.name for p in bundled] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]  # make install puts it there
    assert pf.files_named_in(["chat"]) == bundled
    assert pf.files_named_in(["run", "hello", "-n", "4"]) == bundled
    assert pf.files_named_in(["quantize"]) == []  # needs a source: nothing to guess


def test_the_command_starts_the_prefetch_before_it_imports_torch():
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["edgellm"] == "edgellm.entry:main"
    code = ("import sys, edgellm.entry; from edgellm.prefetch import files_named_in, prefetch; "
            "print(sorted(m for m in ('torch', 'numpy', 'edgellm.cli') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_command_imports_torch_with_the_collector_paused_then_freezes_it():
    """entry.import_frozen: the collector off during the import (no collection runs in it), on again after, with
    what the import made frozen (out of later passes); a module already imported is left as it is."""
    code = ("import gc, sys; from edgellm import entry; counts = []; "
            "gc.callbacks.append(lambda p, i: counts.append(p)); entry.import_frozen('edgellm.cli'); "
            "imported, frozen = len(counts), gc.get_freeze_count(); entry.import_frozen('edgellm.cli'); "
            "print(imported, 'torch' in sys.modules, gc.isenabled(), frozen, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    imported, torch_in, enabled, frozen, frozen_again = out
    assert (imported, torch_in, enabled) == ("0", "True", "True")
    assert int(frozen) > 100_000  # torch's modules, functions and classes
    assert frozen_again == frozen  # already imported: nothing more frozen


def test_the_command_prefetches_what_it_names_unless_told_not_to(tmp_path, monkeypatch):
    import edgellm.cli
    from edgellm import entry

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    asked: list[list[Path]] = []
    monkeypatch.setattr(entry, "prefetch", asked.append)
    monkeypatch.setattr(edgellm.cli, "main", lambda: 7)
    monkeypatch.setattr(sys, "argv", ["edgellm", "info", "-m", str(gguf)])
    assert entry.main() == 7
    assert asked == [[gguf]]
    monkeypatch.setenv("EDGELLM_PREFETCH", "0")
    assert entry.main() == 7
    assert asked == [[gguf]]


def test_hub_ids_in_the_local_cache(tmp_path, monkeypatch):
    """The hub cache's layout (models--org--name, refs/main naming a snapshot of links to blobs): a snapshot's
    safetensors, or one GGUF of it; nothing for an id the cache lacks."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir()
    snap.mkdir(parents=True)
    for name in ("model.safetensors", "m.Q4_K_M.gguf"):
        (repo / "blobs" / name).write_bytes(b"x" * 64)
        (snap / name).symlink_to(repo / "blobs" / name)
    assert pf.files_named_in(["chat", "-m", "org/name"]) == [snap / "model.safetensors"]  # (not the GGUFs beside)
    assert pf.files_named_in(["run", "hi", "-m", "org/name/m.Q4_K_M.gguf"]) == [snap / "m.Q4_K_M.gguf"]
    assert pf.files_named_in(["run", "hi", "-m", "org/other"]) == []
    thread = pf.prefetch(pf.files_named_in(["chat", "-m", "org/name/m.Q4_K_M.gguf"]))
    assert thread is not None and (thread.join(5) or not thread.is_alive())  # the link opened, read, closed
