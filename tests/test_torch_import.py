"""edgellm.torch_import: torch imported without its Python meta kernels (as the `edgellm` command and this suite's
conftest import it), which load on the compiler stack's first import or on a name asked of the placeholder; and the
command's output the same either way. Each case in a fresh interpreter (the state is the process's)."""
import json
import os
import subprocess
import sys

import pytest

from edgellm.torch_import import DEFERRED_ON, torch_build

pytestmark = pytest.mark.skipif(not (torch_build() or {"version": ""})["version"].startswith(
    tuple(v + "." for v in DEFERRED_ON)), reason="a torch version the deferral leaves alone (test_other_versions)")

PRELUDE = (
    "import sys\n"
    "from edgellm.torch_import import deferred_meta_kernels, meta_kernels_loaded, NEEDS_META_KERNELS\n"
    "with deferred_meta_kernels():\n"
    "    import torch\n")


def python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_deferred_then_loaded_by_the_compiler():
    """Deferred: no meta kernels and no compiler-stack module imported (nor torch._prims), so a meta op with only a
    Python meta kernel fails (the deferral is real), while eager CPU ops and torch.Generator work. torch.compile
    (aot_eager traces with fake tensors, which need that kernel) loads them first and gives eager's result."""
    out = python(PRELUDE + (
        "assert not meta_kernels_loaded() and not hasattr(torch, '_meta_registrations')\n"
        "assert not [m for m in NEEDS_META_KERNELS + ('torch._prims',) if m in sys.modules]\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(7, 5, generator=g)\n"
        "try:\n"
        "    torch.median(torch.empty(9, device='meta'))\n"
        "    print('META-OP ran')\n"
        "except NotImplementedError:\n"
        "    print('META-OP missing')\n"
        "f = torch.compile(lambda a: torch.median(a, dim=0).values * 2 + a.sum(0), backend='aot_eager')\n"
        "same = torch.equal(f(x), torch.median(x, dim=0).values * 2 + x.sum(0))\n"
        "print('COMPILED', same, meta_kernels_loaded(), torch.median(torch.empty(9, device='meta')).shape)\n"
        "from torch._library.opaque_object import is_opaque_type\n"
        "again = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))\n"
        "print('GENERATOR', torch.equal(again, x), 'torch._prims.rng_prims' in sys.modules,"
        " is_opaque_type(torch._C.Generator))\n"))
    assert "META-OP missing" in out
    assert "COMPILED True True torch.Size([])" in out
    assert "GENERATOR True True True" in out  # rng_prims, imported by the compiler stack, bound it again


@pytest.mark.parametrize("first", ["torch._decomp", "torch._refs", "torch.distributed.tensor"])
def test_a_trigger_the_kernels_import_too_is_imported_once(first):
    """torch._decomp / torch._refs imported first (as torch.distributed.tensor does): the meta kernels load before
    them, and their import's module is the one the import statement gets (a second copy would be a second, empty
    decomposition table)."""
    out = python(PRELUDE + (
        f"import {first}\n"
        "import torch._decomp, torch._decomp.decompositions\n"
        "print('LOADED', meta_kernels_loaded())\n"
        "print('ONE', torch._decomp is sys.modules['torch._decomp'], torch._decomp.decompositions.__name__)\n"
        "print('TABLE', torch.ops.aten.rnn_relu.input in torch._decomp.decomposition_table)\n"))
    assert "LOADED True" in out and "ONE True torch._decomp.decompositions" in out and "TABLE True" in out


def test_a_name_asked_of_the_placeholder_loads_the_real_module():
    out = python(
        "from edgellm.torch_import import deferred_meta_kernels, meta_kernels_loaded\n"
        "with deferred_meta_kernels():\n"
        "    import torch\n"
        "    from torch._meta_registrations import meta_index_Tensor\n"
        "print('LOADED', meta_kernels_loaded(), callable(meta_index_Tensor))\n")
    assert "LOADED True True" in out


@pytest.mark.parametrize("how", ["switch", "other_version", "torch_first"])
def test_left_whole(how):
    """EDGELLM_DEFER_META=0, a torch version outside DEFERRED_ON, or torch imported before: torch's usual import."""
    setup = {"switch": "", "torch_first": "import torch\n",
             "other_version": "import edgellm.torch_import as t\n"
                              "t.torch_build = lambda: {'version': '2.99.0', 'cuda': None, 'hip': None}\n"}[how]
    out = python(setup + PRELUDE + "print('LOADED', meta_kernels_loaded())\n",
                 **({"EDGELLM_DEFER_META": "0"} if how == "switch" else {}))
    assert "LOADED True" in out


def test_the_command_answers_the_same_without_them(tiny_llama):
    """`edgellm run` (entry.main, which defers them) on a GGUF, sampling with a seed (a torch.Generator, which the
    deferral late-binds): the same tokens as with torch imported whole, and the meta kernels never loaded (its
    loader's skeleton on the meta device needs none)."""
    code = ("import sys\n"
            "from edgellm import entry, torch_import\n"
            "sys.argv = ['edgellm', 'run', 'hello there', '-m', sys.argv[1], '-n', '6', '--raw', '--json',"
            " '--temperature', '0.9', '--seed', '7']\n"
            "rc = entry.main()\n"
            "print('META', torch_import.meta_kernels_loaded())\n"
            "sys.exit(rc)\n")
    runs = {}
    for defer in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", code, str(tiny_llama[1])], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "EDGELLM_DEFER_META": defer})
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        runs[defer] = (json.loads(next(ln for ln in lines if ln.startswith("{")))["tokens"], lines[-1])
    assert runs["1"][0] == runs["0"][0] and len(runs["1"][0]) == 6
    assert runs["1"][1] == "META False" and runs["0"][1] == "META True"


def test_a_failed_import_leaves_no_placeholder():
    """An import that fails inside the deferral raises its own error and leaves no placeholder behind (a later
    import of the module would otherwise get it)."""
    out = python("import sys\n"
                 "from edgellm.torch_import import META_KERNELS, deferred_meta_kernels\n"
                 "try:\n"
                 "    with deferred_meta_kernels():\n"
                 "        raise ImportError('a broken install')\n"
                 "except ImportError as e:\n"
                 "    print('RAISED', e)\n"
                 "print('LEFT', META_KERNELS in sys.modules)\n")
    assert "RAISED a broken install" in out and "LEFT False" in out
