"""torch's import, read about and made shorter, without importing torch.

`torch_build()` reads torch's version (and its CUDA / ROCm build) from its version.py as text.

`deferred_meta_kernels()`: `import torch` ends by importing `torch._meta_registrations` for its side effects alone:
Python "meta" kernels (an op's output shape and dtype, not computed) for the ops whose meta kernel is not in C++,
and with them torch._decomp and torch._refs. The compiler stack uses them (torch.compile, export, fake tensors) and
eager ops on the meta device lacking a C++ meta kernel (cdist, median, scaled_dot_product_attention ...). edgellm runs
eager ops on real devices; on the meta device only its loader's skeleton (module parameters, zeros), all C++. So
the `edgellm` command imports torch without them: a placeholder module stands in while torch imports, and after it
any import of the module (torch._decomp's, fake_impls', the compiler stack's first: `_LoadBeforeCompiler`) is the
real one. Measured on a 2-core Xeon, fresh processes: `import torch` 1.07 -> 0.91 s (median of 8); the command's
load of a GGUF 0.85-0.90x as long, peak RSS 12 MiB lower (benchmarks/results/defer-meta-ab.json).

Only for the torch versions the test suite runs under this (DEFERRED_ON): torch's own modules lean on this import's
side effects in ways that change between versions; any other version imports torch whole. 2.13's torch.Generator()
raises until torch._prims.rng_prims has late-bound the Generator type's metaclass (the module imported it, through
torch._prims). `_late_bind_generator` makes that one call. Importing rng_prims for it defines all of torch._prims:
0.10-0.13 s of the import here and 6 MiB (the command's load 0.87-0.93x as long without it, same peak RSS less 6 MiB:
benchmarks/results/bind-generator-ab.json). rng_prims binds the same metaclass again when the compiler stack imports
it, as it did before, and registers Generator for tracing there.

`preload_native_library()`: about a fifth of `import torch` is the dynamic loader mapping libtorch_cpu and running
its static constructors (registering some thousands of operators): 0.13-0.15 s of a ~0.65 s import on a 2-core
Xeon. None of it needs Python, so the `edgellm` command's head start (edgellm/early_repack.py) has a thread call
the C library's dlopen (a ctypes foreign call, which releases the GIL; ctypes.CDLL's own dlopen holds it) while this
one builds the model's tokenizer, and torch's import then finds the library loaded. This thread must load no library
meanwhile: the loader's lock is held for the whole load, static constructors included.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path

META_KERNELS = "torch._meta_registrations"
# torch major.minor versions the whole test suite has run on with the meta kernels deferred (tests/conftest.py).
DEFERRED_ON = ("2.13",)
# The compiler stack's entry points, none imported by the deferred `import torch`: the first import of any of them
# loads the meta kernels before it. (torch._decomp and torch._refs must come after them: imported first, torch's own
# modules import each other in a circle that fails.)
NEEDS_META_KERNELS = ("torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd", "torch.export._trace",
                      "torch._decomp", "torch._refs")


def _torch_folder() -> Path | None:
    """The installed torch package's folder, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def torch_build() -> dict[str, str | None] | None:
    """torch's version.py values (__version__, cuda, hip) read as text: without importing torch."""
    folder = _torch_folder()
    if folder is None:
        return None
    try:
        text = (folder / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    values = {}
    for key in ("__version__", "cuda", "hip"):
        m = re.search(rf"^{key}\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.M)
        values[key.strip("_")] = (m.group(1) or m.group(2)) if m else None
    return values if values["version"] else None


@contextlib.contextmanager
def deferred_meta_kernels() -> Iterator[None]:
    """Within this, a first `import torch` (of a DEFERRED_ON version) skips the meta kernels; they load on the
    compiler stack's first import. A no-op when torch is imported already, or EDGELLM_DEFER_META=0 (an A/B switch)."""
    build = None if "torch" in sys.modules or os.environ.get("EDGELLM_DEFER_META") == "0" else torch_build()
    if build is None or not build["version"].startswith(tuple(v + "." for v in DEFERRED_ON)):
        yield
        return
    sys.modules[META_KERNELS] = _Placeholder(META_KERNELS)
    try:
        yield
    except BaseException:  # (a failed import: its own error, the placeholder gone)
        _drop_placeholder()
        raise
    if not isinstance(sys.modules.get(META_KERNELS), _Placeholder):
        return  # loaded already, by a name asked of the placeholder
    _drop_placeholder()
    if "torch" in sys.modules:
        _late_bind_generator(sys.modules["torch"])
    if any(m in sys.modules for m in NEEDS_META_KERNELS):  # a torch whose own import uses the compiler stack
        load_meta_kernels()
    else:
        sys.meta_path.insert(0, _LoadBeforeCompiler())


def _late_bind_generator(torch: types.ModuleType) -> None:
    """What the deferred import still needs of the module's side effects (see the docstring): torch.Generator's
    metaclass, where this torch late-binds it."""
    bind = getattr(torch._C, "_set_generator_metaclass", None)
    if bind is not None:
        from torch._opaque_base import OpaqueBaseMeta

        bind(OpaqueBaseMeta)


def native_library() -> Path | None:
    """The path of torch's libtorch_cpu (in every build, CPU or CUDA), found without importing torch."""
    folder = _torch_folder()
    suffix = {"linux": ".so", "darwin": ".dylib"}.get(sys.platform)
    if folder is None or suffix is None:
        return None
    path = folder / "lib" / f"libtorch_cpu{suffix}"
    return path if path.is_file() else None


def preload_native_library(then: Callable[[], None] | None = None) -> threading.Thread | None:
    """Start loading libtorch_cpu on a thread of its own (see the docstring), which calls `then` when it is done, or
    None: torch imported already, no such library, a platform without dlopen, or EDGELLM_PRELOAD_TORCH=0 (an A/B
    switch). A library that fails to load (NULL handle) is left to torch's import, which reports it; the handle is
    never closed."""
    if "torch" in sys.modules or os.environ.get("EDGELLM_PRELOAD_TORCH") == "0":
        return None
    path = native_library()
    if path is None:
        return None
    import ctypes

    dlopen = ctypes.CDLL(None).dlopen
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]

    def load() -> None:
        try:
            dlopen(os.fsencode(path), os.RTLD_NOW)
        finally:
            if then is not None:
                then()

    # Not a daemon: Python's exit waits for it. A process exiting while the library's static constructors run (an
    # error or sys.exit before torch's import) crashed in the exit's own destructors (tests/test_torch_preload.py).
    thread = threading.Thread(target=load, name="edgellm-preload-torch")
    thread.start()
    return thread


def meta_kernels_loaded() -> bool:
    return META_KERNELS in sys.modules and not isinstance(sys.modules[META_KERNELS], _Placeholder)


def load_meta_kernels() -> types.ModuleType:
    """The real module (imported now unless it was), with the placeholder and the watch for it gone."""
    _drop_placeholder()
    _LoadBeforeCompiler.remove()
    return importlib.import_module(META_KERNELS)


def _drop_placeholder() -> None:
    if isinstance(sys.modules.get(META_KERNELS), _Placeholder):
        del sys.modules[META_KERNELS]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "_meta_registrations", None), _Placeholder):
        del torch._meta_registrations


class _Placeholder(types.ModuleType):
    """Stands in for the module while torch imports (its `from torch import _meta_registrations` binds this); a
    name asked of it (a torch whose own modules import from it) loads the real one."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # the import system's own probes (__path__, __spec__ ...)
            raise AttributeError(name)
        return getattr(load_meta_kernels(), name)


class _LoadBeforeCompiler(importlib.abc.MetaPathFinder):
    """On sys.meta_path while the meta kernels are deferred: the first import of a NEEDS_META_KERNELS module (or one
    inside it) loads them before the module runs (its loader wrapped in `_AfterMetaKernels`)."""

    def find_spec(self, name, path=None, target=None):
        if not any(name == m or name.startswith(m + ".") for m in NEEDS_META_KERNELS):
            return None
        _LoadBeforeCompiler.remove()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterMetaKernels(spec.loader)
        return spec

    @staticmethod
    def remove() -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LoadBeforeCompiler)]


class _AfterMetaKernels(importlib.abc.Loader):
    """A module's own loader, the meta kernels loaded first. Not in find_spec: when their import imports the module
    itself (torch._decomp does), importlib would then run it a second time (two decomposition tables); here the
    import statement gets the module their import made."""

    def __init__(self, loader):
        self.loader = loader
        self.made = None

    def create_module(self, spec):
        load_meta_kernels()
        self.made = sys.modules.get(spec.name)
        return self.made if self.made is not None else self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if module is not self.made:
            self.loader.exec_module(module)

    def __getattr__(self, name: str):  # get_source, get_code ... (tracebacks, inspect): the module's own loader
        return getattr(self.loader, name)
