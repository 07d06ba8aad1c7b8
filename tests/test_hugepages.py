"""edgellm/hugepages.py: which memory the idle collapse asks for, that a collapse leaves the weights' values as they
were and puts them on 2 MiB pages, and when the engine lets it run."""
import time

import pytest
import torch

from edgellm import hugepages as H
from edgellm.generate import Engine, GenerationSettings
from edgellm.loading import load_model

MIB = 1 << 20


def test_huge_windows_keeps_whole_pages_inside_each_range():
    two = H.HUGE_PAGE
    assert H.huge_windows([(100, 2 * two - 1)]) == []  # less than one whole page inside
    assert H.huge_windows([(100, 3 * two + 5)]) == [(two, 3 * two)]
    assert H.huge_windows([(0, two), (two, 2 * two)]) == [(0, 2 * two)]  # adjacent ranges: one window
    assert H.huge_windows([(5 * two, 7 * two), (0, two)]) == [(0, two), (5 * two, 7 * two)]  # sorted
    assert H.huge_windows([(1, two)]) == []


def test_joined_merges_ranges_closer_than_a_page():
    assert H.joined([(0, 100), (150, 300), (300 + 4096, 5000)]) == [(0, 300), (4396, 5000)]
    assert H.joined([(8000, 9000), (0, 7990)]) == [(0, 9000)]


def test_intersect_cuts_windows_to_the_ranges():
    windows = [(0, 100), (200, 400)]
    assert H.intersect(windows, [(50, 250), (300, 1000)]) == [(50, 100), (200, 250), (300, 400)]
    assert H.intersect(windows, [(100, 200)]) == []


def test_anonymous_ranges_reads_private_writable_anonymous_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "55d0a0000000-55d0a0021000 rw-p 00000000 00:00 0                          [heap]\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "7f0000400000-7f0000800000 rw-s 00000000 00:05 123                        /dev/zero (deleted)\n"
        "7f0000800000-7f0000c00000 r--p 00000000 fd:01 456                        /models/m.gguf\n"
        "7f0000c00000-7f0000d00000 r--p 00000000 00:00 0 \n"
        "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]\n")
    assert H.anonymous_ranges(str(maps)) == [(0x55d0a0000000, 0x55d0a0021000), (0x7f0000000000, 0x7f0000400000)]


def test_weight_windows_keep_each_huge_page_inside_one_mapping(tmp_path):
    """A weight whose memory spans two anonymous mappings that meet mid-page (malloc's heap grown next to another map;
    seen in CI): the page across the seam is left out, every window stays whole 2 MiB pages."""
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(10 * MIB, dtype=torch.uint8))
    lo = module.w.data_ptr()
    first = -(-lo // H.HUGE_PAGE) * H.HUGE_PAGE  # the first whole huge page inside the tensor
    seam = first + 2 * H.HUGE_PAGE + 3 * 4096
    maps = tmp_path / "maps"
    maps.write_text(f"{lo - 4096:x}-{seam:x} rw-p 00000000 00:00 0                          [heap]\n"
                    f"{seam:x}-{lo + 20 * MIB:x} rw-p 00000000 00:00 0 \n")
    windows = H.weight_windows(module, str(maps))
    last = (lo + 10 * MIB) // H.HUGE_PAGE * H.HUGE_PAGE
    assert windows == [(first, first + 2 * H.HUGE_PAGE), (first + 3 * H.HUGE_PAGE, last)]


def _rss_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings overlapping [lo, hi) (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(v, 16) for v in head.split("-"))
                inside = a < hi and b > lo
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def test_collapse_keeps_the_values_and_uses_huge_pages():
    if not H.enabled():
        pytest.skip("transparent huge pages off on this machine (or not Linux)")
    module = torch.nn.Module()
    module.register_buffer("w", torch.randn(16 * MIB // 4, generator=torch.Generator().manual_seed(0)))  # 16 MiB
    expected = module.w.clone()
    windows = H.weight_windows(module)
    lo, hi = module.w.data_ptr(), module.w.data_ptr() + module.w.nbytes
    assert windows and all(lo <= a < b <= hi and a % H.HUGE_PAGE == 0 == b % H.HUGE_PAGE for a, b in windows)
    done = H.collapse(windows)
    if done < 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1)")
    assert done == sum(b - a for a, b in windows)
    assert torch.equal(module.w, expected)
    assert _rss_huge_kib(lo, hi) >= done // 1024


def test_weight_windows_leave_out_small_and_file_mapped_tensors(tmp_path):
    module = torch.nn.Module()
    module.register_buffer("small", torch.zeros(1000))
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(8 * MIB))
    module.register_buffer("mapped", torch.from_file(str(path), shared=False, size=8 * MIB, dtype=torch.uint8))
    assert H.weight_windows(module) == []


def test_idle_collapser_waits_for_the_engine_to_be_idle(monkeypatch):
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(H, "collapse", lambda windows: calls.extend(windows) or sum(b - a for a, b in windows))
    work = H.IdleCollapser([(0, 3 * H.CALL_BYTES)], idle_s=0.2)
    work.busy()
    work.idle()
    work.busy()  # a new answer started before the idle time ran out
    time.sleep(0.6)
    assert calls == []
    work.idle()
    assert work.finished.wait(10)
    assert calls == [(i * H.CALL_BYTES, (i + 1) * H.CALL_BYTES) for i in range(3)]
    assert work.collapsed == 3 * H.CALL_BYTES


def test_idle_collapser_stops_where_the_kernel_has_no_collapse(monkeypatch):
    calls = []
    monkeypatch.setattr(H, "collapse", lambda windows: calls.append(windows) or -1)
    work = H.IdleCollapser([(0, 3 * H.CALL_BYTES)], idle_s=0.0)
    work.idle()
    assert work.finished.wait(10)
    assert len(calls) == 1 and work.collapsed == 0


def test_switch_off(monkeypatch):
    monkeypatch.setenv("EDGELLM_HUGEPAGES", "0")
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(4 * MIB))
    assert H.when_idle(module) is None


class _Counting:
    def __init__(self):
        self.busy_calls = self.idle_calls = 0

    def busy(self):
        self.busy_calls += 1

    def idle(self):
        self.idle_calls += 1


def test_engine_marks_each_generation_busy_then_idle(tiny_llama):
    loaded = load_model(tiny_llama[1], max_seq_len=64)
    engine = Engine(loaded.model, loaded.tokenizer)
    engine.idle_work = _Counting()
    list(engine.generate([1, 2, 3], GenerationSettings(max_tokens=4, ignore_eos=True)))
    assert (engine.idle_work.busy_calls, engine.idle_work.idle_calls) == (1, 1)
    stream = engine.generate([1, 2, 3], GenerationSettings(max_tokens=8, ignore_eos=True))
    next(stream)
    assert (engine.idle_work.busy_calls, engine.idle_work.idle_calls) == (2, 1)  # busy while it runs
    stream.close()  # the consumer stops early (Ctrl-C in the chat): idle again
    assert engine.idle_work.idle_calls == 2
