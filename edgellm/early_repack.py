"""Repack a GGUF's matrices for the CPU kernels while Python imports torch.

On a CPU the loader copies each Q2_K..Q6_K, IQ4_XS, Q5_0, Q5_1 and IQ4_NL matrix into the x8 layout the kernels
multiply (quant/gguf_linear.repack_for_cpu) and splits Q4_0 / Q4_1 / Q8_0 blocks into edgellm's own int4 / int8
layout (quant/groups.gguf_into): ~0.25-0.4 s of a 1B file's load, after torch's ~0.8 s import, which keeps one core
busy and leaves the other idle. The `edgellm` command starts that work first, on a thread that calls a plain C build
of the same code (kernels/early_repack.cpp, through ctypes: the GIL is released), so the idle core does it during the
import. The loader then takes each result whose sources, types, shapes (and Q/K row order) are the ones it would
use itself, with the extension build the library came from; it helps finish the rest and does anything else as
before (the r8 tails, the rows past a multiple of 8). The grid i-quants (IQ1_S ... IQ3_S) are recoded as their L4
forms straight into those forms' x8 layout, as the loader's recoding does. A head start only: a file, build or
setting this module does not foresee loads as it always did.

With the repack begun, the command also builds the file's tokenizer while the dynamic loader maps torch's native
library on another thread (torch_import.preload_native_library): the tokenizer is Python and Rust work that holds
the GIL and loads no library, the preload loads a library and holds no GIL, so each has a core (0.07 s for
SmolLM2's 49k tokens, 0.2 s for Qwen2's 152k; the library 0.13-0.15 s). Neither can overlap torch's import itself:
that holds the GIL, and its own loads of libraries wait for the loader's lock.

Imports nothing heavy (numpy, through gguf_file; torch imports it anyway; tokenizers, which the loader would).
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import json
import mmap
import os
import platform
import threading
import warnings
from pathlib import Path

from .gguf_file import GGUFFile, grid_codebook
from .kernels.ext_cache import cache_root, python_tag, repack_pointer
from .prefetch import bundled_files
from .torch_import import preload_native_library, torch_build

# The commands that load one model with the settings below; `quantize`, `info` and `perplexity` (which loads the
# model twice, as stored and as fp) are left to the loader.
COMMANDS = ("run", "chat", "serve", "bench")


class RepackJob(ctypes.Structure):  # kernels/early_repack.cpp's
    _fields_ = [("src", ctypes.c_void_p), ("dst", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("mins", ctypes.c_void_p), ("grid", ctypes.c_void_p), ("ksigns", ctypes.c_void_p),
                ("type", ctypes.c_int64), ("rows", ctypes.c_int64), ("k", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("src_bytes", ctypes.c_int64), ("done", ctypes.c_int64)]


# The warnings Python's default filters do not show (a library's deprecations): recorded while the tokenizer is built
# early, they keep it; any other makes the loader build it again, and show it.
QUIET_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
# The most of the file one job reads (its pages dropped when it is done): _row_chunks.
CHUNK_BYTES = 8 << 20
# The GGUF types that are edgellm's own int8 / int4 layout (quant/groups.GGUF_BLOCKS): type id -> (bits, fp16 fields)
EXACT_TYPES = {2: (4, 1), 3: (4, 2), 8: (8, 1)}  # Q4_0, Q4_1, Q8_0
# The grid i-quants whose L4 recoding takes their codebook (quant/gguf_grid.l4_tables): type id -> gguf.quants name
L4_TABLES = {19: "IQ1_S", 17: "IQ2_XS", 22: "IQ2_S", 29: "IQ1_M"}


class EarlyRepack:
    """The copies of one GGUF's matrices in the layouts the CPU kernels multiply, made by a background thread (and,
    once the loader asks, by the asking thread too): x8 for the types that have it, edgellm's int4 / int8 layout for
    Q4_0 / Q4_1 / Q8_0 (fused and unpermuted as the loader's plan has them). `file` is the parsed, mapped GGUF, for
    the loader to use rather than map the file again."""

    def __init__(self, lib: ctypes.CDLL, build: str, path: Path):
        """`lib`: kernels/early_repack.cpp's build, from `repack_library`."""
        self.build = build
        self._run = lib.edgellm_repack_run
        self.file = GGUFFile(path)
        self._adopted = False
        self._specs: list[tuple] = []
        self._outputs: list[mmap.mmap] = []
        self._x8: dict[tuple, tuple[list[int], int]] = {}  # (address, type, rows, k) -> (jobs, output)
        self._codebooks: dict[int, tuple] = {}  # type id -> (grid, ksigns) arrays its jobs point at
        self._exact: dict[tuple, tuple[list[int], list[int | None]]] = {}  # parts' keys -> (jobs, outputs)
        self._plan_x8(lib)
        self._plan_exact()
        self._jobs = (RepackJob * len(self._specs))(*self._specs)
        self._next, self._stop = ctypes.c_int64(0), ctypes.c_int64(0)
        self._thread: threading.Thread | None = None
        self._finished = False
        self._taken: set[int] = set()
        self.tokenizer = None
        self._go = threading.Event()

    def _output(self, nbytes: int) -> tuple[int, int]:
        """(index, address) of a new output of nbytes."""
        self._outputs.append(_anonymous(nbytes))
        return len(self._outputs) - 1, _address(self._outputs[-1])

    def _plan_x8(self, lib: ctypes.CDLL) -> None:
        """The first rows // 8 * 8 rows of each matrix in the x8 layout of its type, or of a grid i-quant's L4 form
        (quant/gguf_linear._repack_part's)."""
        tied = "output.weight" not in self.file.tensors  # then the embedding is the LM head too, else only looked up
        for name, t in self.file.tensors.items():
            if len(t.shape) != 2 or (name == "token_embd.weight" and not tied):
                continue
            rows, k = t.shape
            n8, row_bytes = rows // 8 * 8, lib.edgellm_x8_row_bytes(t.type_id, k)
            if n8 and row_bytes:
                grid, ksigns = self._codebook(t.type_id)
                src, src_row = self.file.data(name).ctypes.data, t.n_bytes // rows
                out, dst = self._output(n8 * row_bytes)
                jobs = [self._job(src + r * src_row, dst + r * row_bytes, None, None, grid, ksigns, t.type_id, n, k,
                                  0, n * src_row) for r, n in _row_chunks(n8, 8, src_row)]  # (8 rows: one x8 group)
                self._x8[(src, t.type_id, n8, k)] = (jobs, out)

    def _job(self, *spec) -> int:
        """The index of a new job: RepackJob's fields but `done`."""
        self._specs.append((*spec, 0))
        return len(self._specs) - 1

    def _codebook(self, type_id: int) -> tuple[int | None, int | None]:
        """(grid, ksigns) addresses for a type's jobs: the recoding's tables where it takes them, else (None, None)."""
        if type_id not in L4_TABLES:
            return None, None
        if type_id not in self._codebooks:
            self._codebooks[type_id] = grid_codebook(L4_TABLES[type_id])  # (kept alive as long as the jobs)
        grid, ksigns = self._codebooks[type_id]
        return grid.ctypes.data, ksigns.ctypes.data

    def _plan_exact(self) -> None:
        """Our matrices of Q4_0 / Q4_1 / Q8_0 blocks as loading.weight_plan makes them of a GGUF: Q/K/V and gate/up
        fused (llama.cpp's names), Q/K rows unpermuted for llama / mistral. A file it does not describe (Phi-3's
        fused tensors, another naming) is left to the loader."""
        fields = self.file.fields
        arch = fields.get("general.architecture")
        layers, heads = fields.get(f"{arch}.block_count"), fields.get(f"{arch}.attention.head_count")
        if not isinstance(layers, int) or not isinstance(heads, int):
            return
        permute = {"attn_q": heads, "attn_k": fields.get(f"{arch}.attention.head_count_kv", heads)}
        if arch not in ("llama", "mistral"):  # llama.cpp permutes Q/K for llama-arch models only
            permute = {}
        groups = [["token_embd.weight"], ["output.weight"]]
        for i in range(layers):
            groups += [[f"blk.{i}.attn_{x}.weight" for x in "qkv"], [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"],
                       [f"blk.{i}.attn_output.weight"], [f"blk.{i}.ffn_down.weight"]]
        for names in groups:
            ts = [self.file.tensors.get(n) for n in names]
            if any(t is None or len(t.shape) != 2 for t in ts) or len({(t.type_id, t.shape[1]) for t in ts}) != 1:
                continue
            type_id, k = ts[0].type_id, ts[0].shape[1]
            heads = [int(permute.get(name.split(".")[-2], 0)) for name in names]
            if type_id not in EXACT_TYPES or k % 32 or any(h and t.shape[0] % (2 * h) for t, h in zip(ts, heads)):
                continue  # (rows that are not whole pairs of each head's: the loader's path reports the file)
            bits, fp16_fields = EXACT_TYPES[type_id]
            rows = sum(t.shape[0] for t in ts)
            codes, codes_at = self._output(rows * k * bits // 8)
            scales, scales_at = self._output(rows * k // 32 * 2)
            mins, mins_at = self._output(rows * k // 32 * 2) if fp16_fields == 2 else (None, None)
            key, jobs, row0 = [], [], 0
            for name, t, h in zip(names, ts, heads):
                src, n, src_row = self.file.data(name).ctypes.data, t.shape[0], t.n_bytes // t.shape[0]
                key.append((src, type_id, n, k, h))
                # (rows unpermuted within each head's: chunks of whole heads)
                for r, m in _row_chunks(n, n // h if h else 1, src_row):
                    at = row0 + r
                    scale_at = at * k // 32 * 2
                    jobs.append(self._job(src + r * src_row, codes_at + at * k * bits // 8, scales_at + scale_at,
                                          None if mins_at is None else mins_at + scale_at, None, None, type_id, m, k,
                                          m // (n // h) if h else 0, m * src_row))
                row0 += n
            self._exact[tuple(key)] = (jobs, [codes, scales, mins])

    def start(self, held: bool = False) -> None:
        """Repack on a thread of its own; `held`: once `release()` is called."""
        if not held:
            self._go.set()

        def work() -> None:
            self._go.wait()
            self._work()

        self._thread = threading.Thread(target=work, name="edgellm-early-repack", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._go.set()

    def _work(self) -> None:
        self._run(self._jobs, len(self._jobs), ctypes.byref(self._next), ctypes.byref(self._stop))

    def _all_done(self) -> None:
        if not self._finished:  # the loader's first ask: this thread takes the jobs left, then waits for the last
            self._finished = True
            self.release()
            self._work()
            if self._thread is not None:
                self._thread.join()

    def take(self, address: int, type_id: int, rows: int, k: int) -> mmap.mmap | None:
        """The x8 copy (a grid i-quant's: of its L4 form) of the `rows` x `k` matrix of `type_id` at `address` (in
        `file`'s map), or None."""
        found = self._x8.get((address, type_id, rows, k))
        if found is None:
            return None
        self._all_done()
        if not all(self._jobs[j].done == 1 for j in found[0]):  # (-1: the recoding refused the blocks; the loader's
            return None                                           # own says why)
        self._taken.add(found[1])
        return self._outputs[found[1]]

    def take_exact(self, parts: tuple[tuple[int, int, int, int, int], ...]) -> list[mmap.mmap | None] | None:
        """[codes, fp16 scales, fp16 mins or None] of the matrix fused from `parts`, each (address, type, rows, k,
        heads to unpermute or 0) in order, or None."""
        found = self._exact.get(tuple(parts))
        if found is None:
            return None
        self._all_done()
        jobs, outputs = found
        if not all(self._jobs[j].done == 1 for j in jobs):
            return None
        self._taken.update(o for o in outputs if o is not None)
        return [None if o is None else self._outputs[o] for o in outputs]

    def build_tokenizer(self) -> None:
        """The file's tokenizer, as the loader would build it, made while torch's library loads (see the docstring).
        One that fails or warns is left to the loader, which reports it as it always does."""
        from .tokenizer import tokenizer_from_gguf

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                tokenizer = tokenizer_from_gguf(self.file)
            except Exception:  # noqa: BLE001 - the loader's own build says what is wrong
                return
        if not any(not issubclass(w.category, QUIET_WARNINGS) for w in seen):
            self.tokenizer = tokenizer

    def adopt_file(self, path: Path) -> GGUFFile | None:
        if self._adopted or Path(path).resolve() != self.file.path.resolve():
            return None
        self._adopted = True
        return self.file

    def close(self) -> None:
        """Stop the thread (after its current matrix) and unmap what the loader did not take (its tensors keep
        theirs alive) and the file, unless the loader adopted it."""
        self._stop.value = 1
        self.release()
        if self._thread is not None:
            self._thread.join()
        for i, out in enumerate(self._outputs):
            if i not in self._taken:  # (a taken one is a tensor's memory: torch.frombuffer holds the map, no export)
                out.close()
        self._outputs = []
        if not self._adopted:
            try:
                self.file.close()
            except BufferError:  # a view of it still alive: the map goes with the last one
                pass


_active: EarlyRepack | None = None


def start(argv: list[str]) -> None:
    """Begin repacking the GGUF an `edgellm` command line will load on the CPU, where everything needed is known
    before torch is imported; else do nothing. Never raises: the loader reports a bad file."""
    global _active
    close()  # (one head start at a time)
    collecting = gc.isenabled()
    gc.disable()  # the header's lists of tokens are long-lived: no passes over them (entry.import_frozen freezes them)
    try:
        plan = _plan(argv)
        if plan is not None:
            library, build, path = plan
            _active = EarlyRepack(repack_library(library), build, path)
            atexit.register(close)
            _ready_tokenizers()
            # The other core loads torch's library while this one builds the tokenizer (this thread loads no library
            # until torch's import), then repacks; or repacks as soon as torch's import begins here, which then
            # waits for the library, and the core it leaves is the repack's.
            preloading = preload_native_library(then=_active.release)
            _active.start(held=preloading is not None)
            _active.build_tokenizer()
            _active.release()
    except Exception:  # noqa: BLE001 - only a head start
        close()
    finally:
        if collecting:
            gc.enable()


def repack_library(path: str) -> ctypes.CDLL:
    """kernels/early_repack.cpp's build, its functions looked up."""
    lib = ctypes.CDLL(path)
    lib.edgellm_x8_row_bytes.restype = ctypes.c_int64
    lib.edgellm_x8_row_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.edgellm_repack_run.restype = None
    lib.edgellm_repack_run.argtypes = [ctypes.POINTER(RepackJob), ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                                       ctypes.POINTER(ctypes.c_int64)]
    return lib


def _ready_tokenizers() -> None:
    """Import the tokenizer's modules (loading the tokenizers library) and make a first BPE on this thread: that
    registers the Rust library's thread-local destructors, which takes the dynamic loader's lock, so the tokenizer
    built while the preload holds that lock does not wait for the whole load."""
    from tokenizers import Tokenizer, models

    from . import tokenizer  # noqa: F401 - (its imports)

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")])).encode("ab")


def started() -> bool:
    return _active is not None


def adopt_file(path: Path) -> GGUFFile | None:
    """The GGUF at `path` already mapped and parsed, for the loader (once), or None."""
    return _active.adopt_file(path) if _active is not None else None


def adopt_tokenizer(file: GGUFFile) -> object | None:
    """The tokenizer built from `file` (the adopted header) before torch's import, for the loader (once), or None."""
    if _active is None or _active.file is not file:
        return None
    tokenizer, _active.tokenizer = _active.tokenizer, None
    return tokenizer


def take(build: str, address: int, type_id: int, rows: int, k: int) -> mmap.mmap | None:
    """The x8 copy of a matrix the loader would repack with the extension build `build` (kernels/cpu_ext.build_id),
    or None: no head start, another build, or a matrix it did not foresee."""
    if _active is None or _active.build != build:
        return None
    return _active.take(address, type_id, rows, k)


def take_exact(build: str, parts: tuple[tuple[int, int, int, int, int], ...]) -> list[mmap.mmap | None] | None:
    """[codes, scales, mins or None] of a Q4_0 / Q4_1 / Q8_0 matrix in edgellm's layout, fused from `parts` ((address,
    type, rows, k, heads or 0) each) as the loader would fuse them with the extension build `build`, or None."""
    if _active is None or _active.build != build:
        return None
    return _active.take_exact(parts)


def close(loaded: GGUFFile | None = None) -> None:
    """End the head start (a loader passes the file it loaded: only the head start's own, so that a draft model
    loaded first leaves the main model's alone)."""
    global _active
    if _active is not None and (loaded is None or loaded is _active.file):
        _active.close()
        _active = None


def _row_chunks(rows: int, unit: int, row_bytes: int) -> list[tuple[int, int]]:
    """(first row, rows) of each job a matrix is cut into: whole `unit`s of rows, about CHUNK_BYTES of the file each.
    A job drops its source's pages from memory when it is done, so a large matrix (a 150k-token embedding: 100+ MiB)
    in one job would hold all of its pages at once, while torch's import adds its own."""
    step = max(unit, CHUNK_BYTES // max(row_bytes * unit, 1) * unit)
    return [(r, min(step, rows - r)) for r in range(0, rows, step)]


def _anonymous(nbytes: int) -> mmap.mmap:
    """Private anonymous memory (as malloc's large blocks are; Python's default is shared): zero pages until written,
    no memset, nothing resident yet."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)


def _address(buf: mmap.mmap) -> int:
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    address = ctypes.addressof(view)
    del view  # (an export would keep the map from closing)
    return address


def _plan(argv: list[str]) -> tuple[str, str, Path] | None:
    """(library, build, GGUF path) when the command line loads a GGUF on this CPU with the as-stored weights and the
    C++ kernels, and the extension for this torch, Python and ISA setting has built the library; else None."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not argv or argv[0] not in COMMANDS or cores < 2:  # (one core: nothing idle to use)
        return None
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("-m", "--model")
    p.add_argument("--device", default="auto")
    p.add_argument("--weights", default="auto")
    p.add_argument("--threads", default=None)
    p.add_argument("--no-ext", action="store_true")
    try:
        ns, _ = p.parse_known_args(argv[1:])
    except (argparse.ArgumentError, SystemExit):
        return None
    if ns.weights != "auto" or ns.no_ext or ns.threads == "1":
        return None
    bundled = bundled_files() if ns.model is None else []  # the default model (`make chat`)
    if ns.model is None and len(bundled) != 1:
        return None
    path = bundled[0] if ns.model is None else Path(ns.model).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    build = torch_build()
    if build is None or ns.device not in ("cpu", "auto") or (ns.device == "auto" and _accelerator(build)):
        return None
    root = cache_root(os.path.expanduser(os.environ.get("EDGELLM_EXT_CACHE") or "") or None)  # as args.py has it
    try:
        pointer = json.loads(repack_pointer(root, os.environ.get("EDGELLM_EXT_ISA") or None).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if (not isinstance(pointer, dict) or pointer.get("torch") != build["version"]
            or pointer.get("python") != python_tag()):
        return None
    library, build = pointer.get("library"), pointer.get("build")
    if not isinstance(library, str) or not isinstance(build, str) or not Path(library).is_file():
        return None
    return library, build, path


def _accelerator(build: dict[str, str | None]) -> bool:
    """Whether --device auto might pick something other than the CPU (torch's rule: CUDA, then MPS)."""
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return True
    if build.get("cuda") and Path("/dev/nvidiactl").exists():
        return True
    return bool(build.get("hip") and Path("/dev/kfd").exists())
