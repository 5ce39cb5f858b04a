"""streamrl vs TRL's GRPOTrainer: same tiny model, task, prompts, group size, lengths and 2 cores.

Both start from the warm-started demo policy and train GRPO on the demo task mix for the same
number of steps (each step: ``--prompts`` prompts x ``--group`` samples, at most 64 new tokens,
temperature 0.7, lr 1e-4, no KL). TRL runs as its docs recommend on a CPU: one process,
colocated generation with ``model.generate`` (``use_cpu=True``), both cores for torch. streamrl
runs its default: 2 generator processes streaming into a one-thread trainer (sync mode, skew
dispatch on) and, separately, one-step async mode.

Reported: samples/s (completions generated and trained per second of training wall-clock),
mean reward per step, reward against wall-clock (PNG) and greedy held-out accuracy after training
on the same 256 held-out prompts.

    pip install -e '.[peer]'
    python benchmarks/trl_compare.py --steps 20 --out runs/peer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from streamrl.config import RunConfig
from streamrl.evaluation import evaluate
from streamrl.jobs import run_fit
from streamrl.models import load_policy
from streamrl.prepare import ensure_policy, prepare_run
from streamrl.tasks import exact_match


def run_trl(model_dir: Path, train, heldout, args, out: Path) -> dict:
    """TRL's GRPOTrainer on the same policy and prompts; returns rewards, times and accuracy."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)  # one process: both cores for generation and training
    policy, tokenizer = load_policy(model_dir)

    def reward(completions, answer, **_):
        return [float(exact_match(c, a)) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.started, self.times = time.perf_counter(), []

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)

    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=64, temperature=0.7,
        learning_rate=1e-4, beta=0.0, loss_type="grpo", max_steps=args.steps, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", seed=0,
    )  # fmt: skip
    clock = Clock()
    trainer = GRPOTrainer(
        model=policy, reward_funcs=[reward], args=config, processing_class=tokenizer,
        train_dataset=train.select_columns(["prompt", "answer"]), callbacks=[clock],
    )  # fmt: skip
    clock.started = time.perf_counter()
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    wall = clock.times[-1]
    return {
        "samples_per_s": args.steps * args.prompts * args.group / wall,
        "wall_s": wall,
        "rewards": rewards,
        "times": clock.times,
        "heldout_acc_after": evaluate(policy.eval(), tokenizer, heldout).accuracy,
    }


def run_streamrl(mode: str, args, out: Path) -> dict:
    config = RunConfig(output_dir=str(out / f"streamrl-{mode}"))
    config.rl.iterations, config.rl.mode = args.steps, mode
    config.rl.prompts_per_iteration, config.rl.group_size = args.prompts, args.group
    summary = run_fit(config, show_progress=False)
    metrics = next((out / f"streamrl-{mode}" / "logs").rglob("metrics.csv"))
    import csv

    with metrics.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/reward")]
    times, total = [], 0.0
    for row in rows:
        total += float(row["time/iteration_s"])
        times.append(total)
    return {
        "samples_per_s": summary["samples_per_s"],
        "wall_s": summary["rl_wall_s"],
        "rewards": [float(r["rollout/reward"]) for r in rows],
        "times": times,
        "heldout_acc_after": summary["heldout_acc_after"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--out", default="runs/peer")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = RunConfig()
    run = prepare_run(config)  # the demo's prompt sets: same train and held-out prompts
    model_dir = ensure_policy(config, run)
    policy, tokenizer = load_policy(model_dir)
    before = evaluate(policy.eval(), tokenizer, run.heldout)
    results = {
        "streamrl-sync": run_streamrl("sync", args, out),
        "streamrl-async": run_streamrl("async", args, out),
        "trl": run_trl(model_dir, run.train, run.heldout, args, out),
    }
    for name, r in results.items():
        rate, after = r["samples_per_s"], r["heldout_acc_after"]
        print(f"{name:15s} {rate:7.1f} samples/s  held-out {before.accuracy:.3f} -> {after:.3f}",
              file=sys.stderr)  # fmt: skip
    _plot(results, out / "peer-reward-vs-time.png")
    summary = {
        "heldout_acc_before": before.accuracy,
        **{
            k: {m: v[m] for m in ("samples_per_s", "wall_s", "heldout_acc_after")}
            for k, v in results.items()
        },
        "samples_per_s_ratio_vs_trl": {
            k: round(v["samples_per_s"] / results["trl"]["samples_per_s"], 2)
            for k, v in results.items()
        },
    }
    (out / "peer.json").write_text(json.dumps({**summary, "curves": results}, indent=1))
    print(json.dumps(summary))
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, r in results.items():
        n = min(len(r["times"]), len(r["rewards"]))
        ax.plot(r["times"][:n], r["rewards"][:n], marker=".", label=name)
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("mean reward per step")
    ax.set_title("GRPO on the demo task, 2 CPU cores: streamrl vs TRL GRPOTrainer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
