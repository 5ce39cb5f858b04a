"""Chaos: a small ``streamrl fit`` under a schedule of faults, resumed until it completes, checked
against the same run left alone.

The schedule is driven by the run's progress (its ``rollouts/iteration-*.parquet`` files), not by
wall time: fault ``j`` strikes once the run (as started last) has finished iteration ``2 + 3j``.
Faults: ``kill-generator`` (kill -9 a generator instance: replaced, the run goes on),
``stop-generator`` (SIGSTOP one: taken as hung after ``rl.timeouts``' ``heartbeat_s``, replaced),
``kill-reward-worker`` (kill -9 reward worker 0: replaced, what it held scored again, the run
goes on), ``kill-env-worker`` (an ``--episodes`` run, its environments in a worker process:
kill -9 env worker 0; replaced, its episodes started again from their prompts, the run goes
on), ``kill-trainer-rank`` (kill -9 rank 1 of ``--ranks 2``: the run stops), ``sigterm-group``
(SIGTERM to the run's process group: the run stops with a checkpoint). A run that stops is
started again with ``--resume auto``.

At the end it prints ONE JSON line on stdout (progress goes to stderr): each fault and its
outcome, the final run's ledger, and whether the chaos run trained exactly the (prompt, sample)
pairs the uninterrupted run trained, each once and in the same iteration.

    python scripts/chaos.py --mode sync
    python scripts/chaos.py --mode async
    python scripts/chaos.py --episodes
    python scripts/chaos.py --ranks 2
    python scripts/chaos.py --faults kill-generator,sigterm-group   # the quickest
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import yaml

FAULTS = (
    "kill-generator",
    "stop-generator",
    "kill-reward-worker",
    "kill-env-worker",
    "kill-trainer-rank",
    "sigterm-group",
)
#: The ledger's keys the JSON line keeps from the final run's summary.
LEDGER_KEYS = (
    "prompts_dispatched",
    "samples_requested",
    "samples_generated",
    "turns",
    "samples_trained",
    "samples_filtered",
    "samples_requeued",
    "samples_discarded_late",
    "samples_lost",
    "samples_reward_fault",
    "instances_restarted",
    "reward_workers_restarted",
    "generators_final",
)
PROMPTS, GROUP = 4, 4  # per iteration
RUN_TIMEOUT_S = 600.0  # the most one start of a run may take
REPLACE_TIMEOUT_S = 120.0  # the most a failed generator's replacement may take to be active
FIRST_AT = 2  # the first fault strikes after this many iterations
ITERATIONS_PER_FAULT = 25
GAP = 3  # the next fault strikes this many iterations after the last one settled


def log(message: str) -> None:
    print(f"chaos: {message}", file=sys.stderr, flush=True)


def run_config(out: Path, mode: str, episodes: bool, ranks: int, iterations: int) -> dict:
    """The small run both the uninterrupted and the chaos run train (the same seed)."""
    rl = {
        "module": {"mode": mode},
        "iterations": iterations,
        "prompts_per_iteration": PROMPTS,
        "group_size": GROUP,
        "generation": {"num_instances": 1 if ranks > 1 else 2, "max_batch_size": 8},
        "rollouts": {"max_tokens": 24 if episodes else 12},
        "checkpoints": {"every": 1},
        "save_rollouts": True,
        "timeouts": {"heartbeat_s": 10},  # a SIGSTOPped generator is taken as hung after 10 s
    }
    rows = 2 * iterations * PROMPTS  # no prompt is dealt twice: a pair trained twice is a bug
    config: dict = {"output_dir": str(out), "seed": 0, "rl": rl}
    if episodes:
        config["env"] = {"name": "calculator", "max_turns": 3, "n_train": rows, "n_heldout": 4}
        config["env"]["workers"] = 1  # in a process (a built-in runs on threads by default)
        config["sft"] = {"model_size": "test", "steps": 10, "tokens_per_batch": 1024}
        rl["reward_pool"] = {"workers": 0}  # an episode's reward is its environment's
    else:
        config["data"] = {"tasks": ["copy"], "n_train": rows, "n_heldout": 4, "median_len": 3}
        config["data"]["max_len"] = 6
        config["sft"] = {"model_size": "test", "steps": 2}
        rl["reward_pool"] = {"workers": 1}
    if ranks > 1:
        config["trainer"] = {"devices": ranks}
    return config


@dataclass
class Run:
    """One start of ``streamrl fit --resume auto`` in a process group of its own."""

    config: Path
    out: Path
    logs: Path
    started: float = field(default_factory=time.time)
    proc: subprocess.Popen | None = None
    starts: int = 0

    def start(self) -> None:
        """Start it (again): ``--resume auto`` goes on from the last checkpoint, if any."""
        n, self.starts, self.started = self.starts, self.starts + 1, time.time()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(self.config)]
        self.stdout_path = self.logs / f"start{n}.out"
        self.stderr_path = self.logs / f"start{n}.err"
        self.proc = subprocess.Popen(
            [*command, "--no-progress", "--resume", "auto"],
            stdout=self.stdout_path.open("w"),
            stderr=self.stderr_path.open("w"),
            env=env,
            start_new_session=True,  # its own process group, as under a scheduler
        )

    def finished_iterations(self) -> int:
        """Iterations this start has finished (its rollout files; a resume redoes some)."""
        written = [
            int(f.stem.split("-")[1])
            for f in (self.out / "rollouts").glob("iteration-*.parquet")
            if f.stat().st_mtime >= self.started
        ]
        return max(written) + 1 if written else 0

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop_line(self) -> str:
        """Its last ``streamrl fit:`` line, without the command to go on."""
        lines = [ln for ln in self.stderr_path.read_text().splitlines() if "streamrl fit:" in ln]
        return lines[-1].split("; the last checkpoint")[0][:200] if lines else "(no message)"

    def summary(self) -> dict:
        lines = self.stdout_path.read_text().splitlines()
        return json.loads([ln for ln in lines if ln.startswith("{")][-1])

    def group_gone(self, timeout_s: float = 30.0) -> bool:
        """Whether every process of the group has left (the rest is killed if not)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        self.kill()
        return False

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):  # gone already
                os.killpg(self.proc.pid, signal.SIGKILL)


def read_json(path: Path, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not written within {timeout_s:.0f}s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def active_generator(out: Path) -> tuple[str, int]:
    """(instance id, pid) of the first active generator instance."""
    for iid, info in read_json(out / "instances.json").items():
        if info["state"] == "active" and info["alive"]:
            return iid, info["pid"]
    raise RuntimeError("no active generator instance to strike")


def await_replacement(run: Run, iid: str) -> str:
    """``"replaced"`` once instance ``iid`` failed and as many instances are active as before."""
    before = sum(i["state"] == "active" for i in read_json(run.out / "instances.json").values())
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    while time.monotonic() < deadline:
        if run.proc.poll() == 0:
            return "the run completed before a replacement was active"
        if run.proc.poll() is not None:
            return f"stopped rc={run.proc.returncode}: {run.stop_line()}"
        status = read_json(run.out / "instances.json")
        active = sum(i["state"] == "active" for i in status.values())
        if status[iid]["state"] == "failed" and active >= before:
            return "replaced"
        time.sleep(0.2)
    return f"not replaced within {REPLACE_TIMEOUT_S:.0f}s"


def await_new_pid(run: Run, status: str, killed: int) -> str:
    """``"replaced"`` once worker 0 of ``status`` (a slot -> pid file) runs in a process other
    than ``killed``."""
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            return f"stopped rc={run.proc.returncode}: {run.stop_line()}"
        if read_json(run.out / status)["0"] != killed:
            return "replaced"
        time.sleep(0.2)
    return f"not replaced within {REPLACE_TIMEOUT_S:.0f}s"


def strike(run: Run, fault: str) -> tuple[str, str]:
    """Apply ``fault`` to the running ``run``: (what was done, its outcome)."""
    if fault in ("kill-generator", "stop-generator"):
        iid, pid = active_generator(run.out)
        sig = signal.SIGKILL if fault == "kill-generator" else signal.SIGSTOP
        os.kill(pid, sig)
        what = f"{'kill -9' if sig == signal.SIGKILL else 'SIGSTOP'} generator {iid} (pid {pid})"
        return what, await_replacement(run, iid)
    if fault in ("kill-reward-worker", "kill-env-worker"):
        kind = fault.split("-")[1]
        pid = read_json(run.out / f"{kind}_workers.json")["0"]
        os.kill(pid, signal.SIGKILL)
        return f"kill -9 {kind} worker 0 (pid {pid})", await_new_pid(
            run, f"{kind}_workers.json", pid
        )
    if fault == "kill-trainer-rank":
        pid = read_json(run.out / "trainer_ranks.json")["1"]
        what = f"kill -9 trainer rank 1 (pid {pid})"
        os.kill(pid, signal.SIGKILL)
    else:
        what = f"SIGTERM process group {run.proc.pid}"
        os.killpg(run.proc.pid, signal.SIGTERM)
    try:
        rc = run.wait(timeout_s=180)
    except subprocess.TimeoutExpired:
        run.kill()
        return what, "did not stop within 180s (killed)"
    outcome = f"stopped rc={rc}: {run.stop_line()}"
    if not run.group_gone():
        outcome += "; processes of the run outlived it (killed)"
    return what, outcome


def skipped(fault: str, episodes: bool, ranks: int) -> str | None:
    """Why ``fault`` does not apply to this run, or ``None``."""
    if fault == "kill-env-worker" and not episodes:
        return "skipped: a run of single completions has no environment (--episodes has)"
    if fault == "kill-reward-worker" and episodes:
        return "skipped: an episode run has no reward worker (its environment rewards)"
    if fault == "kill-trainer-rank" and ranks < 2:
        return "skipped: one trainer rank (--ranks 2 kills rank 1)"
    return None


def wait_for(run: Run, at: int, done: list[dict]) -> int | None:
    """Wait until the run has finished iteration ``at`` (iterations finished), or completed
    (``None``); a start that stops on its own is recorded and resumed."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (reached := run.finished_iterations()) < at:
        if run.proc.poll() == 0:
            return None
        if run.proc.poll() is not None:  # not one of ours: resume it too, and say so
            outcome = f"stopped rc={run.proc.returncode}: {run.stop_line()}"
            done.append({"what": "(none)", "at_iteration": None, "outcome": outcome})
            run.start()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not reach iteration {at} in {RUN_TIMEOUT_S:.0f}s")
        time.sleep(0.05)
    return reached


def chaos(run: Run, faults: list[str], episodes: bool, ranks: int) -> list[dict]:
    """Start the run, strike on schedule, resume after each stop, until it completes."""
    why = {fault: skipped(fault, episodes, ranks) for fault in faults}
    done = [{"what": f, "at_iteration": None, "outcome": why[f]} for f in faults if why[f]]
    run.start()
    at = FIRST_AT
    for fault in [f for f in faults if not why[f]]:
        reached = wait_for(run, at, done)
        if reached is None:
            outcome = "not applied: the run had completed"
            done.append({"what": fault, "at_iteration": None, "outcome": outcome})
            continue
        what, outcome = strike(run, fault)
        log(f"{what} after iteration {reached}: {outcome}")
        done.append({"what": what, "at_iteration": reached, "outcome": outcome})
        at = max(reached, run.finished_iterations()) + GAP  # once the run went on after it
        if run.proc.poll() not in (None, 0):
            run.start()
    while wait_for(run, 10**9, done) is not None:  # to the end
        pass
    return done


def trained(out: Path) -> list[tuple[int, str, int]]:
    """(iteration, prompt id, sample index) of every row of a run's rollout files."""
    rows = []
    for f in sorted((out / "rollouts").glob("iteration-*.parquet")):
        table = pq.read_table(f, columns=["iteration", "prompt_id", "sample_index"]).to_pylist()
        rows += [(r["iteration"], r["prompt_id"], r["sample_index"]) for r in table]
    return rows


def compare(chaos_rows: list, clean_rows: list) -> dict:
    """The chaos run's trained pairs against the uninterrupted run's."""
    pairs, clean = (
        Counter((p, s) for _, p, s in chaos_rows),
        Counter((p, s) for _, p, s in clean_rows),
    )
    return {
        "pairs_trained": sum(pairs.values()),
        "pairs_equal_uninterrupted": pairs == clean,
        "same_iteration_each": sorted(chaos_rows) == sorted(clean_rows),
        "pairs_trained_twice": sum(1 for n in pairs.values() if n > 1),
        "pairs_missing": sum(1 for pair in clean if pair not in pairs),
        "pairs_extra": sum(1 for pair in pairs if pair not in clean),
        "differences": differences(chaos_rows, clean_rows),
    }


def differences(chaos_rows: list, clean_rows: list, most: int = 8) -> list[dict]:
    """The first ``most`` pairs trained in other iterations (or other times) than in the
    uninterrupted run: what a failed comparison needs to be explained."""
    where: dict[tuple, dict[str, list[int]]] = {}
    for run, rows in (("chaos", chaos_rows), ("uninterrupted", clean_rows)):
        for iteration, prompt, sample in rows:
            entry = where.setdefault((prompt, sample), {"chaos": [], "uninterrupted": []})
            entry[run].append(iteration)
    odd = [
        {"prompt_id": p, "sample_index": s, **{k: sorted(v) for k, v in its.items()}}
        for (p, s), its in sorted(where.items(), key=lambda kv: str(kv[0]))
        if sorted(its["chaos"]) != sorted(its["uninterrupted"])
    ]
    return odd[:most]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["sync", "async"], default="sync")
    parser.add_argument("--episodes", action="store_true", help="an episode run (calculator)")
    parser.add_argument("--ranks", type=int, choices=[1, 2], default=1, help="trainer ranks")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    parser.add_argument("--iterations", type=int, help="default: 25 per fault, plus 10")
    parser.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    args = parser.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(args.faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="streamrl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    applied = [f for f in args.faults if not skipped(f, args.episodes, args.ranks)]
    # A replacement takes seconds, tens of these small iterations: room for each fault to settle
    iterations = args.iterations or ITERATIONS_PER_FAULT * len(applied) + 10
    runs = {}
    for name in ("uninterrupted", "chaos"):
        config = run_config(work / name, args.mode, args.episodes, args.ranks, iterations)
        (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
        (work / f"{name}-logs").mkdir(exist_ok=True)
        runs[name] = Run(work / f"{name}.yaml", work / name, work / f"{name}-logs")
    log(f"working in {work}; {iterations} iterations; the uninterrupted run first")
    current = runs["uninterrupted"]
    try:
        current.start()
        if current.wait() != 0:
            raise RuntimeError(f"the uninterrupted run failed: {current.stop_line()}")
        current = runs["chaos"]
        faults = chaos(current, args.faults, args.episodes, args.ranks)
    except BaseException:
        current.kill()
        raise
    summary = current.summary()
    result = {
        "mode": args.mode,
        "episodes": args.episodes,
        "ranks": args.ranks,
        "faults": faults,
        "resumes": current.starts - 1,
        "ledger": {k: summary[k] for k in LEDGER_KEYS if k in summary},
        "episodes_restarted": summary.get("episode_counts", {}).get("episodes_restarted", 0),
        # every count the whole run's, each once (checkpointed; StreamLedger)
        "ledger_of": "the whole run",
        "samples_expected": iterations * PROMPTS * GROUP,
        **compare(trained(current.out), trained(runs["uninterrupted"].out)),
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # the run's process group is killed on the way


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
