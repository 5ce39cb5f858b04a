"""`streamrl demo` with another revision's code beside this tree's: each stage's start and length,
and the held-out figures before and after RL, one run after the other (never side by side).

    python scripts/demo_stages.py --baseline d284e03

Each run's stderr lines are time-stamped as they arrive; a stage heading (`[2/5] Held-out
evaluation ...`) starts a stage, the next heading ends it. The baseline runs from a git worktree
put first on `PYTHONPATH` (scripts/fit_memory.py does the same for memory). The last stdout line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baseline_tree import worktree

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^\[(\d)/(\d)\] (.*)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision, run from a worktree")
    parser.add_argument("--size", default="full", choices=["full", "small"])
    args = parser.parse_args()
    runs = []
    for label, tree in (
        (f"baseline {args.baseline}", worktree(args.baseline)),
        ("this tree", ROOT),
    ):
        print(f"[demo_stages] {label}", file=sys.stderr)
        runs.append({"code": label, **_run(tree, args.size)})
        for stage in runs[-1]["stages"]:
            print(
                f"  {stage['s']:7.1f} s  {stage['length_s']:7.1f} s  {stage['heading']}",
                file=sys.stderr,
            )
    print(json.dumps({"size": args.size, "runs": runs}))


def _run(tree: Path, size: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="demo-stages-"))
    command = [sys.executable, "-m", "streamrl.cli.main", "demo", "--size", size]
    command += ["--output_dir", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stages = []
    for line in proc.stderr:
        found = HEADING.match(line.strip())
        if found:
            stages.append({"heading": line.strip()[:90], "s": time.monotonic() - started})
    stdout = proc.stdout.read()
    proc.wait()
    end = time.monotonic() - started
    for stage, after in zip(stages, [*stages[1:], {"s": end}]):
        stage["length_s"] = after["s"] - stage["s"]
    summary = json.loads(stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    keys = ("heldout_acc_before", "heldout_acc_after", "reward_first", "reward_last")
    return {
        "returncode": proc.returncode,
        "wall_s": end,
        "stages": stages,
        "summary": {k: summary.get(k) for k in (*keys, "eval_wall_s", "samples_per_s")},
    }


if __name__ == "__main__":
    main()
