"""Time a new user's first run: a fresh clone, an empty HOME, then ``make demo``.

Prints the demo's stderr as it comes, each stage heading stamped with the seconds since the
start, and at the end one JSON line: when each stage started, when the first RL iteration
started (its first span in ``runs/demo/trace.json``) and the total. Standard library only: it
runs before any virtualenv exists.

    python3 scripts/time_demo.py                       # the full demo
    python3 scripts/time_demo.py --demo-args "--size small"
    python3 scripts/time_demo.py --keep /tmp/first-run # keep the clone and HOME for a look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^\[(install|\d+/\d+)\] (.*)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-args", default="", help="passed as make demo DEMO_ARGS=...")
    parser.add_argument("--keep", help="a directory for the clone and HOME, kept afterwards")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="first-run-"))
    root.mkdir(parents=True, exist_ok=True)
    clone, home = root / "streamrl", root / "home"
    shutil.rmtree(clone, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), DEMO_ARGS=args.demo_args)
    started = time.time()
    stages = run_and_stamp(["make", "demo"], clone, env, started)
    total = time.time() - started
    result = {"demo_args": args.demo_args, "stages_s": stages, "total_s": round(total, 1)}
    result["first_iteration_s"] = first_iteration(clone / "runs" / "demo", started)
    summary = json.loads((clone / "runs" / "demo" / "summary.json").read_text())
    for key in ("heldout_acc_before", "heldout_acc_after", "reward_first", "reward_last"):
        result[key] = summary.get(key)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


def run_and_stamp(command: list[str], cwd: Path, env: dict, started: float) -> dict[str, float]:
    """Run ``command``; pass its output through, stamping stage headings. Returns when each
    heading was seen, in seconds since ``started``."""
    stages: dict[str, float] = {}
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        found = HEADING.match(line)
        if found:
            elapsed = time.time() - started
            stages.setdefault(found.group(1) + " " + found.group(2)[:40], round(elapsed, 1))
            line = f"[{elapsed:6.1f} s] {line}"
        sys.stderr.write(line)
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit code {proc.returncode}")
    return stages


def first_iteration(output_dir: Path, started: float) -> float:
    """Seconds from ``started`` to the first span of the run's trace (the first RL iteration's
    first sample being generated)."""
    trace = json.loads((output_dir / "trace.json").read_text())
    return round(min(span["start_s"] for span in trace["spans"]) - started, 1)


if __name__ == "__main__":
    main()
