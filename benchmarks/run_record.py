"""The JSON record a CPU benchmark script leaves in benchmarks/results/: its command, the date, the machine; and
the fresh child process a benchmark measures peak RSS in."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path


def write_run(path: str | Path, rows: list[dict], threads: int, **fields) -> None:
    """{command (with the EDGELLM_* settings of the environment it ran in, which pick builds and paths), date,
    machine (edgellm.bench.machine_info + threads), **fields, rows} as indented JSON."""
    import torch

    from edgellm.bench import machine_info

    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("EDGELLM_")]
    doc = {"command": " ".join([*settings, "python", *sys.argv]), "date": datetime.now(timezone.utc).isoformat(),
           "machine": {**machine_info(torch.device("cpu")), "threads": threads}, **fields, "rows": rows}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


# Each child runs as on a user's machine, where Python caches modules' bytecode (pip compiles an installed package's;
# an editable install's are written on first import): a sandbox's PYTHONDONTWRITEBYTECODE=1 would otherwise charge
# edgellm's load (an editable install) ~0.2-0.3 s of compiling its own modules from source on every start.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_child(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str, int]:
    """Run `argv` to its end → (exit code, stdout, stderr, its own peak RSS in bytes: wait4's rusage, which counts
    this child alone). Both pipes are drained while it runs: a child writing more than a pipe holds would block."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=CHILD_ENV if env is None else env)
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=lambda f, sink: sink.append(f.read()), args=(proc.stdout, out)),
             threading.Thread(target=lambda f, sink: sink.append(f.read()), args=(proc.stderr, err))]
    for t in pumps:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    for t in pumps:
        t.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, "".join(out), "".join(err), usage.ru_maxrss * 1024
