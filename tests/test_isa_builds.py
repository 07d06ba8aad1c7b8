"""Every C++ kernel source compiles for every build the extension makes (portable, AVX2, AVX-512 VNNI, NEON, NEON
dot-product, AVX2 with AVX-VNNI), on any machine with the compilers: the other tests run the builds this CPU can
execute, so without this a change could break, say, the AVX-512 build unseen on an AVX2-only machine (as one did: a
static_assert on the AVX2 panel width)."""
from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from edgellm.kernels import cpu_ext
from tests.test_cpu_kernels import ISA_FLAGS

KERNELS = Path(cpu_ext.__file__).resolve().parent
# cpu_bindings.cpp is the pybind/torch glue (compiled with the extension); cpu_kernels.cpp's torch parts are behind
# EDGELLM_STANDALONE's stand-ins, as the standalone harnesses build it
SOURCES = [s for s in cpu_ext._SOURCES if s != "cpu_bindings.cpp"]
X86 = platform.machine().lower() in ("x86_64", "amd64")
TARGETS = {"scalar": None, "avx2": "x86", "avx2vnni": "x86", "avx512vnni": "x86", "neon": "aarch64",
           "neon-dotprod": "aarch64"}


def _compiler(target: str | None) -> str | None:
    native = shutil.which("g++") or shutil.which("c++")
    if target is None or (target == "x86" and X86) or (target == "aarch64" and platform.machine() == "aarch64"):
        return native
    if target == "aarch64":
        return shutil.which("aarch64-linux-gnu-g++")
    return None


@pytest.mark.parametrize("build", list(TARGETS))
def test_every_source_compiles_for_every_build(build):
    flags = ISA_FLAGS[build]
    cxx = _compiler(TARGETS[build])
    if cxx is None:
        pytest.skip(f"no compiler for the {build} build here (x86: g++; NEON: aarch64-linux-gnu-g++)")
    for source in SOURCES:
        run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-fopenmp", "-DEDGELLM_STANDALONE", *flags,
                              str(KERNELS / source)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{build} {source}:\n{run.stderr[-3000:]}"
