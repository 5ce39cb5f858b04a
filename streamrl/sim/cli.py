"""``streamrl simulate``, ``streamrl plan`` and ``streamrl sim validate`` on the command line.

Both print a table on stderr and return a JSON-ready dict (``streamrl.cli.main.main`` prints it as
the last stdout line).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from streamrl.components.capacity.allocator import ResourceAllocator
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.partial import PARTIAL_ROLLOUT
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


def add_simulate_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``simulate --preset P [--mode M] [--elastic] [--trace PATH]``."""
    p = subparsers.add_parser("simulate", help="discrete-event simulation of a StreamRL run")
    p.add_argument(
        "--preset",
        default="paper-72b-20k",
        help="paper-<7b|32b|72b>-<5k|10k|20k> or cpu (this machine's bench)",
    )
    p.add_argument(
        "--mode",
        default="ablation",
        choices=["ablation", "colocated", "sync", "async"],
        help="the four-row Table 3 ablation, or one mode",
    )
    p.add_argument("--iterations", type=int, default=3, help="measured iterations (1 warm-up)")
    p.add_argument(
        "--staleness-bound",
        type=int,
        help="async: iterations generated ahead of the one training (default 1)",
    )
    p.add_argument(
        "--partial-rollout",
        default="finish",
        choices=PARTIAL_ROLLOUT,
        help="async: running samples at a weight update: finish first (finish), go on (keep) or "
        "re-prefill (recompute)",
    )
    p.add_argument("--gen-gpus", type=int, help="generator GPUs (default: Algorithm 1's plan)")
    p.add_argument("--train-gpus", type=int, help="trainer GPUs (default: Algorithm 1's plan)")
    p.add_argument("--gen-gpu", default="h800", choices=sorted(GPUS), help="generator GPU type")
    p.add_argument("--cross-dc", action="store_true", help="weights cross the 80 Gbps link")
    p.add_argument("--no-skew", action="store_true", help="random dispatch + FIFO admission")
    p.add_argument(
        "--dispatcher",
        help="as a run's rl.dispatcher: skew, round_robin, random or package.module:Name "
        "(default: the preset's)",
    )
    p.add_argument(
        "--scheduler",
        help="as a run's rl.scheduler: lpt, fifo or package.module:Name (default: the preset's)",
    )
    p.add_argument(
        "--config",
        help="a `streamrl fit` YAML: its rl.dispatcher and rl.scheduler, as that run would "
        "build them (its module:Name found beside it too); --dispatcher/--scheduler win",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="ElasticController adds a node of generator instances when needed",
    )
    p.add_argument(
        "--growth",
        type=float,
        default=0.0,
        help="output lengths grow by this fraction per iteration (elastic runs)",
    )
    p.add_argument("--trace", help="write the trace JSON here (draw it: streamrl timeline)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_simulate_command)


def run_simulate_command(args: argparse.Namespace) -> dict:
    """Run the ablation or one mode; print a table; return the results."""
    if args.iterations < 1:
        raise ConfigError(f"--iterations must be >= 1, got {args.iterations}.")
    variant = args.staleness_bound is not None or args.partial_rollout != "finish"
    if variant and args.mode == "ablation":
        raise ConfigError("--staleness-bound / --partial-rollout need one mode: --mode async.")
    args.dispatch_choice = _dispatch_choice(args)
    if args.dispatch_choice and args.mode == "ablation":
        raise ConfigError(
            "--dispatcher / --scheduler / --config choose one run's dispatch, but the ablation "
            "compares fixed ones: add --mode colocated, sync or async."
        )
    if args.preset == "cpu":
        return _simulate_cpu(args)
    _parse(args.preset)  # fail early on a bad name
    if args.mode == "ablation":
        results = run_ablation(args.preset, args.iterations, args.seed)
        summary = ablation_summary(results)
        _print_ablation(args.preset, summary)
        if args.trace:
            results["async"].trace.to_json(args.trace)
            summary["trace"] = args.trace
        return summary
    config = paper_config(
        args.preset,
        args.mode,
        args.gen_gpus,
        args.train_gpus,
        args.gen_gpu,
        args.cross_dc,
        not args.no_skew,
        args.iterations,
        args.growth,
        args.seed,
    )
    if args.elastic:
        model, _ = _parse(args.preset)
        node = max(1, 8 // model.gen_tp)
        config.elastic = ElasticController(
            config.generators.latency, config.generators.max_batch_size, step=node
        )
    result = simulate(_variant(config, args))
    return _single(args, config.labels, result)


def _variant(config: SimConfig, args: argparse.Namespace) -> SimConfig:
    """``config`` with the staleness bound, partial-rollout policy, dispatcher and admission
    scheduler of the command line."""
    try:
        return replace(
            config,
            staleness_bound=args.staleness_bound,
            partial_rollout=args.partial_rollout,
            **args.dispatch_choice,
        )
    except ValueError as err:
        raise ConfigError(f"simulate: {err}") from err


def _dispatch_choice(args: argparse.Namespace) -> dict:
    """``SimConfig`` fields from ``--config`` (its ``rl.dispatcher``, ``rl.scheduler``), then
    ``--dispatcher`` / ``--scheduler``: the same values a run builds its parts from."""
    choice: dict = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {args.config}: no such file.")
        rl = (yaml.safe_load(path.read_text()) or {}).get("rl") or {}
        choice = {
            field: rl[key]
            for field, key in (("dispatch", "dispatcher"), ("admission", "scheduler"))
            if key in rl
        }
        add_search_dirs([path.parent])  # its module:Name, as `streamrl fit --config` finds it
    if args.dispatcher:
        choice["dispatch"] = args.dispatcher
    if args.scheduler:
        choice["admission"] = args.scheduler
    return choice


def _simulate_cpu(args: argparse.Namespace) -> dict:
    modes = ["colocated", "sync", "async"] if args.mode == "ablation" else [args.mode]
    iterations = max(args.iterations, 6)
    results = {m: simulate(_variant(cpu_config(m, iterations=iterations), args)) for m in modes}
    # Stored inputs only: for a comparison with real runs use ``streamrl sim validate``.
    print(
        f"{'mode':<10}{'sim samples/s':>15}   (stored cpu profile; real: streamrl sim validate)",
        file=sys.stderr,
    )
    for m, r in results.items():
        print(f"{m:<10}{r.samples_per_s:>15.1f}", file=sys.stderr)
    if args.trace:
        results[modes[-1]].trace.to_json(args.trace)
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
        "trace": args.trace,
    }


def _single(args: argparse.Namespace, labels: dict, result: SimResult) -> dict:
    summary = result.summary()
    print(
        f"{args.preset} {args.mode}: {summary['samples_per_s']:.3f} samples/s, iteration "
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
    if args.trace:
        result.trace.to_json(args.trace)
    return {
        **summary,
        "preset": args.preset,
        "mode": args.mode,
        **labels,
        "iterations": steps,
        "trace": args.trace,
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


def add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``plan --budget N --workload paper-... [--mode M]`` (Algorithm 1)."""
    p = subparsers.add_parser("plan", help="split GPUs between generation and training (Alg. 1)")
    p.add_argument("--workload", default="paper-72b-20k", help="paper-<7b|32b|72b>-<5k|10k|20k>")
    p.add_argument("--budget", type=int, help="single datacenter: total GPUs")
    p.add_argument("--gen-budget", type=int, help="cross-datacenter: generation pool GPUs")
    p.add_argument("--train-budget", type=int, help="cross-datacenter: training pool GPUs")
    p.add_argument("--gen-gpu", default="h800", choices=sorted(GPUS), help="generator GPU type")
    p.add_argument("--mode", default="async", choices=["async", "sync"], help="objective")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_plan_command)


def run_plan_command(args: argparse.Namespace) -> dict:
    """Print Algorithm 1's plan and its runner-ups; return them."""
    model, max_len = _parse(args.workload)
    lengths = _paper_workload(max_len, args.seed).lengths(0)
    gpu = GPUS[args.gen_gpu]
    context = PAPER_PROMPT_TOKENS + max_len  # each sequence reserves its full context
    cross = args.gen_budget is not None or args.train_budget is not None
    transfer = model.weight_bytes * 8 / (LINK_GBPS["cross-dc" if cross else "single-dc"] * 1e9)
    allocator = ResourceAllocator(
        decode_latency(model, gpu),
        trainer_cost(model),
        model.gen_tp,
        kv_batch_limit(model, gpu, context),
        args.mode,
        weight_sync_s=transfer + SYNC_LATENCY_S,
    )
    if cross:
        if args.gen_budget is None or args.train_budget is None:
            raise ConfigError("plan: cross-datacenter needs both --gen-budget and --train-budget.")
        plan = allocator.plan_cross(
            args.gen_budget, args.train_budget, lengths, PAPER_PROMPT_TOKENS
        )
    else:
        budget = args.budget if args.budget is not None else model.total_gpus
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
    return {"workload": args.workload, "mode": args.mode, "gen_gpu": gpu.name, **plan.to_dict()}


def add_sim_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``sim validate``: calibrate on one real run, predict other real runs."""
    sim = subparsers.add_parser("sim", help="simulator tools (validate against real runs)")
    sim_sub = sim.add_subparsers(dest="sim", metavar="SIM", required=True)
    p = sim_sub.add_parser(
        "validate",
        help="calibrate the simulator on one real bench pipeline run, then run and simulate "
        "other configurations and report the errors",
    )
    p.add_argument(
        "--configs",
        default=",".join(PREDICTED),
        help=f"predicted configurations, any of {','.join(PREDICTED)}",
    )
    p.add_argument("--iterations", type=int, default=6, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per run")
    p.add_argument("--repeats", type=int, default=3, help="real runs per configuration (median)")
    p.add_argument(
        "--quick", action="store_true", help="profile with fewer repeats and micro-batch shapes"
    )
    p.add_argument("--figure", help="write a bar chart (PNG) of real vs simulated here")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_validate_command)


def run_validate_command(args: argparse.Namespace) -> dict:
    """Run ``streamrl.sim.validate.validate``; print its table; return its result."""
    from streamrl.runtime.quiet import quiet_lightning
    from streamrl.sim.validate import validate

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PREDICTED]
    if unknown:
        raise ConfigError(f"--configs: unknown {unknown}; choose from {', '.join(PREDICTED)}.")
    if args.iterations < 1 or args.warmup < 0 or args.repeats < 1:
        raise ConfigError("Need --iterations >= 1, --warmup >= 0 and --repeats >= 1.")
    quiet_lightning()
    result = validate(
        [PREDICTED[n] for n in names],
        iterations=args.iterations,
        warmup=args.warmup,
        repeats=args.repeats,
        quick=args.quick,
        seed=args.seed,
    )
    if args.figure:
        from streamrl.sim.figures import validation_figure

        result["figure"] = str(validation_figure(result, args.figure))
    return result
