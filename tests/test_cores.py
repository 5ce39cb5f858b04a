"""free_cores: the colocated trainer's threads leave other processes the cores they run on."""

from __future__ import annotations

import pytest

from streamrl.runtime import cores


@pytest.fixture
def proc(monkeypatch):
    """A fake ``/proc``; returns ``set_(running, own)``: the machine's runnable threads, and of
    those this process's."""
    state = {"running": 1, "own": 1}
    real_open = open

    class _File:
        def __init__(self, text):
            self.text = text

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return self.text

    def fake_open(path, *args, **kwargs):
        if path == "/proc/loadavg":
            return _File(f"0.1 0.1 0.1 {state['running']}/90 1234\n")
        if path.startswith("/proc/self/task/"):
            tid = int(path.split("/")[4])
            return _File(f"{tid} (python) {'R' if tid < state['own'] else 'S'} 1 2 3\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(cores.os, "listdir", lambda path: [str(t) for t in range(6)])
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)

    def set_(running: int, own: int) -> None:
        state.update(running=running, own=own)

    return set_


def test_every_core_when_only_this_process_runs(proc):
    proc(running=1, own=1)
    assert cores.free_cores() == 4
    proc(running=3, own=3)  # this thread and two OpenMP workers still spinning
    assert cores.free_cores() == 4


def test_cores_other_processes_run_on_are_left_to_them(proc):
    proc(running=2, own=1)
    assert cores.free_cores() == 3
    proc(running=4, own=2)
    assert cores.free_cores() == 2
    proc(running=9, own=1)  # more than the cores: still one thread
    assert cores.free_cores() == 1


def test_without_proc_every_usable_core(monkeypatch):
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr("builtins.open", no_proc)
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert cores.others_running() is None
    assert cores.free_cores() == 2


def test_usable_cores_is_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 64)
    assert cores.usable_cores() == 2


def test_a_real_reading_counts_at_least_nothing():
    assert cores.others_running() in (None, *range(0, 10_000))
    assert 1 <= cores.free_cores() <= cores.usable_cores()
