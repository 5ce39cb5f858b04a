"""Reproduce the simulator's paper tables and figures: ``python -m streamrl.sim.figures OUT``.

Prints JSON tables (simulated vs the paper's Table 3, Fig. 9, Fig. 10, Fig. 11 and Fig. 12) and
writes ``sim-*.png`` into ``OUT`` (docs/img). The validation against real runs on this machine is
``streamrl sim validate --figure OUT/sim-vs-real.png`` (``validation_figure``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from streamrl.components.capacity.allocator import ResourceAllocator
from streamrl.components.capacity.elastic import ElasticController
from streamrl.sim.ablation import ablation_summary, run_ablation
from streamrl.sim.dispatch import generation_makespan_s
from streamrl.sim.engine import simulate
from streamrl.sim.hardware import H800, QWEN25, decode_latency, kv_batch_limit, trainer_cost
from streamrl.sim.presets import (
    PAPER_PROMPT_TOKENS,
    paper_config,
    paper_lengths,
)


def _figure(width: float = 7.0, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def validation_figure(result: dict, path: str | Path) -> Path:
    """Bars of ``streamrl sim validate``'s result: real vs simulated samples/s per config, the
    new model's (context, processes sharing the cores) beside the context model alone and the
    old ``PTL(BS)`` one, those the result holds."""
    rows = result["rows"]
    fig = _figure(max(9.0, 0.8 * len(rows)), 4.0)  # the partial-rollout rows make 13
    ax = fig.add_subplot()
    x = np.arange(len(rows))
    labels = {  # each model the result holds, the new one first
        "": ("simulated, context model + shared cores", "#1f77b4"),
        "_unshared": ("context model alone", "#9ecae1"),
        "_ptl": ("PTL(BS), as before issue 47", "#ff7f0e"),
    }
    models = [(t, *labels[t]) for t in labels if f"calibration{t}" in result]
    width = 0.8 / (1 + len(models))
    offsets = [(i - len(models) / 2) * width for i in range(1 + len(models))]
    real = [r["real"] for r in rows.values()]
    ax.bar(x + offsets[0], real, width, label="real (measured now)", color="0.55")
    for (tail, label, color), offset in zip(models, offsets[1:]):
        sim = [r[f"sim{tail}"] for r in rows.values()]
        ax.bar(x + offset, sim, width, label=f"{label} (calibrated on *)", color=color)
        for i, r in enumerate(rows.values()):
            ax.annotate(
                f"{r[f'error{tail}']:+.0%}",
                (i + offset, r[f"sim{tail}"]),
                ha="center",
                xytext=(0, 2),
                textcoords="offset points",
                fontsize=6 if len(models) > 1 else 8,
                rotation=90 if len(models) > 2 else 0,
            )
    ticks = [f"{n}*" if r["fitted"] else n for n, r in rows.items()]
    ax.set_xticks(x, ticks, fontsize=8, rotation=20 if len(rows) > 7 else 0)
    ax.margins(y=0.15)  # room for the errors above the bars
    ax.set_ylabel("samples/s (bench pipeline)")
    fig.legend(fontsize=8, loc="outside lower center", ncols=min(1 + len(models), 2))
    ax.set_title("Simulator vs fresh real runs on this machine (streamrl sim validate)")
    fig.savefig(path)
    return Path(path)


def allocation(out: Path) -> dict:
    """Fig. 10: T_gen and T_train over the split, 32B on 64 and 72B on 128 GPUs (20K)."""
    lengths = paper_lengths(1024, 20000, seed=0)
    context = PAPER_PROMPT_TOKENS + 20000  # prompt + max output: see ``kv_batch_limit``
    fig, table = _figure(9, 3.4), {}
    for i, name in enumerate(("32b", "72b")):
        model = QWEN25[name]
        alloc = ResourceAllocator(
            decode_latency(model),
            trainer_cost(model),
            model.gen_tp,
            kv_batch_limit(model, H800, context),
        )
        unit, total = model.train_unit_gpus, model.total_gpus
        splits = [(total - y, y) for y in range(unit, total, unit)]
        plans = [alloc.evaluate(x, y, lengths, PAPER_PROMPT_TOKENS) for x, y in splits]
        best = alloc.plan(total, lengths, PAPER_PROMPT_TOKENS)
        even = alloc.evaluate(total // 2, total // 2, lengths, PAPER_PROMPT_TOKENS)
        norm = even.gen_s
        ax = fig.add_subplot(1, 2, i + 1)
        xs = [p.gen_gpus for p in plans]
        ax.plot(xs, [p.gen_s / norm for p in plans], "o-", label="T_gen")
        ax.plot(xs, [p.train_s / norm for p in plans], "s-", label="T_train")
        ax.axvline(best.gen_gpus, color="0.3", ls="--", lw=0.8)
        ax.set_title(f"{model.name}, {total} H800 (plan {best.gen_gpus}/{best.train_gpus})")
        ax.set_xlabel("generator GPUs (rest: trainer)")
        ax.set_ylabel("time / even-split T_gen")
        ax.legend(fontsize=8)
        table[name] = {
            "plan": [best.gen_gpus, best.train_gpus],
            "even": {"gen": 1.0, "train": round(even.train_s / norm, 3)},
            "ours": {"gen": round(best.gen_s / norm, 3), "train": round(best.train_s / norm, 3)},
            "speedup_async": round(max(even.gen_s, even.train_s) / best.iteration_s, 3),
        }
    fig.savefig(out / "sim-allocation.png")
    return table


def dispatch_gains() -> dict:
    """Fig. 9: generation makespan, random vs skew (noisy ranker) vs oracle, 20K lengths."""
    lengths = paper_lengths(1024, 20000, seed=0)
    earlier = paper_lengths(1024, 20000, seed=1)  # the previous iteration: skew's P50/P90
    pred = (np.asarray(lengths) * np.random.default_rng(1).lognormal(0, 0.25, 1024)).tolist()
    table = {}
    for name in ("7b", "32b", "72b"):
        config = paper_config(f"paper-{name}-20k", "async")
        gen = config.generators
        spans = {
            p: generation_makespan_s(
                p, lengths, pred, gen.instances, gen.latency, gen.max_batch_size, recent=earlier
            )
            for p in ("random", "skew", "oracle")
        }
        table[name] = {p: round(v / spans["random"], 3) for p, v in spans.items()}
        table[name]["instances"] = gen.instances
    return table


def elastic(out: Path) -> dict:
    """Fig. 11: 7B, 10K lengths growing linearly toward 20K, one node (8 instances) per step."""
    config = paper_config(
        "paper-7b-10k", "async", gen_gpus=16, train_gpus=16, iterations=24, growth=0.04
    )
    config.warmup = 0
    config.elastic = ElasticController(
        config.generators.latency, config.generators.max_batch_size, step=8
    )
    result = simulate(config)
    its = result.per_iteration
    fig = _figure(8, 3.4)
    ax = fig.add_subplot()
    ax.bar([it["iteration"] for it in its], [it["delta_s"] for it in its], color="#1f77b4")
    ax.set_xlabel("iteration")
    ax.set_ylabel("delta = T_gen - T_train (s)")
    twin = ax.twinx()
    twin.step(
        [it["iteration"] for it in its], [it["instances"] + 16 for it in its], "r-", where="mid"
    )
    twin.set_ylabel("total GPUs", color="r")
    ax.set_title("Elastic generation, simulated (paper-7b-10k, lengths +4%/iteration)")
    fig.savefig(out / "sim-elastic.png")
    rows = [
        {
            "iteration": it["iteration"],
            "delta_s": round(it["delta_s"], 1),
            "delta_prime_s": round(it["delta_prime_s"], 1),
            "action": it["action"],
            "gpus": it["instances"] + 16,
        }
        for it in its
    ]
    return {"steps": rows}


def cross_dc() -> dict:
    """Fig. 12: 32 H20 (generation) + 16 H800 (training) across 80 Gbps vs 32 H800, 7B."""
    table = {}
    for size in ("5k", "10k", "20k"):
        name = f"paper-7b-{size}"
        single = simulate(paper_config(name, "async"))
        cross = simulate(paper_config(name, "async", 32, 16, gen_gpu="h20", cross_dc=True))
        table[size] = {
            "single_samples_per_s": round(single.samples_per_s, 3),
            "cross_samples_per_s": round(cross.samples_per_s, 3),
            "throughput_per_cost_ratio": round(single.cost_per_sample / cross.cost_per_sample, 3),
        }
    return table


def main(out: str) -> dict:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tables = {
        "ablation": {
            p: ablation_summary(run_ablation(p))["ablation"]
            for p in ("paper-7b-20k", "paper-32b-20k", "paper-72b-20k")
        },
        "allocation": allocation(path),
        "dispatch": dispatch_gains(),
        "elastic": elastic(path),
        "cross_dc": cross_dc(),
    }
    return tables


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "docs/img"), indent=1))
