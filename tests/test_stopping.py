"""A run stopped from outside (``streamrl.runtime.stopping``): SIGTERM or Ctrl-C to the run or to
its whole process group is one event; the run never exits 0 for it, replaces none of the children
the signal killed, leaves no process behind and says how to go on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from streamrl.algorithms import GRPO
from streamrl.components.generation.service import StreamGenerationService
from streamrl.runtime.stopping import Stopped, resume_hint, shielded, stop_on_signals
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream


def test_the_first_signal_raises_stopped_and_the_rest_are_ignored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped, stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here, at once
    assert stopped.value.signal == "SIGTERM" and stopped.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before

    with pytest.raises(Stopped) as stopped, stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        finally:  # cleaning up: the group's copies of the signal change nothing
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
    assert stopped.value.signal == "SIGINT" and stopped.value.exit_code == 130


def test_a_stop_inside_a_shielded_block_waits_for_its_end():
    done = []
    with pytest.raises(Stopped), stop_on_signals():
        with shielded():  # an optimizer step, a checkpoint being written
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
            done.append("the whole block")
        done.append("past it")  # never: the stop is raised as the block ends
    assert done == ["the whole block"]
    with shielded():  # outside stop_on_signals: nothing to hold back
        done.append("plain")


class _NoService:
    """The stream's sampler for a test that never reads a sample."""

    scores_samples = False
    dispatcher = None
    counts: ClassVar[Counter] = Counter()

    def start_group(self, group):
        return StreamGenerationService.start_group(self, group)

    def submit(self, requests, scores=None) -> None:
        pass


class _SignalledSource(PromptSource):
    """A prompt source that receives SIGTERM while it hands out its ``strike_at``-th row."""

    strike_at = -1

    def next_row(self) -> dict:
        self.strike_at -= 1
        if self.strike_at == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, mid-batch
        return super().next_row()


def test_a_stop_while_prompts_are_dealt_leaves_them_in_flight_for_the_resume(tokenizer):
    """A SIGTERM landing while the stream takes an iteration's prompts from the source: the
    checkpoint's state holds them as in flight, so the resumed run deals the same prompts to
    the same iterations as a run never stopped. (Before, the prompts taken were in no
    iteration: the likely cause of test_chaos.py's rare failure, its SIGTERM lands near a
    dispatch.)"""
    rows = [{"prompt_id": f"p{i}", "prompt": "ab", "answer": ""} for i in range(12)]

    def stream(source: PromptSource) -> RolloutStream:
        return RolloutStream(
            _NoService(),
            source,
            tokenizer,
            GRPO(group_size=2),
            reward=lambda c, a: 0.0,
            max_tokens=4,
            context=64,
        )

    def dealt(s: RolloutStream, iterations: int) -> list[list[str]]:
        return [sorted(s._batches[s.dispatch()].rows) for _ in range(iterations)]

    uninterrupted = dealt(stream(PromptSource(rows, 3, seed=0)), 3)
    source = _SignalledSource(rows, 3, seed=0)
    stopped = stream(source)
    dealt(stopped, 1)
    source.strike_at = 2  # the second prompt of the second iteration
    with pytest.raises(Stopped), stop_on_signals():
        stopped.dispatch()
    state, prompts = stopped.state_dict(), source.state_dict()
    assert [sorted(r["prompt_id"] for r in v) for v in state["in_flight"].values()] == (
        uninterrupted[:2]
    )
    resumed_source = PromptSource(rows, 3, seed=0)
    resumed_source.load_state_dict(prompts)
    resumed = stream(resumed_source)
    resumed.load_state_dict(state)
    assert dealt(resumed, 3) == uninterrupted


def test_a_checkpoint_being_written_is_finished_before_the_stop(tmp_path, monkeypatch):
    """The run's checkpoint callback saves under ``shielded``: a SIGTERM mid-save leaves a
    whole file (it is the one the stop message tells users to resume from)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from streamrl.training.checkpointing import CheckpointSchedule

    def slow_save(self, trainer, filepath):  # Lightning's save, with a signal in the middle
        with open(filepath, "w") as f:
            f.write("first half ")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
            f.write("second half")

    monkeypatch.setattr(ModelCheckpoint, "_save_checkpoint", slow_save)
    target = tmp_path / "last.ckpt"
    with pytest.raises(Stopped), stop_on_signals():
        trainer = SimpleNamespace(lightning_module=None, global_step=0)  # not on a timeline
        CheckpointSchedule().callback(tmp_path)._save_checkpoint(trainer, str(target))
    assert target.read_text() == "first half second half"


def test_the_resume_hint_names_the_last_checkpoint_or_says_there_is_none(tmp_path):
    argv = ["fit", "--config", "my run.yaml", "--resume", "old.ckpt", "--no-progress"]
    assert "no checkpoint to resume from" in resume_hint(tmp_path, argv)
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"")
    hint = resume_hint(tmp_path, argv)
    assert hint.endswith(f"streamrl fit --config 'my run.yaml' --no-progress --resume {last}")


def _run(tmp_path: Path, iterations: int) -> tuple[subprocess.Popen, Path]:
    config = tmp_path / "c.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "data: {tasks: [copy], n_train: 16, n_heldout: 4, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 2}\n"
        f"rl: {{iterations: {iterations}, prompts_per_iteration: 2, group_size: 2, "
        "generation: {num_instances: 2}, reward_pool: {workers: 1}, checkpoints: {every: 1}}\n"
    )
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--no-progress", "--config"]
    proc = subprocess.Popen(
        [*command, str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under a scheduler
    )
    return proc, config


def _group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_whole_group_stops_the_run_with_the_command_to_go_on(tmp_path, signum):
    proc, config = _run(tmp_path, iterations=100000)
    last = tmp_path / "out" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 200
    while not last.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert last.is_file(), "no checkpoint was written"
    time.sleep(1)  # mid-iteration
    os.killpg(proc.pid, signum)  # the run, its generators and its reward worker at once
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    name = signal.Signals(signum).name
    assert f"streamrl fit: stopped by {name}" in err
    assert f"streamrl fit --no-progress --config {config} --resume {last}" in err
    assert "Traceback" not in err and "died" not in err
    assert not [line for line in out.splitlines() if line.startswith("{")]  # no summary
    assert _group_gone(proc.pid, 30), "a process of the run outlived it"
    instances = json.loads((tmp_path / "out" / "instances.json").read_text())
    assert len(instances) == 2, instances  # the generators it killed were not replaced
    # The checkpoint it names was written at the stop: no finished iteration is lost.
    assert torch.load(last, weights_only=True)["stopped_by"] == name
    assert not list(last.parent.glob(".*partial"))


def test_resume_auto_takes_the_newest_of_last_and_lightnings_slurm_checkpoints(tmp_path):
    """Under SLURM, Lightning saves ``hpc_ckpt_N.ckpt`` on the requeue signal (SIGUSR1) and the
    stop writes ``last.ckpt``: the requeued job's ``--resume auto`` goes on from the newer."""
    from streamrl.errors import ConfigError
    from streamrl.run.reruns import resolve_resume

    assert resolve_resume(tmp_path, "auto") is None
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"")
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    hpc.write_bytes(b"")
    os.utime(last, (1000, 1000))
    assert resolve_resume(tmp_path, "auto") == str(hpc)
    os.utime(hpc, (500, 500))
    assert resolve_resume(tmp_path, "auto") == str(last)
    last.unlink()
    assert resolve_resume(tmp_path, "auto") == str(hpc)
    with pytest.raises(ConfigError, match="holds an earlier run"):  # no silent fresh start
        resolve_resume(tmp_path, None)


def test_lightnings_requeue_save_waits_for_a_shielded_step():
    """SIGUSR1 (SLURM's requeue signal: Lightning saves a checkpoint in its handler) inside an
    optimizer step runs once the step is whole, not in its middle."""
    from streamrl.runtime.stopping import hold_signal

    seen: list[str] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append("saved"))
    try:
        with stop_on_signals():
            hold_signal(signal.SIGUSR1)
            with shielded():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.2)
                seen.append("step done")
            os.kill(os.getpid(), signal.SIGUSR1)  # outside a step: at once
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == ["step done", "saved", "saved"]
