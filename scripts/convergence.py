"""Learning experiments on the demo task: algorithms, and async vs sync convergence.

Runs ``streamrl fit`` on the demo config with settings overridden, one run after another (each
run uses both cores), collects every run's summary and reward curve, writes ``results.json`` and
a PNG of the reward curves. Async and sync train on the same number of samples (same iterations,
prompts and group size); only ``rl.module.mode`` differs.

    python scripts/convergence.py modes --seeds 0,1,2 --out runs/modes   # async vs sync
    python scripts/convergence.py partial --seeds 0,1,2 --out runs/partial  # partial vs sync
    python scripts/convergence.py algorithms --out runs/algorithms        # grpo, ppo, rloo

Runs of the asynchronous modes also get their off-policy metrics drawn
(``offpolicy-<experiment>.png``): the staleness histogram of the trained tokens and the
importance ratios of the stale ones, iteration by iteration.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

EXPERIMENTS = {
    "modes": lambda seed: [
        ("sync", {"module": {"mode": "sync"}}, seed),
        ("async", {"module": {"mode": "async"}}, seed),
    ],
    "algorithms": lambda seed: [(a, {"algorithm": a}, seed) for a in ("grpo", "ppo", "rloo")],
    # Partial rollout: running sequences go on under new weights (their old KV cache kept).
    "partial": lambda seed: [
        ("sync", {"module": {"mode": "sync"}}, seed),
        ("partial", {"module": {"mode": "async"}, "generation": {"partial_rollout": "keep"}}, seed),
    ],
}
#: Per-iteration off-policy metrics read from each run's metrics.csv.
OFF_POLICY = ("train/is_ratio_mean", "train/is_ratio_max", "train/is_truncated_frac")


def run(name: str, rl: dict, seed: int, out: Path) -> dict:
    """One ``streamrl fit`` with the demo config, ``rl`` overrides (a section's merged into
    it) and ``seed``."""
    config = yaml.safe_load(Path("configs/demo.yaml").read_text())
    for key, value in rl.items():
        given = config["rl"].get(key)
        config["rl"][key] = {**given, **value} if isinstance(given, dict) else value
    config["seed"] = seed
    run_dir = out / f"{name}-seed{seed}"
    config["output_dir"] = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [
        sys.executable,
        "-m",
        "streamrl.cli.main",
        "fit",
        "--config",
        str(run_dir / "config.yaml"),
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["rewards"] = _rewards(run_dir)
    summary["off_policy"] = _off_policy(run_dir)
    print(
        f"{name} seed {seed}: held-out {summary['heldout_acc_before']:.3f} -> "
        f"{summary['heldout_acc_after']:.3f}",
        file=sys.stderr,
    )
    return summary


def _rewards(run_dir: Path) -> list[float]:
    metrics = next((run_dir / "logs").rglob("metrics.csv"))
    with metrics.open() as f:
        return [float(r["rollout/reward"]) for r in csv.DictReader(f) if r.get("rollout/reward")]


def _off_policy(run_dir: Path) -> dict:
    """The run's staleness histogram (trained tokens by lag, summed over iterations) and the
    importance-ratio statistics of each iteration (empty where nothing was stale)."""
    metrics = next((run_dir / "logs").rglob("metrics.csv"))
    with metrics.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/reward")]
    lags: dict[int, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("train/tokens_lag_") and value:
                lag = int(key.rsplit("_", 1)[1])
                lags[lag] = lags.get(lag, 0.0) + float(value)
    series = {k: [float(r[k]) if r.get(k) else None for r in rows] for k in OFF_POLICY}
    return {"token_lags": {str(k): v for k, v in sorted(lags.items())}, **series}


def plot_off_policy(results: dict[str, list[dict]], path: Path, title: str) -> None:
    """Left: share of trained tokens at each staleness; right: importance ratios of stale
    tokens per iteration (mean, max, share truncated), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, ratios) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(results)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        totals: dict[int, float] = {}
        for r in results[name]:
            for lag, n in r["off_policy"]["token_lags"].items():
                totals[int(lag)] = totals.get(int(lag), 0.0) + n
        total = sum(totals.values()) or 1.0
        lags = sorted(totals)
        offset = (i - (len(names) - 1) / 2) * width  # the runs side by side around each lag
        shares = [totals[x] / total for x in lags]
        hist.bar([x + offset for x in lags], shares, width, label=name)
        for x, share in zip(lags, shares):
            hist.text(x + offset, share, f"{share:.0%}", ha="center", va="bottom", fontsize=7)
    hist.set_xticks(
        sorted(
            {
                int(lag)
                for r in results.values()
                for run in r
                for lag in run["off_policy"]["token_lags"]
            }
        )
    )
    hist.set_xlabel("staleness of a trained token (weight versions behind the trainer)")
    hist.set_ylabel("share of trained tokens")
    hist.legend(fontsize=8)
    styles = {"train/is_ratio_mean": "-", "train/is_ratio_max": "--"}
    for name in names:
        for r in results[name]:
            for key, style in styles.items():
                values = r["off_policy"][key]
                if any(v is not None for v in values):
                    ratios.plot(range(len(values)), values, style, linewidth=0.8, alpha=0.7)
    ratios.set_xlabel("iteration")
    ratios.set_ylabel("pi_prox / pi_behaviour (stale tokens)")
    ratios.set_title("mean (solid) and max (dashed), each run", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, runs in results.items():
        curves = [r["rewards"] for r in runs]
        n = min(map(len, curves))
        mean = _smooth([statistics.mean(c[i] for c in curves) for i in range(n)])
        acc = statistics.mean(r["heldout_acc_after"] for r in runs)
        line = ax.plot(
            range(n), mean, linewidth=2, label=f"{name} (held-out {acc:.1%}, {len(runs)} runs)"
        )[0]
        for c in curves:
            ax.plot(range(n), c[:n], alpha=0.2, linewidth=0.7, color=line.get_color())
    ax.set_xlabel("iteration (same samples per iteration in every run)")
    ax.set_ylabel("mean reward (5-iteration average)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default="runs/convergence")
    parser.add_argument("--replot", action="store_true", help="redraw from the saved JSON")
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        saved = json.loads((out / f"{args.experiment}.json").read_text())
        runs = {
            name: [
                {"rewards": c, "heldout_acc_after": a, "off_policy": o}
                for c, a, o in zip(v["rewards"], v["heldout_acc_after"], v["off_policy"])
            ]
            for name, v in saved.items()
        }
        title = f"demo task: {args.experiment}"
        plot(runs, out / f"convergence-{args.experiment}.png", title)
        plot_off_policy(runs, out / f"offpolicy-{args.experiment}.png", title)
        return 0
    results: dict[str, list[dict]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, rl, s in EXPERIMENTS[args.experiment](seed):
            results.setdefault(name, []).append(run(name, rl, s, out / "runs"))
    summary = {
        name: {
            "heldout_acc_before": [r["heldout_acc_before"] for r in runs],
            "heldout_acc_after": [r["heldout_acc_after"] for r in runs],
            "mean_after": statistics.mean(r["heldout_acc_after"] for r in runs),
            "samples_per_s": [round(r["samples_per_s"], 1) for r in runs],
            "rewards": [r["rewards"] for r in runs],
            "staleness_max": [r.get("staleness_max") for r in runs],
            "samples_lost": [r.get("samples_lost") for r in runs],
            "off_policy": [r["off_policy"] for r in runs],
        }
        for name, runs in results.items()
    }
    (out / f"{args.experiment}.json").write_text(json.dumps(summary, indent=2))
    plot(results, out / f"convergence-{args.experiment}.png", f"demo task: {args.experiment}")
    plot_off_policy(
        results, out / f"offpolicy-{args.experiment}.png", f"demo task: {args.experiment}"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
