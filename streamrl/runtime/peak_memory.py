"""A process's peak memory, the figure every memory claim of streamrl is stated in: the peak
resident set size on the CPU (Linux's ``VmHWM``), the peak of allocated tensors on CUDA; and
``release_freed_memory``, which makes the first follow the live tensors."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """The peak since the process started (or since ``reset_peak_memory``).

    Args:
        device: a CUDA device reports ``torch.cuda.max_memory_allocated(device)``; anything
            else the process's peak resident set size.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_kib("VmHWM") * 1024 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """The process's resident set size now (Linux's ``VmRSS``; 0 where unknown)."""
    return _status_kib("VmRSS") * 1024


def reset_peak_memory(device: torch.device | str = "cpu") -> None:
    """Start a new peak from the current usage (Linux: ``/proc/self/clear_refs``; CUDA: the
    allocator's peak statistics)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS


def _status_kib(field: str) -> int:
    if not _STATUS.is_file():
        return 0
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


#: glibc's ``mallopt`` parameters: give memory back past this many bytes (trim), map each
#: allocation past this many bytes on its own (mmap).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: A CPU trainer rank returns freed memory at once for a model directory past this size. Below
#: it, a step allocates many mid-sized tensors for little compute and each fresh mapping's
#: zeroed pages cost more than the memory: the demo's trainer (a few MB of weights) ran at 129.5
#: samples/s with the 128 KiB threshold, 212.3 with 4 MiB, 225.5 without (`streamrl fit --config
#: configs/demo.yaml --rl.iterations 20`, 2026-12-05).
RELEASE_FROM_MODEL_BYTES = 256 * 2**20
#: A trainer rank's threshold: allocations past it get a mapping of their own, returned to the
#: system when freed. A decoder layer's gathered weights and gradients (tens of MB) are past
#: it; with 32 MiB a 0.5B rank peaked at 8.06 / 7.29 GiB against 6.17 / 5.24 GiB with this
#: (`python scripts/fit_memory.py --config configs/qwen0.5b-cpu.yaml`, 2026-12-05).
FREED_MEMORY_THRESHOLD_BYTES = 128 * 1024
#: A generator's threshold, glibc's largest (32 MiB on 64-bit): a decode step's many small
#: tensors stay in the heap; past 128 KiB each was a fresh mapping, zeroed page by page, and
#: the demo ran at half its samples/s (131.5 vs 238.0, `streamrl fit --config
#: configs/demo.yaml --rl.iterations 20`, 2026-12-05); weights and logits are past it.
DECODE_FREED_MEMORY_THRESHOLD_BYTES = 32 * 1024 * 1024


def release_freed_memory(threshold_bytes: int = FREED_MEMORY_THRESHOLD_BYTES) -> bool:
    """Make glibc return a freed tensor's memory to the system at once: every allocation past
    ``threshold_bytes`` gets a mapping of its own, unmapped when freed, and the heap
    is trimmed past as much (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_`` would from the start).
    By default glibc raises its mapping threshold as big blocks are freed and keeps them in its
    heap, so a CPU process's resident memory keeps the peak of every phase past (a 0.5B trainer
    rank: 7.2 GiB at its step's peak, 5.1 GiB with a 128 KiB threshold). Returns whether it
    applied (a glibc system)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    applied = mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
    return bool(applied and mallopt(_M_TRIM_THRESHOLD, threshold_bytes))
