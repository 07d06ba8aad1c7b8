"""A loaded model's weights moved onto 2 MiB pages while the engine is idle (Linux: madvise MADV_COLLAPSE).

A decode step streams every weight once per token, and on 4 KiB pages each page of that stream costs a TLB miss and a
page walk (the software prefetch that runs ahead of the kernels crosses into a new page every 4 KiB). With the
weights on 2 MiB pages a chat's second answer decoded the 1B-shaped Q4_K_M at 1.13x the tokens/s, the 3B-shaped one
at 1.05x and SmolLM2 Q4_K_M at 1.10x (AVX-512 host, 2 threads; benchmarks/hugepages_ab.py,
benchmarks/results/hugepages-ab.json). Where the pages come from matters:
- asked for before the weights are written (MADV_HUGEPAGE on the repack's buffers), they cost the load: on a
  virtual machine a fresh 2 MiB page took 0.15-2.4 s per GiB to fault in against 0.4 s for 4 KiB pages, and the
  1B's load went from 0.77 to 1.3 s whenever the run before had freed its memory on 4 KiB pages;
- collapsed by a thread right after the load (even at SCHED_IDLE), they slowed the load's last steps (0.8 -> 0.85-1.2
  s: a collapse holds the address space's lock that the main thread's page faults wait on) and, still running when
  the decode began, took the 3B's gain away.
So the weights load on 4 KiB pages as before, and `IdleCollapser` copies them onto huge pages, CALL_BYTES per call,
only once the engine has been idle for `idle_s` seconds after an answer (the user reading or typing; a server between
requests): chat and serve turn it on; a benchmark's back-to-back runs and one-shot commands never see it. Only whole
2 MiB pages inside a weight's own anonymous memory are asked for: no page that was not resident becomes so, nothing
in a file's map, and the values stay the same bytes. EDGELLM_HUGEPAGES=0 turns it off; where transparent huge pages
are set to "never" it does nothing.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import os
import platform
import threading
import time
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
CALL_BYTES = 8 << 20  # per madvise call (4 huge pages, ~2-20 ms): a generation starting meets at most one
MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1); Python's mmap module names it from 3.13 only
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def enabled() -> bool:
    """Linux with transparent huge pages not set to "never", and EDGELLM_HUGEPAGES not 0."""
    if platform.system() != "Linux" or os.environ.get("EDGELLM_HUGEPAGES") == "0":
        return False
    try:
        with open(THP_SETTING, encoding="ascii") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_windows(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole 2 MiB pages inside each [start, end) byte range, as [start, end) windows, adjacent ones merged."""
    aligned = ((-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE) for start, end in ranges)
    return joined(((lo, hi) for lo, hi in aligned if hi > lo), gap=1)


def anonymous_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """[start, end) of this process's private writable anonymous mappings (malloc's heap and large blocks, anonymous
    maps): the memory a collapse copies rather than a file's pages."""
    out = []
    with open(maps, encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            name = fields[5].strip() if len(fields) > 5 else ""
            if fields[1].startswith("rw") and fields[1][3] == "p" and name in ("", "[heap]"):
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the sorted, disjoint windows `a` that lie inside the ranges `b`."""
    out, b = [], sorted(b)
    for lo, hi in a:
        for blo, bhi in b:
            if bhi <= lo:
                continue
            if blo >= hi:
                break
            if min(hi, bhi) > max(lo, blo):
                out.append((max(lo, blo), min(hi, bhi)))
    return out


def joined(ranges: Iterable[tuple[int, int]], gap: int = 4096) -> list[tuple[int, int]]:
    """[start, end) ranges sorted, those less than `gap` bytes apart joined: tensors malloc placed one after another
    are one range (the bytes between them, malloc's chunk headers, lie in pages the tensors already made resident)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def weight_windows(module: torch.nn.Module, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The 2 MiB pages wholly inside the anonymous memory of `module`'s CPU parameters and buffers, each inside one
    mapping (a huge page cannot straddle two: where a weight's memory spans mappings that meet mid-page, that page
    stays out)."""
    spans = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            spans[storage.data_ptr()] = max(spans.get(storage.data_ptr(), 0), storage.data_ptr() + storage.nbytes())
    windows = huge_windows(joined(spans.items()))
    return huge_windows(intersect(windows, anonymous_ranges(maps))) if windows else []


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def collapse(windows: list[tuple[int, int]]) -> int:
    """madvise(MADV_COLLAPSE) over the windows → the bytes the kernel collapsed, or -1 where it does not know the call
    (EINVAL: a kernel older than 6.1). A window it cannot collapse now (EAGAIN, ENOMEM: no free huge page) stays on
    4 KiB pages."""
    libc = _libc()
    done = 0
    for lo, hi in windows:
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
        elif ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return -1
    return done


_exiting = threading.Event()
atexit.register(_exiting.set)  # (the collapsers' threads are daemons: they only need to stop asking)


class IdleCollapser:
    """Collapses a model's weight windows, CALL_BYTES at a time, whenever no generation has run for `idle_s` seconds.
    The engine calls `busy()` as a generation starts and `idle()` as it ends; the thread starts at the first `idle()`
    and ends when every window is done, the kernel cannot collapse, or the interpreter exits."""

    def __init__(self, windows: list[tuple[int, int]], idle_s: float = 0.5):
        self._calls = [(at, min(at + CALL_BYTES, hi)) for lo, hi in windows for at in range(lo, hi, CALL_BYTES)]
        self.idle_s = idle_s
        self.collapsed = 0  # bytes the kernel collapsed so far
        self.finished = threading.Event()
        self._busy = 0
        self._since = time.monotonic()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def busy(self) -> None:
        with self._cv:
            self._busy += 1

    def idle(self) -> None:
        with self._cv:
            self._busy = max(0, self._busy - 1)
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgellm-hugepages", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _next_call(self) -> tuple[int, int] | None:
        """The next window part once the engine has been idle for idle_s; None when all are done or at exit."""
        with self._cv:
            while self._calls and not _exiting.is_set():
                wait = self._since + self.idle_s - time.monotonic()
                if self._busy == 0 and wait <= 0:
                    return self._calls.pop(0)
                self._cv.wait(timeout=wait if self._busy == 0 else 1.0)
            return None

    def _run(self) -> None:
        try:
            while (call := self._next_call()) is not None:
                n = collapse([call])
                if n < 0:
                    return
                self.collapsed += n
        finally:
            self.finished.set()


def when_idle(module: torch.nn.Module, idle_s: float = 0.5) -> IdleCollapser | None:
    """An IdleCollapser for `module`'s weights, or None where there is nothing to do (not Linux, transparent huge pages
    "never", EDGELLM_HUGEPAGES=0, no whole 2 MiB page inside the weights' anonymous memory)."""
    if not enabled():
        return None
    windows = weight_windows(module)
    return IdleCollapser(windows, idle_s) if windows else None
