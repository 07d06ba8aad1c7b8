"""The `edgellm` command: starts reading the model's files off the disk, then imports the CLI (whose first import
of torch takes about a second, time the disk now uses)."""
from __future__ import annotations

import os
import sys

from .prefetch import files_named_in, prefetch


def main() -> int:
    if os.environ.get("EDGELLM_PREFETCH") != "0":  # (an A/B switch: benchmarks/cold_load.py)
        prefetch(files_named_in(sys.argv[1:]))
    from .cli import main as cli_main

    return cli_main()
