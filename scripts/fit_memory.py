"""Peak memory of a whole `streamrl fit` run, measured from outside, today's code beside another's.

Runs `streamrl fit --config CONFIG` once per code tree, one after the other (never side by side:
two runs on the same cores void each other's figures), and polls /proc every `--interval`
seconds for every process of the run's tree: each process's own peak (`VmHWM`), named by its role
(trainer rank 0 is the `fit` process; the other ranks, generator instances and reward workers are
found by the pids the run writes to its output directory), and the peak of the tree's summed
resident memory (`VmRSS`). A run whose tree passes `--kill-above-gib` is killed and reported as
such, with what it held then: a lower bound on what it needed (the machine has to stay usable).

`--baseline REV` runs the code of git revision REV (a worktree, put first on `PYTHONPATH`)
before the working tree's, with the same config and the same environment. The last stdout line
is one JSON object; stderr has the table.

    python scripts/fit_memory.py --config configs/qwen0.5b-cpu.yaml --baseline d284e03
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baseline_tree import worktree

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the streamrl fit config to run")
    parser.add_argument("--baseline", help="a git revision to run first, from a worktree")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between polls")
    parser.add_argument("--kill-above-gib", type=float, default=21.0)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument(
        "--keep", action="store_true", help="keep each run's output directory (several GB each)"
    )
    parser.add_argument(
        "--baseline-unset",
        action="append",
        default=[],
        metavar="SECTION.KEY",
        help="a config key the baseline's code does not know, left out of its copy",
    )
    parser.add_argument("fit_args", nargs="*", help="more `streamrl fit` options (after --)")
    args = parser.parse_args()
    trees = []
    if args.baseline:
        config = _copy(Path(args.config), args.baseline_unset)
        trees.append((f"baseline {args.baseline}", worktree(args.baseline), config))
    trees.append(("this tree", ROOT, _copy(Path(args.config), [])))
    results = []
    for label, tree, config in trees:
        print(f"[fit_memory] {label}: streamrl fit --config {config}", file=sys.stderr)
        results.append({"code": label, **_measure(tree, config, args)})
        _print_row(results[-1])
    report = {"config": args.config, "runs": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


def _copy(config: Path, keys: list[str]) -> Path:
    """A copy of ``config`` without ``keys`` (``section.key``), its model directory made
    absolute (each run starts in its own code tree)."""
    import yaml

    values = yaml.safe_load(config.read_text())
    if Path(values.get("model", "tiny")).is_dir():
        values["model"] = str(Path(values["model"]).resolve())
    for key in keys:
        section, _, name = key.rpartition(".")
        (values.get(section, {}) if section else values).pop(name, None)
    copy = Path(tempfile.mkdtemp(prefix="fit-memory-config-")) / config.name
    copy.write_text(yaml.safe_dump(values))
    return copy


def _measure(tree: Path, config: Path, args: argparse.Namespace) -> dict:
    output_dir = Path(tempfile.mkdtemp(prefix="fit-memory-"))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [
        sys.executable,
        "-m",
        "streamrl.cli.main",
        "fit",
        "--config",
        str(config),
        "--output_dir",
        str(output_dir),
        "--no-progress",
        *args.fit_args,
    ]
    started = time.monotonic()
    run = subprocess.Popen(
        command,
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    peaks: dict[int, int] = {}  # pid -> its VmHWM, last seen
    names: dict[int, str] = {}
    tree_peak, killed_at = 0, None
    try:
        while run.poll() is None:
            total = 0
            for pid in _descendants(run.pid):
                status = _status(pid)
                if status is None:
                    continue
                peaks[pid] = max(peaks.get(pid, 0), status.get("VmHWM", 0))
                names.setdefault(pid, _cmdline(pid))
                total += status.get("VmRSS", 0)
            tree_peak = max(tree_peak, total)
            if total > args.kill_above_gib * GIB and killed_at is None:
                killed_at = total
                os.killpg(run.pid, signal.SIGKILL)
            if time.monotonic() - started > args.timeout_s:
                os.killpg(run.pid, signal.SIGKILL)
                break
            time.sleep(args.interval)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    roles = _roles(run.pid, output_dir, peaks)
    if not args.keep:  # checkpoints and the saved policy: GBs per run, read by no one here
        shutil.rmtree(output_dir, ignore_errors=True)
    result = {
        "wall_s": round(time.monotonic() - started, 1),
        "returncode": run.returncode,
        "tree_peak_rss_bytes": tree_peak,
        "process_peak_bytes": {role: peaks[pid] for role, pid in roles.items()},
        "killed_above_bytes": killed_at,
        "output_dir": str(output_dir) if args.keep else None,
    }
    lines = out.strip().splitlines()
    if run.returncode == 0 and lines:
        summary = json.loads(lines[-1])
        result["summary"] = {
            key: summary.get(key)
            for key in (
                "heldout_acc_before",
                "heldout_acc_after",
                "heldout_reward_before",
                "heldout_reward_after",
                "eval_wall_s",
                "samples_trained",
                "samples_lost",
                "wall_s",
                "trainer",
            )
        }
    else:
        result["stderr_tail"] = err[-2000:]
    return result


def _roles(root: int, output_dir: Path, peaks: dict[int, int]) -> dict[str, int]:
    """Each measured process by its role in the run (the pids its status files name)."""
    roles = {"trainer rank 0": root}
    ranks = output_dir / "trainer_ranks.json"
    if ranks.is_file():
        for rank, pid in json.loads(ranks.read_text()).items():
            roles[f"trainer rank {rank}"] = int(pid)
    for name, role in (("instances.json", "generator"), ("reward_workers.json", "reward worker")):
        path = output_dir / name
        if path.is_file():
            entries = json.loads(path.read_text())
            for key, entry in entries.items() if isinstance(entries, dict) else enumerate(entries):
                pid = entry.get("pid") if isinstance(entry, dict) else entry
                if pid:
                    roles[f"{role} {key}"] = int(pid)
    known = set(roles.values())
    for pid in peaks:
        if pid not in known:
            roles[f"other {pid}"] = pid
    return {role: pid for role, pid in roles.items() if pid in peaks}


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        status = _status(int(entry.name), ("PPid",))
        if status is not None:
            children.setdefault(status["PPid"], []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _status(pid: int, keys: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            number = int(rest.split()[0])
            values[name] = number if name == "PPid" else number * 1024  # kB
    return values


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return ""


def _print_row(result: dict) -> None:
    print(f"  {result['code']}: exit {result['returncode']}, {result['wall_s']} s", file=sys.stderr)
    print(f"    tree peak RSS {result['tree_peak_rss_bytes'] / GIB:.2f} GiB", file=sys.stderr)
    if result["killed_above_bytes"]:
        print(f"    killed at {result['killed_above_bytes'] / GIB:.2f} GiB", file=sys.stderr)
    for role, peak in result["process_peak_bytes"].items():
        print(f"    {role:<22} peak {peak / GIB:6.2f} GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
