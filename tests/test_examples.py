"""The examples run end to end as plain scripts, and every notebook in a Jupyter kernel, on their
small budgets.

An example runs in its own Python process, as a user would run it (`python examples/train_grpo.py`).
A notebook runs as Jupyter runs it: its generated `.ipynb`, cell by cell, in an ipykernel started
by `nbclient` from the notebooks' folder. In a kernel `__name__ == "__main__"` always holds and a
spawned generator process imports nothing of the notebook (the kernel's `__main__` has no file),
so the `__main__` guards that a plain `python notebooks/0X_*.py` run needs are checked apart: each
notebook is run the way a spawned process imports it (`__name__ == "__mp_main__"`), where starting
a process fails. A run takes tens of seconds on 2 cores; the timeouts make a hang fail fast.
"""

from __future__ import annotations

import importlib.util
import json
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

NOTEBOOK_DIR = REPO / "notebooks"
#: Every notebook and the figures it must write.
NOTEBOOKS = {
    "01_quickstart": ["01_reward.png"],
    "02_bubbles": ["02_bubbles.png"]
    + [f"02_timeline_{mode}.png" for mode in ("colocated", "sync", "async")],
    "03_long_tail": ["03_ranker.png", "03_dispatch.png"],
    "04_custom_algorithm": ["04_custom_algorithm.png"],
    "05_simulate_cluster": ["05_cluster.png", "05_timeline_async.png"],
    "06_scale_out": ["06_weight_bytes.png", "06_fsdp.png"],
    "07_reasoning_gym": ["07_reasoning_gym.png", "07_run/eval.png"],
    "08_episodes": ["08_episodes.png", "08_calculator/eval.png", "08_blackjack/eval.png"],
}
#: The notebooks that start processes, so guard those cells with `if __name__ == "__main__":`.
GUARDED = [name for name in NOTEBOOKS if "__main__" in (NOTEBOOK_DIR / f"{name}.py").read_text()]

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


def test_example_trains_with_a_tiny_budget_through_the_recipe(tmp_path):
    out = tmp_path / "run"
    args = ["--iterations", "2", "--prompts", "8", "--sft-steps", "20", "--heldout", "16"]
    proc = run_script(EXAMPLE, *args, "--output-dir", str(out))
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out accuracy ") and "(2 iterations)" in last, last
    # The road `streamrl fit` takes: its summary, timeline and trained policy directory.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["samples_lost"] == 0
    assert summary["mode"] == "async" and summary["algorithm"]["name"] == "GRPO"
    assert len(summary["reward_per_iteration"]) == 2
    assert (out / "timeline.png").exists() and (out / "policy" / "config.json").exists()


@pytest.mark.parametrize(
    ("example", "says", "env"),
    [
        (RG_EXAMPLE, "held-out reward ", None),
        (TOOL_EXAMPLE, "held-out success ", "calculator"),
    ],
    ids=lambda v: v.name if isinstance(v, Path) else None,
)
def test_a_task_example_trains_with_a_tiny_budget_through_the_recipe(example, says, env, tmp_path):
    out = tmp_path / "run"
    args = ["--iterations", "2", "--sft-steps", "10", "--rows", "64", "--output-dir", str(out)]
    last = run_script(example, *args).stdout.strip().splitlines()[-1]
    assert last.startswith(says) and last.endswith(("(2 iterations)", "; 2 iterations)")), last
    # The road `streamrl fit` takes: its summary and trained policy directory.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["samples_lost"] == 0
    assert summary["mode"] == "async" and summary["algorithm"]["name"] == "GRPO"
    assert summary.get("env") == env and (out / "policy" / "config.json").exists()


def run_in_kernel(name: str, out: Path) -> list[dict]:
    """Execute ``notebooks/<name>.ipynb`` in a fresh ipykernel, as Jupyter does; its outputs."""
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[notebooks]'")
    pytest.importorskip("ipykernel", reason="pip install -e '.[notebooks]'")
    import nbformat

    notebook = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    # Last, a cell that says which Python the kernel runs (a "python3" kernel spec of another
    # environment would test that environment's streamrl).
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.prefix)"))
    # conftest.py already points STREAMRL_CACHE / HF_HOME at temporary directories; the kernel
    # draws its figures with its own inline backend, as in Jupyter.
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env.update(STREAMRL_NOTEBOOK_BUDGET="small", STREAMRL_NOTEBOOK_OUT=str(out))
    client = nbclient.NotebookClient(
        notebook,
        timeout=RUN_TIMEOUT_S,  # per cell
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},  # Jupyter's working directory
    )
    client.execute(env=env)  # raises CellExecutionError, with the cell's traceback, on an error
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    kernel_prefix = outputs[-1].get("text", "").strip()
    assert kernel_prefix == sys.prefix, (
        f"the python3 kernel runs the Python of {kernel_prefix}, not this one ({sys.prefix}): "
        "another environment's python3 kernel spec comes first (`jupyter kernelspec list`)"
    )
    return outputs


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs_in_a_kernel(name, tmp_path):
    out = tmp_path / "out"
    outputs = run_in_kernel(name, out)
    for figure in NOTEBOOKS[name]:
        path = out / figure
        assert path.is_file() and path.stat().st_size > 1000, f"{name} did not write {figure}"
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    # tqdm's notebook bars need ipywidgets ([notebooks] extra); without it they warn and fall back.
    assert "IProgress not found" not in stderr


#: Run each notebook as a spawned process imports it, with process starts refused (spawned
#: Python processes, and subprocesses such as Ray's).
AS_SPAWNED = """
import multiprocessing.process, runpy, subprocess, sys

def refuse(*args, **kwargs):
    raise RuntimeError("a process started outside `if __name__ == '__main__':`")

multiprocessing.process.BaseProcess.start = refuse
subprocess.Popen.__init__ = refuse
for path in sys.argv[1:]:
    print(path, flush=True)
    runpy.run_path(path, run_name="__mp_main__")
"""


def test_notebooks_start_processes_only_under_main_guards(tmp_path):
    # A spawned generator process of `python notebooks/0X_*.py` first runs the script with
    # `__name__ == "__mp_main__"`: only imports and set-up may run then, no process start (which
    # would start processes without end) and no training. Run after the kernel runs, the
    # warm starts are cached, as they are when a generator process starts.
    script = tmp_path / "as_spawned.py"
    script.write_text(AS_SPAWNED)
    paths = [str(NOTEBOOK_DIR / f"{name}.py") for name in GUARDED]
    out = tmp_path / "out"
    proc = run_script(
        script, *paths, STREAMRL_NOTEBOOK_BUDGET="small", STREAMRL_NOTEBOOK_OUT=str(out)
    )
    assert all(path in proc.stdout for path in paths)
    assert not list(out.rglob("*.png")), "a figure was drawn outside the guards"


def _sync_module():
    pytest.importorskip("jupytext", reason="pip install -e '.[dev]'")
    spec = importlib.util.spec_from_file_location(
        "sync_notebooks", REPO / "scripts/sync_notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_ipynb_is_generated_from_its_script(name):
    sync = _sync_module()
    committed = (NOTEBOOK_DIR / f"{name}.ipynb").read_text(encoding="utf-8")
    code = [cell for cell in json.loads(committed)["cells"] if cell["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), (
        f"notebooks/{name}.ipynb holds outputs: run `make notebooks`"
    )
    assert json.loads(committed) == json.loads(sync.render(NOTEBOOK_DIR / f"{name}.py")), (
        f"notebooks/{name}.ipynb is out of date with {name}.py: run `make notebooks` (edit the .py)"
    )


def test_every_notebook_is_tested_and_says_what_it_shows():
    on_disk = {p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.py")}
    assert on_disk == set(NOTEBOOKS)
    assert {p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")} == on_disk
    for name in on_disk:
        text = (NOTEBOOK_DIR / f"{name}.py").read_text()
        assert text.startswith("# %% [markdown]\n# # "), f"{name}: start with a markdown title"
        assert "**Paper.**" in text and "STREAMRL_NOTEBOOK_BUDGET" in text, name
