"""Where the C++ kernels' builds live, without importing torch (the `edgellm` command looks here before it does:
edgellm/early_repack.py)."""
from __future__ import annotations

import sys
from pathlib import Path


def cache_root(override: str | Path | None = None) -> Path:
    """The folder of the builds: `override` (ExtensionSettings.cache_dir; the app's $EDGELLM_EXT_CACHE), else the
    user cache folder."""
    if override:
        return Path(override)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("edgellm"))
    except ImportError:  # platformdirs is a dependency, but never let a missing one cost the kernels
        return Path.home() / ".cache" / "edgellm"


def repack_pointer(root: Path, isa_setting: str | None) -> Path:
    """The file where the extension last loaded for an ISA setting (None: the best) says which repack library goes
    with it: JSON {build (the extension's folder name), library, torch, python}."""
    return root / f"early-repack-{isa_setting or 'best'}.json"


def python_tag() -> str:
    """This Python's major and minor version, as the build folders and the pointer file name it ("311")."""
    return f"{sys.version_info.major}{sys.version_info.minor}"
