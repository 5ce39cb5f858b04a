"""A process's peak memory, the figure every memory claim of streamrl is stated in: the peak
resident set size on the CPU (Linux's ``VmHWM``), the peak of allocated tensors on CUDA."""

from __future__ import annotations

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
