"""streamrl vs TRL's GRPOTrainer: same tiny model, task, prompts, group size, lengths and 2 cores.

Every system starts from the warm-started demo policy and trains GRPO on the demo task mix for the
same number of steps (each step: ``--prompts`` prompts x ``--group`` samples, at most 64 new
tokens, temperature 0.7, constant lr 1e-4, no KL). Five systems, each run in a fresh process,
interleaved round by round (``--repeats`` rounds), medians reported:

- ``trl``: TRL's ``GRPOTrainer`` as a careful CPU user sets it: ``use_cpu=True``, ``bf16=False``
  and ``gradient_checkpointing=False`` (TRL defaults both to true; on a CPU they cost bf16
  autocast, recomputed forwards and, in transformers 5, the KV cache while generating), both
  cores for torch, colocated ``model.generate``;
- ``trl-cb``: the same with TRL's transformers continuous-batching generation
  (``use_transformers_continuous_batching=True``);
- ``streamrl-sync`` / ``streamrl-async`` / ``streamrl-async-keep``: ``streamrl fit`` defaults
  (2 generator processes streaming into a one-thread trainer, skew dispatch on), sync, the
  paper's one-step async (each sample from one weight version), and one-step async with partial
  rollout (``rl.generation.partial_rollout: keep``: running sequences go on across a weight update).

Two clocks, the same for all:

- the training call: ``trainer.train()`` for TRL; for streamrl the whole training call inside
  ``run_fit``, so process spawns, latency profiling, checkpoint writes, Lightning overhead and
  shutdown count;
- the whole job, as a user's stopwatch sees it: from the child's first import of the library to
  its end: load the policy, evaluate on the held-out set, train, evaluate again, save the
  trained policy (TRL: ``evaluate`` before and after, ``trainer.save_model``; streamrl:
  ``run_fit``, which does the same). The interpreter's own start-up, identical for all, is left
  out; ``process_wall_s`` (the parent's stopwatch on the child) includes it.

The faster TRL configuration is the baseline on each clock. The in-step rate (iterations' own
time) is reported beside them, labelled. Held-out greedy accuracy is measured the same way for
all, after training.

    pip install -e '.[peer]'
    python benchmarks/trl_compare.py --steps 20 --repeats 3 --out runs/peer
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("streamrl-sync", "streamrl-async", "streamrl-async-keep", "trl", "trl-cb")
#: Not in the default set: TRL with its own bf16 / gradient-checkpointing defaults, to check that
#: turning them off is what a CPU user should do (``--systems trl,trl-defaults``).
EXTRA_SYSTEMS = ("trl-defaults",)
RUN_TIMEOUT_S = 1800  # one run of 20 steps takes about a minute; a hang fails the benchmark


def run_trl(continuous_batching: bool, args, out: Path, cpu_settings: bool = True) -> dict:
    """TRL's GRPOTrainer on the demo policy and prompts; returns rate, curve and accuracy.

    ``cpu_settings=False`` keeps TRL's own ``bf16`` and ``gradient_checkpointing`` defaults."""
    job_started = time.perf_counter()
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from streamrl.eval.heldout import evaluate
    from streamrl.policy.models import load_policy
    from streamrl.run.config import RunConfig
    from streamrl.run.prepare import ensure_policy, prepare_run
    from streamrl.tasks import exact_match

    torch.set_num_threads(2)  # one process: both cores for generation and training
    config = RunConfig()
    run = prepare_run(config)
    policy, tokenizer = load_policy(ensure_policy(config, run))
    evaluate(policy.eval(), tokenizer, run.heldout)  # as run_fit does before training
    policy.train()

    def reward(completions, answer, **_):
        return [float(exact_match(c, a)) for c, a in zip(completions, answer)]

    class StepClock(TrainerCallback):
        """Step-end times on the same clock as the training call."""

        def __init__(self) -> None:
            self.started, self.times = 0.0, []

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)

    grpo = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=64,
        temperature=0.7,
        learning_rate=1e-4,
        lr_scheduler_type="constant",  # as ours; TRL's default decays linearly to 0
        beta=0.0,
        loss_type="grpo",
        max_steps=args.steps,
        use_cpu=True,
        **(dict(bf16=False, gradient_checkpointing=False) if cpu_settings else {}),
        use_transformers_continuous_batching=continuous_batching,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[reward],
        args=grpo,
        processing_class=tokenizer,
        train_dataset=run.train.select_columns(["prompt", "answer"]),
        callbacks=[clock],
    )
    clock.started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - clock.started
    accuracy = evaluate(policy.eval(), tokenizer, run.heldout).accuracy
    trainer.save_model(str(out / "trl" / "policy"))
    job_wall = time.perf_counter() - job_started
    samples = args.steps * args.prompts * args.group
    return {
        "samples_per_s": samples / wall,
        "samples_per_s_in_step": samples / clock.times[-1],
        "samples_per_s_job": samples / job_wall,
        "train_wall_s": wall,
        "job_wall_s": job_wall,
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "times": clock.times,
        "heldout_acc_after": accuracy,
    }


def run_streamrl(mode: str, args, out: Path) -> dict:
    """``streamrl fit`` defaults in ``mode`` (``async-keep``: async with partial rollout)."""
    job_started = time.perf_counter()
    from streamrl.run.config import RunConfig
    from streamrl.run.recipe import run_fit

    config = RunConfig(output_dir=str(out))
    config.rl.iterations = args.steps
    config.rl.module = {"mode": mode.removesuffix("-keep")}
    if mode == "async-keep":  # running sequences go on across a weight update
        config.rl.generation = {"partial_rollout": "keep"}
    config.rl.prompts_per_iteration, config.rl.group_size = args.prompts, args.group
    summary = run_fit(config, show_progress=False)
    job_wall = time.perf_counter() - job_started
    assert summary["samples_lost"] == 0, summary
    with next((out / "logs").rglob("metrics.csv")).open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/reward")]
    # Step-end times on the training call's clock: the start-up (spawns, profiling) is put before
    # the first iteration, which places our curve as late as it can honestly be.
    startup = summary["train_wall_s"] - summary["rl_wall_s"]
    times, elapsed = [], startup
    for row in rows:
        elapsed += float(row["time/iteration_s"])
        times.append(elapsed)
    samples = args.steps * args.prompts * args.group
    return {
        "samples_per_s": samples / summary["train_wall_s"],
        "samples_per_s_in_step": summary["samples_per_s"],
        "samples_per_s_job": samples / job_wall,
        "train_wall_s": summary["train_wall_s"],
        "job_wall_s": job_wall,
        "rewards": [float(r["rollout/reward"]) for r in rows],
        "times": times,
        "heldout_acc_after": summary["heldout_acc_after"],
    }


def run_one(system: str, args) -> dict:
    out = Path(args.out) / f"{system}-{args.round}"
    if system.startswith("streamrl-"):
        return run_streamrl(system.removeprefix("streamrl-"), args, out)
    return run_trl(system == "trl-cb", args, out, cpu_settings=system != "trl-defaults")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--out", default="runs/peer")
    parser.add_argument(
        "--one", choices=SYSTEMS + EXTRA_SYSTEMS, help=argparse.SUPPRESS
    )  # a child run
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS + EXTRA_SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = _prepare_policy()
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_ in range(args.repeats):  # interleaved: a slow spell of the machine hits all
        for system in systems:
            result = _child(system, round_, args)
            runs[system].append(result)
            print(
                f"round {round_ + 1}/{args.repeats} {system:15s} "
                f"{result['samples_per_s']:6.1f} samples/s (wall) "
                f"{result['train_wall_s']:6.1f} s",
                file=sys.stderr,
            )
    summary = _summarise(runs, before)
    _print_table(summary)
    _plot(runs, out / "peer-reward-vs-time.png")
    (out / "peer.json").write_text(json.dumps({**summary, "runs": runs}, indent=1))
    print(json.dumps(summary))
    return 0


def _prepare_policy() -> float:
    """Warm-start the demo policy once (cached), so no run pays for it; held-out accuracy."""
    from streamrl.eval.heldout import evaluate
    from streamrl.policy.models import load_policy
    from streamrl.run.config import RunConfig
    from streamrl.run.prepare import ensure_policy, prepare_run

    config = RunConfig()
    run = prepare_run(config)
    policy, tokenizer = load_policy(ensure_policy(config, run))
    return evaluate(policy.eval(), tokenizer, run.heldout).accuracy


def _child(system: str, round_: int, args) -> dict:
    command = [sys.executable, __file__, "--one", system, "--round", str(round_)]
    command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
    command += ["--group", str(args.group), "--out", args.out]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{system} round {round_} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "process_wall_s": time.perf_counter() - started}


def _summarise(runs: dict[str, list[dict]], before: float) -> dict:
    def median(system: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[system])

    trl = [s for s in runs if s.startswith("trl")]
    baseline = max(trl, key=lambda s: median(s, "samples_per_s")) if trl else None
    job_baseline = max(trl, key=lambda s: median(s, "samples_per_s_job")) if trl else None
    keys = ("samples_per_s", "samples_per_s_in_step", "samples_per_s_job", "train_wall_s")
    systems = {}
    for system in runs:
        row = {key: round(median(system, key), 3) for key in keys}
        row["job_wall_s"] = round(median(system, "job_wall_s"), 2)
        row["process_wall_s"] = round(median(system, "process_wall_s"), 2)
        row["heldout_acc_after"] = round(median(system, "heldout_acc_after"), 4)
        row["samples_per_s_runs"] = [round(r["samples_per_s"], 2) for r in runs[system]]
        if baseline:
            row["ratio_vs_baseline"] = round(
                median(system, "samples_per_s") / median(baseline, "samples_per_s"), 2
            )
            row["ratio_vs_baseline_job"] = round(
                median(system, "samples_per_s_job") / median(job_baseline, "samples_per_s_job"),
                2,
            )
        systems[system] = row
    return {
        "clock": "wall-clock of the training call, and of the whole job; medians of runs",
        "repeats": len(next(iter(runs.values()))),
        "baseline": baseline,
        "job_baseline": job_baseline,
        "heldout_acc_before": before,
        "systems": systems,
    }


def _print_table(summary: dict) -> None:
    print(
        f"\n{'system':20s} {'samples/s':>10s} {'ratio':>6s} {'job/s':>7s} {'ratio':>6s} "
        f"{'in-step/s':>10s} {'train s':>8s} {'job s':>7s} {'held-out':>9s}   "
        f"baseline: {summary['baseline']} (train), {summary['job_baseline']} (job)",
        file=sys.stderr,
    )
    for name, row in summary["systems"].items():
        print(
            f"{name:20s} {row['samples_per_s']:10.1f} {row.get('ratio_vs_baseline', 0):6.2f} "
            f"{row['samples_per_s_job']:7.1f} {row.get('ratio_vs_baseline_job', 0):6.2f} "
            f"{row['samples_per_s_in_step']:10.1f} {row['train_wall_s']:8.1f} "
            f"{row['job_wall_s']:7.1f} {row['heldout_acc_after']:9.3f}",
            file=sys.stderr,
        )


def _plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, results in runs.items():
        # The median run by wall-clock rate stands for its system.
        r = sorted(results, key=lambda r: r["samples_per_s"])[len(results) // 2]
        n = min(len(r["times"]), len(r["rewards"]))
        ax.plot(r["times"][:n], r["rewards"][:n], marker=".", label=name)
    ax.set_xlabel("wall-clock since the training call started (s)")
    ax.set_ylabel("mean reward per step")
    ax.set_title("GRPO on the demo task, 2 CPU cores: streamrl vs TRL GRPOTrainer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
