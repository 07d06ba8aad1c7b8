"""The JSON record a CPU benchmark script leaves in benchmarks/results/: its command, the date, the machine."""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path


def write_run(path: str | Path, rows: list[dict], threads: int, **fields) -> None:
    """{command, date, machine (edgellm.bench.machine_info + threads), **fields, rows} as indented JSON."""
    import torch

    from edgellm.bench import machine_info

    doc = {"command": "python " + " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(),
           "machine": {**machine_info(torch.device("cpu")), "threads": threads}, **fields, "rows": rows}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
