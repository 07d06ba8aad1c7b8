"""The process's peak resident memory, without torch (edgellm/llama_cpp_peer.py reads it in a process that must not
load torch)."""
from __future__ import annotations

import sys


def process_peak_rss() -> int:
    """The process's peak RSS in bytes: Linux's VmHWM (since the last `reset_process_peak_rss`), else ru_maxrss."""
    try:
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, AttributeError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def reset_process_peak_rss() -> bool:
    """Start the peak RSS afresh from the current RSS (Linux >= 4.0: /proc/self/clear_refs "5"), so that a peak read
    later is that of what ran since (`edgellm bench`: one weight format's load and runs, not an earlier format's or
    the bandwidth test's arrays). Returns False where the platform has no such reset."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False
