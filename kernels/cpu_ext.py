"""Build-on-first-use loader for edgellm's C++ CPU kernels (int4/int8 weight-only GEMM for small M).

`get_extension()` returns a module with

    int4_gemm(x fp32 [M,K], codes uint8 [N,K/2], scales fp16 [N,K/G], mins fp16 [N,K/G] or empty, G) -> fp32 [M,N]
    int8_gemm(x fp32 [M,K], codes int8 [N,K], scales fp16 [N,K/G], G) -> fp32 [M,N]

(plus `int4_gemm_variant` / `int8_gemm_variant` taking a variant number, `quant_linear_prompt` (the same product
for prefills, as an int8 panel GEMM), the GGUF kernels (`gguf_*`), and `isa()`), or None when
disabled (`ExtensionSettings(enabled=False)`, `--no-ext`) or the build is impossible (no compiler, no ninja, compile error: one warning, never an
exception). The same functions are registered as torch ops, `torch.ops.edgellm_cpu.int4_gemm` etc., with
fake implementations so `torch.compile` can trace them.

The build (~20 s, one line on stderr) goes to
`ExtensionSettings.cache_dir` (default `platformdirs.user_cache_dir("edgellm")`)`/ext-torch<ver>-py<ver>-<isa>-<hash of sources and flags>`; later
processes import the cached library directly (milliseconds), without running ninja again. A file lock
keeps two processes from building into the same folder at once.

This module imports nothing from the rest of edgellm.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from .ext_cache import cache_root, python_tag, repack_pointer

_NAME = "edgellm_cpu_kernels"
_SOURCES = ("cpu_kernels.cpp", "cpu_decode.cpp", "cpu_gguf.cpp", "cpu_gguf_x8.cpp", "cpu_gguf_grid.cpp", "cpu_attention.cpp",
            "cpu_pointwise.cpp", "cpu_bindings.cpp")
# hashed with the sources: a change rebuilds
_HEADERS = ("amx_tiles.h", "cpu_decode.h", "cpu_gguf.h", "dpbusd256.h", "gguf_grids.h", "gguf_low_k_codes.h", "half.h",
            "simd_math.h", "simd_transpose.h", "simde_avx512.h")
# The x8 repack and the grid i-quants' L4 recoding alone as a plain C library (no torch), built beside the extension
# from the same flags, and the file
# that tells the `edgellm` command where it is before torch is imported (edgellm/early_repack.py).
_REPACK_SOURCES = ("cpu_gguf_x8.cpp", "cpu_gguf_grid.cpp", "early_repack.cpp")
_REPACK_LIBRARY = "edgellm_repack.so"
_ISAS = ("avx2", "avx2vnni", "scalar", "avx512vnni-emulated")
_BUILD_VERSION = "1"  # bump to force a rebuild when the flags logic changes

_state: dict[str, object] = {"tried": False, "ext": None}


@dataclass(frozen=True)
class ExtensionSettings:
    """How the kernels are built and found. One build serves a process: the first `get_extension` call's settings
    decide it. enabled: False = no extension (the torch paths); isa: None = the best this CPU runs, "avx2" = the
    AVX2 build on a machine with more, "avx2vnni" = the AVX2 + AVX-VNNI build on an AVX-512 machine that also has
    AVX-VNNI, "scalar" = the portable C++ path (for testing and A/B runs); openmp:
    False = the kernels' own thread pool instead of torch's OpenMP (the macOS build, tested elsewhere); cache_dir:
    where builds are kept (None: the user cache folder; the app reads $EDGELLM_EXT_CACHE).

    isa "avx512vnni-emulated": the AVX-512 VNNI build on an AVX2 CPU, its AVX-512 intrinsics emulated by SIMDe
    (simde_avx512.h; Debian: libsimde-dev): slow, for testing those paths where no such CPU is at hand (`make
    test-avx512`). The default isa comes from $EDGELLM_EXT_ISA when set."""

    enabled: bool = True
    isa: str | None = field(default_factory=lambda: os.environ.get("EDGELLM_EXT_ISA") or None)
    openmp: bool = True
    cache_dir: Path | None = None

    def __post_init__(self):
        if self.isa not in (None, *_ISAS):
            raise ValueError(f"kernel ISA {self.isa!r}: choose from {', '.join(_ISAS)} (or the default, the best)")


def get_extension(settings: ExtensionSettings | None = None) -> ModuleType | None:
    """The compiled kernels, built on first use; None if disabled or unavailable."""
    settings = settings or ExtensionSettings()
    if not settings.enabled:
        return None
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["ext"] = _load(settings)
        except Exception as exc:  # noqa: BLE001 - any failure means "use the torch path"
            warnings.warn(
                f"edgellm: C++ CPU kernels unavailable, using the slower torch path ({_one_line(exc)})",
                RuntimeWarning,
                stacklevel=2,
            )
    return _state["ext"]  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------ ISA
def _cpu_flags() -> set[str]:
    """CPU feature names as Linux spells them (avx2, fma, f16c, asimddp, ...), best effort."""
    flags: set[str] = set()
    system = platform.system()
    try:
        if system == "Linux":
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    key = line.split(":", 1)[0].strip().lower()
                    if key in ("flags", "features"):
                        flags.update(line.split(":", 1)[1].split())
                        break
        elif system == "Darwin":
            if platform.machine() == "arm64":
                out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_DotProd"],
                                     capture_output=True, text=True, timeout=5).stdout.strip()
                if out == "1":
                    flags.add("asimddp")
            else:
                out = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                                     capture_output=True, text=True, timeout=5).stdout
                flags.update(w.lower().replace(".", "_") for w in out.split())
                if "fma" in flags or "fma3" in flags:
                    flags.add("fma")
                if "avx2" in flags:
                    flags.add("f16c")  # every AVX2 Mac has F16C (sysctl spells it F16C too)
        else:
            cap = torch.backends.cpu.get_cpu_capability()
            if cap in ("AVX2", "AVX512"):
                flags.update({"avx2", "fma", "f16c"})
    except (OSError, subprocess.SubprocessError):
        pass
    return flags


def _isa_and_flags(forced: str | None = None) -> tuple[str, list[str]]:
    """(tag, compiler flags) for the best kernel path this CPU runs: "avx512vnni", "avx2vnni" (AVX2 with AVX-VNNI's
    ymm integer dots), "avx2", "neon-dotprod", "neon" or "scalar". forced "scalar": the portable C++ path, "avx2": the
    AVX2 one on a machine with more, "avx2vnni": the AVX-VNNI one on an AVX-512 machine that has AVX-VNNI too,
    "avx512vnni-emulated": the AVX-512 VNNI one on an AVX2 machine through SIMDe (for testing them)."""
    machine = platform.machine().lower()
    msvc = sys.platform == "win32"
    if forced == "scalar":
        return "scalar", ["/DEDGELLM_FORCE_SCALAR" if msvc else "-DEDGELLM_FORCE_SCALAR"]
    flags = _cpu_flags()
    x86_avx2 = machine in ("x86_64", "amd64", "i686", "x86") and {"avx2", "fma", "f16c"} <= flags
    if forced == "avx512vnni-emulated":
        if not x86_avx2 or msvc:
            raise RuntimeError("the emulated AVX-512 VNNI build needs an x86 CPU with AVX2, FMA and F16C, "
                               "and GCC or clang")
        shim = Path(__file__).resolve().parent / "simde_avx512.h"
        return forced, ["-mavx2", "-mfma", "-mf16c", "-include", str(shim)]
    if machine in ("x86_64", "amd64", "i686", "x86"):
        if x86_avx2:
            avx2 = ["/arch:AVX2"] if msvc else ["-mavx2", "-mfma", "-mf16c"]
            if forced is None and not msvc and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
                return "avx512vnni", avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
            if forced in (None, "avx2vnni") and not msvc and "avx_vnni" in flags and _compiler_takes("-mavxvnni"):
                return "avx2vnni", avx2 + ["-mavxvnni"]  # AVX-VNNI: Intel Alder Lake and later client chips
            if forced == "avx2vnni":
                raise RuntimeError("the AVX-VNNI build needs a CPU with AVX-VNNI and a compiler that takes -mavxvnni "
                                   "(GCC 11, clang 12)")
            return "avx2", avx2
        return "scalar", []
    if machine in ("arm64", "aarch64"):
        if "asimddp" in flags and not msvc:
            return "neon-dotprod", ["-march=armv8.2-a+dotprod"]
        return "neon", []
    return "scalar", []


@functools.cache
def _compiler_takes(flag: str) -> bool:
    """Whether the C++ compiler accepts `flag` (a GCC before 11 does not know -mavxvnni)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, flag, "-x", "c++", "-E", "-o", os.devnull, os.devnull], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _openmp_flags(openmp: bool = True) -> tuple[list[str], list[str]]:
    """Compile/link flags so at::parallel_for runs on torch's OpenMP pool.

    torch's Linux wheels load libgomp.so.1; an extension built with GCC's -fopenmp needs that same SONAME,
    so the dynamic loader reuses torch's copy and torch.set_num_threads() governs our threads too. Without
    OpenMP (macOS' Apple clang, or openmp=False to test that build) the kernels use a small
    thread pool of their own."""
    if not openmp:
        return [], []
    if sys.platform == "win32":
        return ["/openmp"], []
    if sys.platform == "darwin":
        return [], []
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "clang" in version.lower():
        return ["-fopenmp=libgomp"], ["-fopenmp=libgomp"]
    return ["-fopenmp"], ["-fopenmp"]


# ------------------------------------------------------------------------------------------------ build
@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes (released by the OS if the holder dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        except ImportError:  # Windows
            import msvcrt

            f.seek(0)
            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    time.sleep(0.5)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)


def _ensure_ninja() -> None:
    if shutil.which("ninja"):
        return
    try:  # the `ninja` wheel puts its binary in the venv's bin, which is not on PATH unless activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    if not shutil.which("ninja"):
        raise RuntimeError("ninja not found (pip install ninja)")


def _library_file(folder: Path) -> Path | None:
    for suffix in (".so", ".pyd", ".dylib"):
        p = folder / f"{_NAME}{suffix}"
        if p.exists():
            return p
    return None


def _import_library(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(settings: ExtensionSettings) -> ModuleType:
    here = Path(__file__).resolve().parent
    sources = [here / s for s in _SOURCES]
    isa, isa_flags = _isa_and_flags(settings.isa)
    omp_cflags, omp_ldflags = _openmp_flags(settings.openmp)
    opt = ["/O2"] if sys.platform == "win32" else ["-O3"]
    cflags = opt + ["-DNDEBUG"] + isa_flags + omp_cflags
    key = hashlib.sha256()
    for s in sources + [here / h for h in _HEADERS] + [here / s for s in _REPACK_SOURCES if s not in _SOURCES]:
        key.update(s.read_bytes())
    key.update(repr((cflags, omp_ldflags, os.environ.get("CXX"), _BUILD_VERSION, sys.version)).encode())
    folder = (cache_root(settings.cache_dir) /
              f"ext-torch{torch.__version__}-py{python_tag()}-{isa}-{key.hexdigest()[:12]}")
    done = folder / "built.ok"

    if done.exists() and (lib := _library_file(folder)) is not None:
        module = _import_library(lib)
    else:
        with _file_lock(folder.with_name(folder.name + ".lock")):
            if done.exists() and (lib := _library_file(folder)) is not None:  # another process built it
                module = _import_library(lib)
            else:
                module = _build(folder, sources, isa, cflags, omp_ldflags)
                done.write_text(f"{isa} {' '.join(cflags)}\n", encoding="utf-8")
    if isa in ("avx2", "avx2vnni", "avx512vnni"):  # the builds with an x8 layout
        _publish_repack_library(folder, isa_flags, settings)
    _register_fakes()
    return module


def _publish_repack_library(folder: Path, isa_flags: list[str], settings: ExtensionSettings) -> None:
    """Build the repack library into the extension's folder once (~8 s; kept only if the compiler succeeds: the
    command just loses its head start without it) and point the ISA setting's pointer file at it."""
    lib, failed = folder / _REPACK_LIBRARY, folder / "repack.failed"
    if not lib.exists() and not failed.exists() and sys.platform != "win32":
        here = Path(__file__).resolve().parent
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
        cmd = [os.environ.get("CXX", "c++"), "-O3", "-DNDEBUG", *isa_flags, "-shared", "-fPIC", "-I", str(here),
               *(str(here / s) for s in _REPACK_SOURCES), "-o", str(tmp)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=600)
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError):
            tmp.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                failed.touch()  # not again on every start
    if not lib.exists():
        return
    text = json.dumps({"build": folder.name, "library": str(lib), "torch": torch.__version__, "python": python_tag()})
    pointer = repack_pointer(cache_root(settings.cache_dir), settings.isa)
    try:
        if not pointer.exists() or pointer.read_text(encoding="utf-8") != text:
            # whole or not at all (kernels/ imports no edgellm.atomic: tests/test_kv_cache_classes.py)
            tmp = pointer.with_name(f"{pointer.name}.{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, pointer)
    except OSError:  # (the command just has no head start)
        pass


def build_id(module: ModuleType) -> str:
    """The extension's build: its folder's name (torch, Python, ISA and a hash of the sources and flags)."""
    return Path(module.__file__ or "").parent.name


def _build(folder: Path, sources: list[Path], isa: str, cflags: list[str], ldflags: list[str]) -> ModuleType:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
    _ensure_ninja()
    folder.mkdir(parents=True, exist_ok=True)
    print(f"edgellm: compiling the CPU kernels for {isa} (once, ~20 s) ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cpp_extension's own notes (ABI, compiler version) are noise here
            module = cpp_extension.load(
                name=_NAME,
                sources=[str(s) for s in sources],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(folder),
                verbose=False,
                is_python_module=True,
            )
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return module


_fakes_registered = False


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / FakeTensor tracing can pass through the ops."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True
    try:
        register = torch.library.register_fake
    except AttributeError:  # torch < 2.4
        return

    def int4(x, codes, scales, mins, group_size):
        return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

    def int4_v(x, codes, scales, mins, group_size, variant):
        return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

    def int8(x, codes, scales, group_size):
        return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

    def int8_v(x, codes, scales, group_size, variant):
        return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

    for name, fn in (("int4_gemm", int4), ("int4_gemm_variant", int4_v), ("int8_gemm", int8),
                     ("int8_gemm_variant", int8_v)):
        try:
            register(f"edgellm_cpu::{name}", fn)
        except Exception:  # noqa: BLE001 - compile support is optional; eager calls work without it
            pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # the compiler's first error line says more than the generic "Error building extension"
    errors = [ln.strip() for ln in text if "error" in ln.lower()]
    msg = errors[0] if errors else (text[0] if text else type(exc).__name__)
    return msg[:300]
