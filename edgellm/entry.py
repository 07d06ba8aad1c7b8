"""The `edgellm` command: starts reading the model's files off the disk and repacking a GGUF's K-quants for the CPU
kernels, then imports the CLI (whose first import of torch takes about a second, time the disk and the other core
now use; less torch's Python meta kernels, edgellm.torch_import)."""
from __future__ import annotations

import gc
import importlib
import os
import sys
from types import ModuleType

from .prefetch import files_named_in, prefetch
from .torch_import import deferred_meta_kernels


def import_frozen(name: str) -> ModuleType:
    """Import `name` (the CLI, and so torch) with Python's cyclic garbage collector paused, then freeze what the
    import made. Importing torch makes ~250k objects that live as long as the process; the collector's passes over
    them while they are made were ~0.1 s of the ~0.9 s import here (median of 12 fresh processes: 0.80 s paused,
    0.90 s not), and frozen they stay out of every later pass (one costs ~0.05 s over them), so no collection lands
    in a generation. What the import left as cyclic garbage is frozen with them: ~7k small objects (~0.7 MB: import
    tracebacks and closures, no arrays or tensors; looked at with gc.DEBUG_SAVEALL) instead of a 0.05 s pass."""
    if name in sys.modules:  # nothing to import, nothing to freeze
        return sys.modules[name]
    enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def main() -> int:
    if os.environ.get("EDGELLM_PREFETCH") != "0":  # (an A/B switch: benchmarks/cold_load.py)
        prefetch(files_named_in(sys.argv[1:]))
    if os.environ.get("EDGELLM_EARLY_REPACK") != "0":  # (an A/B switch: benchmarks/gguf_vs_llamacpp.py)
        from . import early_repack  # (after the prefetch has begun: it imports numpy)

        early_repack.start(sys.argv[1:])
    with deferred_meta_kernels():  # (torch's Python meta kernels load when the compiler stack first imports)
        cli = import_frozen("edgellm.cli")
    return cli.main()
