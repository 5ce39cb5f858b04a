"""``scripts/chaos.py`` in its quickest configuration: a sync run whose generator is killed (it
is replaced) and whose process group is then SIGTERMed (it stops and is resumed) trains exactly
the (prompt, sample) pairs the uninterrupted run trains, each once, and loses none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_a_killed_generator_and_a_sigterm_lose_and_repeat_no_pair(tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--mode", "sync"]
    faults = ["--faults", "kill-generator,sigterm-group", "--workdir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*command, *faults], capture_output=True, text=True, timeout=540, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout  # one JSON line; progress went to stderr
    result = json.loads(lines[0])
    generator, sigterm = result["faults"]
    assert generator["what"].startswith("kill -9 generator") and generator["outcome"] == "replaced"
    assert sigterm["outcome"] == "stopped rc=143: streamrl fit: stopped by SIGTERM"
    assert result["resumes"] == 1
    assert result["ledger"]["samples_lost"] == 0
    assert result["ledger"]["samples_trained"] == result["samples_expected"]
    assert result["pairs_trained"] == result["samples_expected"]
    assert result["pairs_equal_uninterrupted"] and result["same_iteration_each"]
    assert result["pairs_trained_twice"] == result["pairs_missing"] == 0
