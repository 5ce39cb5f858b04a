"""``streamrl simulate``, ``streamrl plan`` and ``streamrl sim validate``: each a dataclass of
options (the command line's, one option per field) and the function that runs it.

Each prints a table on stderr and returns a JSON-ready dict (``streamrl.cli.main.main`` prints it
as the last stdout line).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import yaml

from streamrl.components.capacity.allocator import ResourceAllocator
from streamrl.components.capacity.elastic import ElasticController
from streamrl.errors import ConfigError
from streamrl.runtime.references import add_search_dirs
from streamrl.sim.ablation import LABELS, ablation_summary, run_ablation
from streamrl.sim.config import SimConfig
from streamrl.sim.engine import SimResult, simulate
from streamrl.sim.hardware import GPUS, LINK_GBPS, SYNC_LATENCY_S, kv_batch_limit
from streamrl.sim.presets import (
    PAPER_PROMPT_TOKENS,
    _paper_workload,
    _parse,
    cpu_config,
    decode_latency,
    paper_config,
    trainer_cost,
)
from streamrl.sim.validate import PREDICTED

GpuName = Literal["h800", "h20"]  # ``streamrl.sim.hardware.GPUS``


@dataclass
class SimulateOptions:
    """Discrete-event simulation of a StreamRL run.

    Attributes:
        preset: paper-<7b|32b|72b>-<5k|10k|20k> or cpu (this machine's bench).
        mode: the four-row Table 3 ablation, or one mode.
        iterations: measured iterations (1 warm-up).
        staleness_bound: async: iterations generated ahead of the one training (default 1).
        partial_rollout: async: running samples at a weight update: finish first (finish), go
            on (keep) or re-prefill (recompute).
        gen_gpus: generator GPUs (default: Algorithm 1's plan).
        train_gpus: trainer GPUs (default: Algorithm 1's plan).
        gen_gpu: generator GPU type.
        cross_dc: weights cross the 80 Gbps link.
        no_skew: random dispatch + FIFO admission.
        dispatcher: as a run's rl.dispatcher: skew, round_robin, random or package.module:Name
            (default: the preset's).
        scheduler: as a run's rl.scheduler: lpt, fifo or package.module:Name (default: the
            preset's).
        run_config: a `streamrl fit` YAML: its rl.dispatcher and rl.scheduler, as that run
            would build them (its module:Name found beside it too); --dispatcher/--scheduler
            win.
        elastic: ElasticController adds a node of generator instances when needed.
        growth: output lengths grow by this fraction per iteration (elastic runs).
        trace: write the trace JSON here (draw it: streamrl timeline).
        seed: workload and simulation seed.
    """

    preset: str = "paper-72b-20k"
    mode: Literal["ablation", "colocated", "sync", "async"] = "ablation"
    iterations: int = 3
    staleness_bound: int | None = None
    partial_rollout: Literal["finish", "keep", "recompute"] = "finish"
    gen_gpus: int | None = None
    train_gpus: int | None = None
    gen_gpu: GpuName = "h800"
    cross_dc: bool = False
    no_skew: bool = False
    dispatcher: str | None = None
    scheduler: str | None = None
    run_config: str | None = None
    elastic: bool = False
    growth: float = 0.0
    trace: str | None = None
    seed: int = 0


@dataclass
class PlanOptions:
    """Split GPUs between generation and training (Algorithm 1).

    Attributes:
        workload: paper-<7b|32b|72b>-<5k|10k|20k>.
        budget: single datacenter: total GPUs.
        gen_budget: cross-datacenter: generation pool GPUs.
        train_budget: cross-datacenter: training pool GPUs.
        gen_gpu: generator GPU type.
        mode: the objective.
        seed: workload seed.
    """

    workload: str = "paper-72b-20k"
    budget: int | None = None
    gen_budget: int | None = None
    train_budget: int | None = None
    gen_gpu: GpuName = "h800"
    mode: Literal["async", "sync"] = "async"
    seed: int = 0


@dataclass
class ValidateOptions:
    """Calibrate the simulator on one real bench pipeline run, then run and simulate other
    configurations and report the errors.

    Attributes:
        configs: comma-separated predicted configurations (streamrl.sim.validate.PREDICTED).
        iterations: measured iterations per run.
        warmup: unmeasured iterations per run.
        repeats: real runs per configuration (median).
        quick: profile with fewer repeats and micro-batch shapes.
        figure: write a bar chart (PNG) of real vs simulated here.
        seed: prompts, weights and sampling.
    """

    configs: str = ",".join(PREDICTED)
    iterations: int = 6
    warmup: int = 1
    repeats: int = 3
    quick: bool = False
    figure: str | None = None
    seed: int = 0


def run_simulate(options: SimulateOptions) -> dict:
    """Run the ablation or one mode; print a table; return the results."""
    if options.iterations < 1:
        raise ConfigError(f"--iterations must be >= 1, got {options.iterations}.")
    variant = options.staleness_bound is not None or options.partial_rollout != "finish"
    if variant and options.mode == "ablation":
        raise ConfigError("--staleness-bound / --partial-rollout need one mode: --mode async.")
    choice = _dispatch_choice(options)
    if choice and options.mode == "ablation":
        raise ConfigError(
            "--dispatcher / --scheduler / --run_config choose one run's dispatch, but the ablation "
            "compares fixed ones: add --mode colocated, sync or async."
        )
    if options.preset == "cpu":
        return _simulate_cpu(options, choice)
    _parse(options.preset)  # fail early on a bad name
    if options.mode == "ablation":
        results = run_ablation(options.preset, options.iterations, options.seed)
        summary = ablation_summary(results)
        _print_ablation(options.preset, summary)
        if options.trace:
            results["async"].trace.to_json(options.trace)
            summary["trace"] = options.trace
        return summary
    config = paper_config(
        options.preset,
        options.mode,
        options.gen_gpus,
        options.train_gpus,
        options.gen_gpu,
        options.cross_dc,
        not options.no_skew,
        options.iterations,
        options.growth,
        options.seed,
    )
    if options.elastic:
        model, _ = _parse(options.preset)
        node = max(1, 8 // model.gen_tp)
        config.elastic = ElasticController(
            config.generators.latency, config.generators.max_batch_size, step=node
        )
    result = simulate(_variant(config, options, choice))
    return _single(options, config.labels, result)


def _variant(config: SimConfig, options: SimulateOptions, choice: dict) -> SimConfig:
    """``config`` with the staleness bound and partial-rollout policy of ``options`` and the
    dispatcher and admission scheduler of ``choice`` (``_dispatch_choice``)."""
    try:
        return replace(
            config,
            staleness_bound=options.staleness_bound,
            partial_rollout=options.partial_rollout,
            **choice,
        )
    except ValueError as err:
        raise ConfigError(f"simulate: {err}") from err


def _dispatch_choice(options: SimulateOptions) -> dict:
    """``SimConfig`` fields from ``--run_config`` (its ``rl.dispatcher``, ``rl.scheduler``), then
    ``--dispatcher`` / ``--scheduler``: the same values a run builds its parts from."""
    choice: dict = {}
    if options.run_config:
        path = Path(options.run_config)
        if not path.is_file():
            raise ConfigError(f"--run_config {options.run_config}: no such file.")
        rl = (yaml.safe_load(path.read_text()) or {}).get("rl") or {}
        choice = {
            field: rl[key]
            for field, key in (("dispatch", "dispatcher"), ("admission", "scheduler"))
            if key in rl
        }
        add_search_dirs([path.parent])  # its module:Name, as `streamrl fit --config` finds it
    if options.dispatcher:
        choice["dispatch"] = options.dispatcher
    if options.scheduler:
        choice["admission"] = options.scheduler
    return choice


def _simulate_cpu(options: SimulateOptions, choice: dict) -> dict:
    modes = ["colocated", "sync", "async"] if options.mode == "ablation" else [options.mode]
    iterations = max(options.iterations, 6)
    results = {
        m: simulate(_variant(cpu_config(m, iterations=iterations), options, choice)) for m in modes
    }
    # Stored inputs only: for a comparison with real runs use ``streamrl sim validate``.
    print(
        f"{'mode':<10}{'sim samples/s':>15}   (stored cpu profile; real: streamrl sim validate)",
        file=sys.stderr,
    )
    for m, r in results.items():
        print(f"{m:<10}{r.samples_per_s:>15.1f}", file=sys.stderr)
    if options.trace:
        results[modes[-1]].trace.to_json(options.trace)
    base = results.get("colocated")
    return {
        "preset": "cpu",
        "ablation": {m: round(r.samples_per_s / base.samples_per_s, 3) for m, r in results.items()}
        if base
        else {},
        "samples_per_s": {m: round(r.samples_per_s, 3) for m, r in results.items()},
        "idle_frac": {
            m: {
                "trainer": round(r.trainer_idle_frac, 4),
                "generator": round(r.generator_idle_frac, 4),
            }
            for m, r in results.items()
        },
        "cost_per_sample": {m: round(r.cost_per_sample, 6) for m, r in results.items()},
        "token_lag_mean": {m: round(r.token_lag_mean, 4) for m, r in results.items()},
        "trace": options.trace,
    }


def _single(options: SimulateOptions, labels: dict, result: SimResult) -> dict:
    summary = result.summary()
    print(
        f"{options.preset} {options.mode}: {summary['samples_per_s']:.3f} samples/s, iteration "
        f"{summary['iteration_s']:.1f} s, gen {summary['gen_s']:.1f} s, train "
        f"{summary['train_s']:.1f} s",
        file=sys.stderr,
    )
    steps = [
        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in it.items()}
        for it in result.per_iteration
    ]
    for it in steps:
        if "action" in it:
            print(
                f"  iteration {it['iteration']}: {it['instances']} instances, delta "
                f"{it['delta_s']:.1f} s, delta' {it['delta_prime_s']:.1f} s -> {it['action']}",
                file=sys.stderr,
            )
    if options.trace:
        result.trace.to_json(options.trace)
    return {
        **summary,
        "preset": options.preset,
        "mode": options.mode,
        **labels,
        "iterations": steps,
        "trace": options.trace,
    }


def _print_ablation(preset: str, summary: dict) -> None:
    print(f"Table 3 ablation, simulated ({preset}):", file=sys.stderr)
    print(
        f"{'method':<46}{'samples/s':>11}{'normalised':>12}{'GPUs gen/train':>16}", file=sys.stderr
    )
    for row, label in LABELS.items():
        split = summary["splits"][row]
        print(
            f"{label:<46}{summary['samples_per_s'][row]:>11.3f}"
            f"{summary['ablation'][row]:>12.2f}"
            f"{split['gen_gpus']:>8}/{split['train_gpus']:<7}",
            file=sys.stderr,
        )


def run_plan(options: PlanOptions) -> dict:
    """Print Algorithm 1's plan and its runner-ups; return them."""
    model, max_len = _parse(options.workload)
    lengths = _paper_workload(max_len, options.seed).lengths(0)
    gpu = GPUS[options.gen_gpu]
    context = PAPER_PROMPT_TOKENS + max_len  # each sequence reserves its full context
    cross = options.gen_budget is not None or options.train_budget is not None
    transfer = model.weight_bytes * 8 / (LINK_GBPS["cross-dc" if cross else "single-dc"] * 1e9)
    allocator = ResourceAllocator(
        decode_latency(model, gpu),
        trainer_cost(model),
        model.gen_tp,
        kv_batch_limit(model, gpu, context),
        options.mode,
        weight_sync_s=transfer + SYNC_LATENCY_S,
    )
    if cross:
        if options.gen_budget is None or options.train_budget is None:
            raise ConfigError("plan: cross-datacenter needs both --gen-budget and --train-budget.")
        plan = allocator.plan_cross(
            options.gen_budget, options.train_budget, lengths, PAPER_PROMPT_TOKENS
        )
    else:
        budget = options.budget if options.budget is not None else model.total_gpus
        plan = allocator.plan(budget, lengths, PAPER_PROMPT_TOKENS)
    print(
        f"{'':<10}{'gen GPUs':>9}{'train GPUs':>11}{'T_gen s':>10}{'T_train s':>11}"
        f"{'iteration s':>13}",
        file=sys.stderr,
    )
    for tag, p in [("plan", plan)] + [(f"alt {i + 1}", a) for i, a in enumerate(plan.alternatives)]:
        print(
            f"{tag:<10}{p.gen_gpus:>9}{p.train_gpus:>11}{p.gen_s:>10.1f}{p.train_s:>11.1f}"
            f"{p.iteration_s:>13.1f}",
            file=sys.stderr,
        )
    if plan.released_gpus:
        print(f"released to other jobs: {plan.released_gpus} GPUs", file=sys.stderr)
    return {
        "workload": options.workload,
        "mode": options.mode,
        "gen_gpu": gpu.name,
        **plan.to_dict(),
    }


def run_validate(options: ValidateOptions) -> dict:
    """Run ``streamrl.sim.validate.validate``; print its table; return its result."""
    from streamrl.runtime.quiet import quiet_lightning
    from streamrl.sim.validate import validate

    names = [n.strip() for n in options.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PREDICTED]
    if unknown:
        raise ConfigError(f"--configs: unknown {unknown}; choose from {', '.join(PREDICTED)}.")
    if options.iterations < 1 or options.warmup < 0 or options.repeats < 1:
        raise ConfigError("Need --iterations >= 1, --warmup >= 0 and --repeats >= 1.")
    quiet_lightning()
    result = validate(
        [PREDICTED[n] for n in names],
        iterations=options.iterations,
        warmup=options.warmup,
        repeats=options.repeats,
        quick=options.quick,
        seed=options.seed,
    )
    if options.figure:
        from streamrl.sim.figures import validation_figure

        result["figure"] = str(validation_figure(result, options.figure))
    return result
