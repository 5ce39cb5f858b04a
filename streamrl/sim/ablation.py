"""The paper's Table 3 ablation, simulated: colocated -> +skew-aware -> +disaggregation and
streaming (sync) -> +one-step async, each row normalised to the colocated baseline (§7.3)."""

from __future__ import annotations

from streamrl.sim.engine import SimResult, simulate
from streamrl.sim.presets import paper_config

ROWS = ("colocated", "skew", "stream", "async")
LABELS = {
    "colocated": "(1) colocation baseline",
    "skew": "(2) (1) + skewness-aware dispatch + LPT",
    "stream": "(3) (2) + disaggregation + streaming (sync)",
    "async": "(4) (3) + one-step asynchronous",
}


def run_ablation(preset: str, iterations: int = 3, seed: int = 0) -> dict[str, SimResult]:
    """Simulate the four rows of Table 3 on ``preset`` (a ``paper-*`` name)."""
    configs = {
        "colocated": paper_config(
            preset, "colocated", skew=False, iterations=iterations, seed=seed
        ),
        "skew": paper_config(preset, "colocated", iterations=iterations, seed=seed),
        "stream": paper_config(preset, "sync", iterations=iterations, seed=seed),
        "async": paper_config(preset, "async", iterations=iterations, seed=seed),
    }
    results = {row: simulate(config) for row, config in configs.items()}
    for row, config in configs.items():
        results[row].per_iteration.append({"labels": config.labels})
    return results


def ablation_summary(results: dict[str, SimResult]) -> dict:
    """Normalised throughput, samples/s, idle fractions and cost per sample of each row."""
    base = results["colocated"].samples_per_s
    return {
        "ablation": {row: round(r.samples_per_s / base, 3) for row, r in results.items()},
        "samples_per_s": {row: round(r.samples_per_s, 4) for row, r in results.items()},
        "idle_frac": {
            row: {
                "trainer": round(r.trainer_idle_frac, 4),
                "generator": round(r.generator_idle_frac, 4),
            }
            for row, r in results.items()
        },
        "cost_per_sample": {row: round(r.cost_per_sample, 6) for row, r in results.items()},
        "iteration_s": {row: round(r.iteration_s, 2) for row, r in results.items()},
        "gen_s": {row: round(r.gen_s, 2) for row, r in results.items()},
        "train_s": {row: round(r.train_s, 2) for row, r in results.items()},
        "splits": {row: r.per_iteration[-1]["labels"] for row, r in results.items()},
    }
