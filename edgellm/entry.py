"""The `edgellm` command: starts reading the model's files off the disk, then imports the CLI (whose first import
of torch takes about a second, time the disk now uses)."""
from __future__ import annotations

import sys

from .prefetch import files_named_in, prefetch


def main() -> int:
    prefetch(files_named_in(sys.argv[1:]))
    from .cli import main as cli_main

    return cli_main()
