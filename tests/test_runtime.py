"""Process-wide runtime settings (edgellm/device.py keep_freed_memory): checked in fresh processes, since they last
for the life of one."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from edgellm.device import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "1" else False
def cycle():  # 8-24 MB fp32 temporaries of varying sizes, as a prefill's layers make and drop them
    for n in (4 << 20, 3 << 20, 5 << 20, 2 << 20, 6 << 20):
        a = torch.empty(n); a.fill_(1.0); b = torch.empty(n // 2); b.fill_(2.0); del a, b
cycle()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(on: bool) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if on else "0"], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "1", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_freed_temporaries_are_reused_without_page_faults():
    # ~90 MB allocated and written again and again: reused pages. In about one fresh process in four the heap's
    # layout after `import torch` leaves the freed blocks short of the largest temporary (24 MB), which is then
    # placed higher each cycle and faults in, with the setting or without (measured 2-3 of 12, in each of three
    # settings of torch's and the extension's ISA and threads): the best of five processes
    runs = [_faults(True) for _ in range(5)]
    assert all(applied for applied, _ in runs)
    assert min(faults for _, faults in runs) < 500, runs
    _, default_faults = _faults(False)
    assert default_faults > 5000, default_faults  # what glibc's defaults cost (the setting's reason to exist)


def test_the_loader_applies_it(monkeypatch):
    from edgellm import device
    from edgellm.kernels import matmul
    from edgellm.options import Options, configure_process

    calls = []
    monkeypatch.setattr(device, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(matmul, "configure_cpu_extension", lambda settings: None)  # leave this process's kernels be
    configure_process(Options())
    assert calls == [1]


@pytest.mark.skipif(platform.system() != "Linux", reason="Linux's /proc/self/clear_refs")
def test_peak_rss_restarts_from_the_current_rss():
    """device.reset_process_peak_rss: a peak read after it leaves out what was freed before (edgellm bench's rows: one
    weight format's load and runs, not the bandwidth test's arrays)."""
    child = r"""
from edgellm.device import process_peak_rss, reset_process_peak_rss
big = bytearray(256 << 20)
for i in range(0, len(big), 4096):
    big[i] = 1
del big
before = process_peak_rss()
ok = reset_process_peak_rss()
print(int(ok), before, process_peak_rss())
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    ok, before, after = map(int, out.stdout.split())
    assert ok == 1
    assert before - after > 200 << 20, (before, after)
