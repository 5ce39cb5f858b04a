"""The example and every notebook run end to end as plain scripts, on their small budgets.

Each runs in its own Python process, as a user would run it (`python examples/train_grpo.py`,
`python notebooks/0X_*.py`): that also checks the `__main__` guards that spawned generator
processes need. A run takes tens of seconds on 2 cores; the timeouts make a hang fail fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_grpo.py"
RG_EXAMPLE = REPO / "examples" / "train_reasoning_gym.py"
TOOL_EXAMPLE = REPO / "examples" / "train_tool_use.py"
RUN_TIMEOUT_S = 240  # about 40 s on an idle 2-core machine; headroom for a busy one

#: Every notebook and the figures it must write.
NOTEBOOKS = {
    "01_quickstart.py": ["01_reward.png"],
    "02_bubbles.py": ["02_bubbles.png"]
    + [f"02_timeline_{mode}.png" for mode in ("colocated", "sync", "async")],
    "03_long_tail.py": ["03_ranker.png", "03_dispatch.png"],
    "04_custom_algorithm.py": ["04_custom_algorithm.png"],
    "05_simulate_cluster.py": ["05_cluster.png", "05_timeline_async.png"],
    "06_scale_out.py": ["06_weight_bytes.png", "06_fsdp.png"],
    "07_reasoning_gym.py": ["07_reasoning_gym.png", "07_run/eval.png"],
    "08_episodes.py": ["08_episodes.png", "08_calculator/eval.png", "08_blackjack/eval.png"],
}

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


def run_script(path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``path`` with this interpreter from the repository root; fail with its output."""
    # conftest.py already points STREAMRL_CACHE / HF_HOME at temporary directories.
    full_env = {**os.environ, "MPLBACKEND": "Agg", **env}
    proc = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{path.name} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.mark.parametrize("example", [EXAMPLE, RG_EXAMPLE, TOOL_EXAMPLE], ids=lambda p: p.name)
def test_example_fits_on_one_screen(example):
    lines = example.read_text().splitlines()
    assert len(lines) <= 50, f"examples/{example.name} has {len(lines)} lines; keep it <= 50."
    assert 'if __name__ == "__main__":' in example.read_text()


def test_example_trains_with_a_tiny_budget():
    proc = run_script(EXAMPLE, "--iterations", "2", "--prompts", "8", "--sft-steps", "20")
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("reward first ") and "(2 iterations)" in last, last


def test_reasoning_gym_example_trains_with_a_tiny_budget():
    proc = run_script(RG_EXAMPLE, "--iterations", "2", "--sft-steps", "10", "--rows", "64")
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out reward ") and "(2 iterations)" in last, last


def test_tool_use_example_trains_with_a_tiny_budget():
    proc = run_script(TOOL_EXAMPLE, "--iterations", "2", "--sft-steps", "10", "--rows", "64")
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out success ") and "; 2 iterations)" in last, last


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs_as_a_script(name, tmp_path):
    out = tmp_path / "out"
    run_script(
        REPO / "notebooks" / name, STREAMRL_NOTEBOOK_BUDGET="small", STREAMRL_NOTEBOOK_OUT=str(out)
    )
    for figure in NOTEBOOKS[name]:
        path = out / figure
        assert path.is_file() and path.stat().st_size > 1000, f"{name} did not write {figure}"


def test_every_notebook_is_tested_and_says_what_it_shows():
    on_disk = {p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.py")}
    assert on_disk == set(NOTEBOOKS)
    for name in on_disk:
        text = (REPO / "notebooks" / name).read_text()
        assert text.startswith("# %% [markdown]\n# # "), f"{name}: start with a markdown title"
        assert "**Paper.**" in text and "STREAMRL_NOTEBOOK_BUDGET" in text, name
