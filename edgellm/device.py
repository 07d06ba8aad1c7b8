"""Device choice, default dtypes, timers that synchronise, and memory readings."""
from __future__ import annotations

import time

import torch

from .rss import process_peak_rss, reset_process_peak_rss  # noqa: F401  (memory readings, torch-free)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError("--device mps: Metal (MPS) is not available")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU: bf16 GEMMs are several times slower without AVX-512-BF16/AMX (measured),
    and decode reads weights through our quantized kernels anyway. bf16 on CUDA, fp16 on MPS."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return default_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from fp32, fp16, bf16)")
    return DTYPES[name]


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)


# Prompt rows per forward pass. 512, except on the CPU where 512 rows' gate/up product (rows x 2 x intermediate fp32)
# would pass PREFILL_TEMPORARIES_BYTES: there 256. Peak RSS counts these temporaries; side by side
# (benchmarks/prefill_chunk_ab.py) 256 rows took 56 MB off the peak of the Qwen2.5-0.5B- and 1B-shaped GGUFs
# (intermediate 4864 / 8192) at the same TTFT (1.02x / 0.99x), where on SmolLM2 (1536: 6 MB at 512 rows) it cost
# 8-12% TTFT (per-chunk work: panel builds, Python per layer) for 15 MB. Below 256 rows TTFT grows (128: +7-10%).
PREFILL_CHUNK = 512
CPU_MIN_PREFILL_CHUNK = 256
PREFILL_TEMPORARIES_BYTES = 16 << 20


def prefill_chunk(device: torch.device, intermediate_size: int) -> int:
    """How many prompt tokens one forward pass takes (a longer prompt runs in chunks of this many)."""
    if device.type != "cpu" or PREFILL_CHUNK * 2 * intermediate_size * 4 <= PREFILL_TEMPORARIES_BYTES:
        return PREFILL_CHUNK
    return CPU_MIN_PREFILL_CHUNK


# glibc malloc: M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks up to 32 MiB (the largest mmap threshold it takes) in the heap, and up to
    KEEP_FREED_BYTES of free heap top, for reuse, instead of handing them back to the kernel. A CPU prefill makes and
    drops tens of MB of temporaries per layer (GEMM outputs, the gate/up product); returned to the kernel, every page
    of them faults in again on the next layer (measured: a 512-token SmolLM2 TTFT 15-20% shorter with this; a loop of
    8-24 MB tensors 21k page faults -> 0, tests/test_runtime.py). Peak RSS is unchanged: the memory is reused, not
    added. Linux with glibc only (elsewhere a no-op); returns whether it was applied."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def now(device: torch.device | None = None) -> float:
    """A timestamp taken after the device has finished queued work."""
    if device is not None:
        synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated on CUDA, current allocated on MPS, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return process_peak_rss()


def process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)
