"""``streamrl bench contention``: the warm start's SFT steps alone and beside a CPU-bound
neighbour, with today's thread setting (every core, fixed) beside the new one (the cores free
before each step, ``free_cores``), in one run.

OpenMP threads spin-wait for each other at every parallel region: with a neighbour on one of two
cores, a two-thread team waits for a descheduled thread at each region (the trainer measured
1.6-6x, a warm start 10x and more). The neighbour is what a user's machine has: a second warm
start with today's setting (another run, a notebook, a CI job). Each case is a fresh process
(its thread setting applies from its start); the neighbour is started before the case, runs
until the case ends and is then killed.

    python -m streamrl.bench.contention --case '{"setting": "free", "steps": 60}'

runs one case and prints one JSON line; ``bench_contention`` runs them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ContentionCase", "bench_contention"]

#: The settings compared: today's (``torch``'s own thread count, every core) and the new one.
SETTINGS = ("fixed", "free")
#: How long the neighbour runs before a case starts (its own start-up is over by then).
NEIGHBOUR_HEAD_START_S = 8.0


@dataclass(frozen=True)
class ContentionCase:
    """One case: the thread ``setting`` and the SFT ``steps`` timed (after 3 untimed ones)."""

    setting: str
    steps: int = 60
    model_size: str = "demo"


def bench_contention(steps: int = 60, repeats: int = 3, timeout_s: float = 900.0) -> dict:
    """Every setting alone and beside a neighbour, ``repeats`` times each (median steps/s).

    Returns:
        ``cases`` (each run), ``summary`` (per setting: alone and beside steps/s, and beside as
        a share of today's alone), and the machine's usable cores.
    """
    from streamrl.runtime.cores import usable_cores

    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for setting in SETTINGS:
            for beside in (False, True):
                case = ContentionCase(setting, steps)
                label = f"{setting} {'beside a neighbour' if beside else 'alone'} #{repeat + 1}"
                print(f"contention: {label} ...", file=sys.stderr, flush=True)
                result = _run_case(case, beside, timeout_s)
                print(
                    f"contention: {label}: {result['steps_per_s']:.2f} steps/s",
                    file=sys.stderr,
                    flush=True,
                )
                runs.append({**result, "beside": beside, "repeat": repeat})
    summary: dict[str, dict[str, float]] = {}
    for setting in SETTINGS:
        alone = [r["steps_per_s"] for r in runs if r["setting"] == setting and not r["beside"]]
        near = [r["steps_per_s"] for r in runs if r["setting"] == setting and r["beside"]]
        summary[setting] = {"alone": statistics.median(alone), "beside": statistics.median(near)}
    today = summary["fixed"]["alone"]
    for figures in summary.values():
        figures["beside_vs_today_alone"] = figures["beside"] / today
    return {"cases": runs, "summary": summary, "usable_cores": usable_cores(), "steps": steps}


def _run_case(case: ContentionCase, beside: bool, timeout_s: float) -> dict[str, Any]:
    neighbour = None
    if beside:  # today's warm start, long enough to outlast the case
        busy = ContentionCase("fixed", steps=1_000_000, model_size=case.model_size)
        neighbour = subprocess.Popen(_command(busy), stdout=subprocess.DEVNULL)
        time.sleep(NEIGHBOUR_HEAD_START_S)
    try:
        done = subprocess.run(
            _command(case), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait(30)
    if done.returncode != 0:
        raise RuntimeError(f"contention case {case} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _command(case: ContentionCase) -> list[str]:
    return [sys.executable, "-m", "streamrl.bench.contention", "--case", json.dumps(asdict(case))]


def measure_case(case: ContentionCase) -> dict[str, Any]:
    """This process runs ``case``: the demo warm start's SFT steps, timed after 3 untimed."""
    import torch

    from streamrl.policy.sft import SFTConfig, sft_train, warm_start_inputs

    config = SFTConfig(model_size=case.model_size, steps=case.steps + 3)
    tokenizer, model, demos = warm_start_inputs(config)
    threads = torch.get_num_threads() if case.setting == "fixed" else None
    stamps: list[float] = []
    import streamrl.policy.sft as sft

    encode = sft.encode_demos

    def stamped(*args: Any) -> Any:
        stamps.append(time.perf_counter())
        return encode(*args)

    sft.encode_demos = stamped
    sft_train(model, tokenizer, demos, config, show_progress=False, threads=threads)
    elapsed = time.perf_counter() - stamps[3]  # from the 4th step's start to the end
    return {
        "setting": case.setting,
        "steps": case.steps,
        "steps_per_s": round(case.steps / elapsed, 3),
        "threads_fixed": threads,
        "pid": os.getpid(),
    }


def _main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m streamrl.bench.contention", description="one case of bench contention"
    )
    parser.add_argument("--case", required=True, help="a ContentionCase as JSON")
    case = ContentionCase(**json.loads(parser.parse_args().case))
    if case.setting not in SETTINGS:
        raise SystemExit(f"setting must be one of {SETTINGS}, got {case.setting!r}")
    print(json.dumps(measure_case(case)), flush=True)


if __name__ == "__main__":
    _main()
