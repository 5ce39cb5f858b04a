"""How many threads the colocated trainer takes: the cores no other process is using.

In colocated mode the generators are idle while the trainer trains, so it may have every core.
But OpenMP threads spin-wait for each other at every parallel region: a team larger than the free
cores waits for a descheduled thread each time. With one of two cores taken by another process,
two threads trained 1.6-6x slower than one (the sync trainer's single thread is not affected).
So before each micro-batch the trainer counts the threads of other processes running right now
(``/proc/loadavg``) and leaves them their cores. A thread that is runnable only for an instant
may cost one micro-batch its second thread (measured: 8 of 108 on an idle 2-core machine).
"""

from __future__ import annotations

import os


def free_cores() -> int:
    """The cores this process may use less those other processes' threads are running on now
    (at least one; every usable core where ``/proc`` cannot say)."""
    return max(1, usable_cores() - (others_running() or 0))


def usable_cores() -> int:
    """The cores this process may run on: its affinity, not ``os.cpu_count()`` (the machine's,
    larger under ``taskset``, a cpuset or a job scheduler)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def others_running() -> int | None:
    """Threads of other processes running or runnable right now: the machine's (the 4th field
    of ``/proc/loadavg``) less this process's; ``None`` without ``/proc`` (not Linux)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        tasks = os.listdir("/proc/self/task") if running > 1 else []
    except (OSError, ValueError, IndexError):
        return None
    own = 0
    for tid in tasks:  # this thread, and OpenMP workers still spinning after the last region
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                own += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return max(0, running - max(own, 1))
