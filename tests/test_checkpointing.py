"""Checkpoints written whole or not at all (``streamrl.training.checkpointing``): a process killed
with SIGKILL in the middle of a save leaves the previous checkpoint loadable, and a stopped run's
save gives up at its deadline rather than outlive the scheduler's grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from streamrl.errors import ConfigError
from streamrl.runtime.stopping import Stopped
from streamrl.training.checkpointing import AtomicCheckpointIO, CheckpointSchedule, RunCheckpoint

# The child writes a small checkpoint, then a large one over it, slowly (the file object's
# writes are throttled so that the kill lands mid-write), and reports each stage.
_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from streamrl.training.checkpointing import AtomicCheckpointIO

    path = sys.argv[1]
    AtomicCheckpointIO().save_checkpoint({"step": 1, "w": torch.arange(10.0)}, path)
    print("first", flush=True)
    real_open = open

    class Slow:
        def __init__(self, f):
            self.f = f
        def write(self, data):
            time.sleep(0.05)
            return self.f.write(data)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    import builtins
    builtins.open = lambda *a, **k: Slow(real_open(*a, **k))
    print("second", flush=True)
    AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(4_000_000)}, path)
    print("done", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "last.ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "first"
        first_size = path.stat().st_size
        assert child.stdout.readline().strip() == "second"
        deadline = time.monotonic() + 60
        while not _writing(tmp_path, first_size) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _writing(tmp_path, first_size), "the second save never started"
        os.kill(child.pid, signal.SIGKILL)  # mid-write
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["step"] == 1 and torch.equal(checkpoint["w"], torch.arange(10.0))
    # The next save replaces the leftover partial file and leaves none behind.
    AtomicCheckpointIO().save_checkpoint({"step": 3}, path)
    assert torch.load(path, weights_only=True) == {"step": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def _writing(folder, first_size: int) -> bool:
    """Whether the second save has written bytes (wherever it writes them)."""
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    return sizes.get("last.ckpt") != first_size or any(
        size > 0 for name, size in sizes.items() if name != "last.ckpt"
    )


def test_the_run_trainer_writes_its_checkpoints_atomically(tmp_path, tokenizer):
    from streamrl.algorithms import GRPO
    from streamrl.policy.models import build_tiny_model
    from streamrl.training.builders import build_trainer
    from streamrl.training.module import StreamRLModule

    module = StreamRLModule(build_tiny_model(tokenizer, "test"), GRPO(group_size=2), None, 1)
    trainer = build_trainer(module, output_dir=tmp_path, show_progress=False)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    callbacks = [c for c in trainer.callbacks if isinstance(c, RunCheckpoint)]
    assert len(callbacks) == 1 and callbacks[0].stop_deadline_s == 60.0
    assert callbacks[0]._every_n_train_steps == 10  # CheckpointSchedule's default, as fit's


class _Trainer:
    """What ``RunCheckpoint.on_exception`` reads of a Lightning trainer."""

    world_size, global_step, is_global_zero = 1, 7, True


def test_a_stopped_runs_save_gives_up_at_its_deadline(tmp_path, monkeypatch, capsys):
    callback = CheckpointSchedule(stop_deadline_s=0.3).callback(tmp_path)
    saved = []

    def slow_save(trainer, candidates):  # a save longer than the grace period
        time.sleep(5)
        saved.append(trainer.global_step)

    monkeypatch.setattr(callback, "_save_last_checkpoint", slow_save)
    monkeypatch.setattr(callback, "_monitor_candidates", lambda trainer: {})
    callback.on_exception(_Trainer(), None, Stopped(signal.SIGTERM))  # not training yet: none
    assert "saving" not in capsys.readouterr().err
    callback.on_train_start(_Trainer(), None)
    alarm = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    callback.on_exception(_Trainer(), None, Stopped(signal.SIGTERM))
    assert time.monotonic() - started < 2 and not saved
    err = capsys.readouterr().err
    assert "saving the 7 finished iterations" in err and "was abandoned" in err
    assert signal.getsignal(signal.SIGALRM) is alarm  # the timer's handler is gone

    monkeypatch.setattr(callback, "_save_last_checkpoint", lambda t, c: saved.append(7))
    callback.on_exception(_Trainer(), None, RuntimeError("a crash"))  # not a stop: no save
    assert not saved
    callback.on_exception(_Trainer(), None, Stopped(signal.SIGINT))
    assert saved == [7] and "checkpoint saved" in capsys.readouterr().err


def test_a_stopped_run_without_a_deadline_saves_whatever_it_takes(tmp_path, monkeypatch, capsys):
    """``rl.checkpoints: {stop_deadline_s: null}``: the save at a stop has no time limit."""
    callback = CheckpointSchedule(stop_deadline_s=None).callback(tmp_path)
    saved = []
    monkeypatch.setattr(callback, "_save_last_checkpoint", lambda t, c: saved.append(7))
    monkeypatch.setattr(callback, "_monitor_candidates", lambda trainer: {})
    callback.on_train_start(_Trainer(), None)
    callback.on_exception(_Trainer(), None, Stopped(signal.SIGTERM))
    err = capsys.readouterr().err
    assert saved == [7] and "(no limit, rl.checkpoints.stop_deadline_s)" in err
    assert "checkpoint saved" in err


@pytest.mark.parametrize("schedule", [dict(every=-1), dict(stop_deadline_s=0.0)])
def test_a_checkpoint_schedule_out_of_range_is_refused(schedule):
    with pytest.raises(ConfigError, match="CheckpointSchedule: need every >= 0"):
        CheckpointSchedule(**schedule)
