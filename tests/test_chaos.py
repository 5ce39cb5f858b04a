"""``scripts/chaos.py`` in its quickest configuration: a sync run whose generator and reward
worker are killed (each is replaced) and whose process group is then SIGTERMed (it stops and
is resumed) trains exactly the (prompt, sample) pairs the uninterrupted run trains, each once,
and loses none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _chaos(tmp_path: Path, *args: str) -> dict:
    command = [sys.executable, str(ROOT / "scripts" / "chaos.py"), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*command, "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=540, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout  # one JSON line; progress went to stderr
    return json.loads(lines[0])


def _nothing_lost_or_repeated(result: dict) -> None:
    assert result["ledger"]["samples_lost"] == 0
    assert result["ledger"]["samples_trained"] == result["samples_expected"]
    assert result["pairs_trained"] == result["samples_expected"]
    same = result["pairs_equal_uninterrupted"] and result["same_iteration_each"]
    assert same, json.dumps({k: result[k] for k in ("differences", "faults", "ledger")})
    assert result["pairs_trained_twice"] == result["pairs_missing"] == 0


@pytest.mark.timeout(600)
def test_a_killed_generator_reward_worker_and_a_sigterm_lose_and_repeat_no_pair(tmp_path):
    faults = "kill-generator,kill-reward-worker,sigterm-group"
    result = _chaos(tmp_path, "--mode", "sync", "--faults", faults)
    generator, reward, sigterm = result["faults"]
    assert generator["what"].startswith("kill -9 generator") and generator["outcome"] == "replaced"
    assert reward["what"].startswith("kill -9 reward worker") and reward["outcome"] == "replaced"
    assert result["ledger"]["reward_workers_restarted"] >= 1
    assert sigterm["outcome"] == "stopped rc=143: streamrl fit: stopped by SIGTERM"
    assert result["resumes"] == 1
    _nothing_lost_or_repeated(result)


@pytest.mark.timeout(600)
def test_two_trainer_ranks_survive_a_killed_rank_then_a_sigterm(tmp_path):
    """Two FSDP ranks: rank 1 killed (the run stops, resumes), then SIGTERM to the resumed
    run's group: it stops at once (it hung in Lightning's own SIGTERM handler, a broadcast that
    waited for a rank busy elsewhere) and resumes; every pair trained once."""
    faults = "kill-trainer-rank,sigterm-group"
    result = _chaos(tmp_path, "--ranks", "2", "--faults", faults, "--iterations", "30")
    rank, sigterm = result["faults"]
    assert rank["outcome"].startswith("stopped rc=1: streamrl fit: stopped: trainer rank 1 died")
    assert sigterm["outcome"] == "stopped rc=143: streamrl fit: stopped by SIGTERM"
    assert result["resumes"] == 2
    _nothing_lost_or_repeated(result)


@pytest.mark.timeout(600)
def test_an_episode_run_survives_a_killed_env_worker(tmp_path):
    """Async episodes, the environments in a worker process: kill -9 it mid-run; it is replaced,
    the episodes it held start again from their prompts, every pair trained once."""
    result = _chaos(tmp_path, "--episodes", "--mode", "async", "--faults", "kill-env-worker")
    (fault,) = result["faults"]
    assert fault["what"].startswith("kill -9 env worker") and fault["outcome"] == "replaced"
    assert result["resumes"] == 0
    _nothing_lost_or_repeated(result)
