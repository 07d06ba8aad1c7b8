"""edgellm.torch_import.preload_native_library: torch's native library loaded on a thread of its own before torch is
imported, which then uses it (one copy, a working torch), and a process that ends while it loads ends cleanly. Each
case in a fresh interpreter (what is loaded is the process's)."""
import os
import signal
import subprocess
import sys

import pytest

from edgellm.torch_import import native_library, preload_native_library

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or native_library() is None,
                                reason="reads /proc/self/maps; the preload is for Linux and macOS torch builds")


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


MAPPED = ("def mapped():\n"
          "    return {line.split()[-1] for line in open('/proc/self/maps') if 'libtorch_cpu' in line}\n")


def test_loaded_before_the_import_which_uses_it():
    out = python(
        "import os, sys\n" + MAPPED +
        "from edgellm.torch_import import native_library, preload_native_library\n"
        "done = []\n"
        "thread = preload_native_library(then=lambda: done.append(1))\n"
        "thread.join()\n"
        "print('BEFORE', 'torch' in sys.modules, mapped() == {os.path.realpath(native_library())}, done)\n"
        "import torch\n"
        "x = torch.arange(6, dtype=torch.float32).reshape(2, 3)\n"
        "print('AFTER', len(mapped()), (x @ x.T).tolist())\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BEFORE False True [1]" in out.stdout
    assert "AFTER 1 [[5.0, 14.0], [14.0, 50.0]]" in out.stdout  # one copy of the library, and torch computes


def test_nothing_to_do_when_torch_is_imported_or_switched_off():
    import torch  # noqa: F401 - (this test process has it)

    assert preload_native_library() is None
    out = python("from edgellm.torch_import import preload_native_library\n"
                 "print('THREAD', preload_native_library())\n", EDGELLM_PRELOAD_TORCH="0")
    assert out.returncode == 0 and "THREAD None" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("ending", ["sys.exit(3)", "raise KeyboardInterrupt"])
def test_a_process_ending_while_it_loads_ends_cleanly(ending):
    """An error or Ctrl-C right after the preload began (before torch's import) ends the process as it would have
    ended anyway: its exit status, not a crash of the library's constructors against the exit's destructors."""
    for delay in (0.03, 0.06, 0.09):  # (into the library's constructors: a daemon thread crashed at each)
        out = python("import sys, time\n"
                     "from edgellm.torch_import import preload_native_library\n"
                     f"preload_native_library()\ntime.sleep({delay})\n" + ending + "\n")
        if ending == "sys.exit(3)":
            assert out.returncode == 3, out.stderr[-3000:]
        else:
            # (Python ends an unhandled Ctrl-C by SIGINT, as the shell expects; a crash would be SIGSEGV / SIGABRT)
            assert out.returncode == -signal.SIGINT, out.stderr[-3000:]
            assert out.stderr.rstrip().endswith("KeyboardInterrupt"), out.stderr[-3000:]
