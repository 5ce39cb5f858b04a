"""The ``streamrl`` console script.

Every command prints progress on stderr and, as its last stdout line, one JSON object with its
results, so scripts and CI can read it with ``tail -n 1`` (``streamrl fit --print_config`` prints
only the YAML of its config).

``streamrl fit`` reads its arguments with ``jsonargparse``, as ``LightningCLI`` does: any number
of ``--config`` YAML files and a dotted option per field of ``streamrl.run.config.RunConfig``
(``--rl.lr 3e-5``), the later winning; the merged values then pass the same checks as
``streamrl.run.config_file.load_config``. The other commands use ``argparse``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamrl.errors import (
    ConfigError,
    EnvError,
    NonFiniteLossError,
    RewardError,
    TrainerRankError,
)
from streamrl.run.fit_args import (
    VERBOSE_HELP,
    FitArgs,
    build_fit_parser,
    fit_version,
    parse_fit,
    print_fit_config,
)
from streamrl.runtime.quiet import quiet_libraries, quiet_lightning
from streamrl.runtime.references import add_search_dirs
from streamrl.runtime.stopping import Stopped, resume_hint, stop_on_signals
from streamrl.training.reward_signal import show_plainly


def _cmd_fit(fit: FitArgs) -> dict:
    from streamrl.run.config_checks import check_values
    from streamrl.run.jobs import run_fit
    from streamrl.run.reruns import resolve_resume

    quiet_lightning(verbose=fit.verbose)
    check_values(fit.config)
    resume = resolve_resume(fit.config.output_dir, fit.resume)  # a wrong one: before any work
    return run_fit(fit.config, show_progress=not fit.no_progress, resume=resume)


def _cmd_demo(args: argparse.Namespace) -> dict:
    from streamrl.run.demo import run_demo

    quiet_lightning(verbose=args.verbose)
    return run_demo(args.size, args.output_dir, show_progress=not args.no_progress)


def _cmd_bench_generate(args: argparse.Namespace) -> dict:
    from streamrl.bench.generate import bench_generate

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    return bench_generate(args.model, sizes, args.max_tokens, args.repeats, args.prompts)


def _cmd_bench_pipeline(args: argparse.Namespace) -> dict:
    from streamrl.bench.pipeline import bench_pipeline

    quiet_lightning()
    return bench_pipeline(args)


def _cmd_bench_reward(args: argparse.Namespace) -> dict:
    from streamrl.bench.reward import bench_reward

    quiet_lightning()
    return bench_reward(args)


def _cmd_bench_dispatch(args: argparse.Namespace) -> dict:
    from streamrl.bench.dispatch import bench_dispatch

    return bench_dispatch(args)


def _cmd_profile(args: argparse.Namespace) -> dict:
    from streamrl.bench.generate import load_model
    from streamrl.components.skewness.profiler import Profiler

    policy, tokenizer = load_model(args.model)
    prompt = tokenizer("copy abcdefgh=")["input_ids"]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    model = Profiler(policy, prompt, tokens=args.tokens, repeats=args.repeats).fit(sizes)
    print(f"{'batch':>6} {'ms/token':>10}", file=sys.stderr)
    for size, ptl in zip(model.batch_sizes, model.ptl_s):
        print(f"{size:>6} {ptl * 1000:>10.2f}", file=sys.stderr)
    path = model.to_json(args.output)
    return {
        "batch_sizes": model.batch_sizes,
        "ptl_ms": [round(p * 1000, 3) for p in model.ptl_s],
        "output": str(path),
    }


def _cmd_model(args: argparse.Namespace) -> dict:
    from streamrl.policy.models import count_parameters, load_policy, write_random_policy

    path = write_random_policy(args.out, args.size, context=args.context, seed=args.seed)
    model, tokenizer = load_policy(path)
    return {
        "model_dir": str(path),
        "parameters": count_parameters(model),
        "vocab": model.config.vocab_size,
        "tokenizer_ids": len(tokenizer),
    }


def _bench_ranker(args: argparse.Namespace) -> dict:
    from streamrl.bench.ranker import bench_ranker, policy_lengths, sampling_ceiling

    if sum(map(bool, (args.data, args.from_policy, args.make_data))) != 1:
        raise ConfigError("bench ranker: pass exactly one of --data, --from-policy, --make-data.")
    if args.make_data:
        from streamrl.bench.length_data import write_length_data

        tokenizer = write_length_data(args.make_data, args.seed)
        return bench_ranker(args.make_data, args.seed, args.backbone, args.tokenizer or tokenizer)
    if args.data:
        return bench_ranker(args.data, args.seed, backbone=args.backbone, tokenizer=args.tokenizer)
    rows = policy_lengths(args.from_policy, args.prompts, args.samples, seed=args.seed)
    with open(args.write_data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    result = bench_ranker(args.write_data, args.seed, backbone=args.backbone)
    result["ceiling@20"] = round(sampling_ceiling(rows, args.seed), 4)
    result["data"] = args.write_data
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl",
        description="Disaggregated, streaming RL post-training of LLMs (StreamRL).",
    )
    parser.add_argument("--version", action="version", version=f"streamrl {fit_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="run the main job on the embedded default (CPU, tiny model)")
    demo.add_argument(
        "--size",
        choices=["full", "small"],
        default="full",
        help="full: the demo of docs/demo.md (about 4 min after the install); small: the same "
        "job shrunk to about 2 min",
    )
    demo.add_argument(
        "--output-dir",
        default="runs/demo",
        help="where logs and metrics go (a new directory beside it if it holds a run)",
    )
    demo.add_argument("--no-progress", action="store_true", help="draw no progress bars")
    demo.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    demo.set_defaults(func=_cmd_demo)

    # jsonargparse parses fit's arguments (see main); this entry lists it and shows its help.
    fit = sub.add_parser(
        "fit",
        help="train from the defaults, YAML configs and dotted overrides (--rl.lr 3e-5)",
        add_help=False,
    )
    fit.add_argument("-h", "--help", action=_FitHelp, help="show fit's options and exit")
    fit.set_defaults(func=None)

    bench = sub.add_parser("bench", help="measurements; the last stdout line is JSON")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    gen = bench_sub.add_parser(
        "generate", help="decode throughput: continuous batching vs batched HF generate"
    )
    gen.add_argument("--model", default="tiny", help="'tiny' (~1M params, random) or a model dir")
    gen.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    gen.add_argument("--max-tokens", type=int, default=64, help="forced output length per prompt")
    gen.add_argument("--prompts", type=int, default=32, help="prompts per measurement")
    gen.add_argument("--repeats", type=int, default=3, help="runs per setting (median reported)")
    gen.set_defaults(func=_cmd_bench_generate)

    pipe = bench_sub.add_parser(
        "pipeline",
        help="colocated vs disaggregated sync vs async (one-step, k=2, partial rollout), same "
        "cores and lengths",
    )
    pipe.add_argument(
        "--modes",
        default="colocated,sync,async,async-k2,partial-keep,partial-recompute",
        help="any of colocated, sync, async, async-k2, partial-keep, partial-recompute, "
        "partial-keep-k2",
    )
    pipe.add_argument(
        "--lengths",
        help="JSON list (or JSONL with 'length') of forced output "
        "lengths, cycled; default: the shipped long-tailed file",
    )
    pipe.add_argument("--batch", type=int, default=16, help="prompts per iteration")
    pipe.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    pipe.add_argument("--iterations", type=int, default=6, help="measured iterations per run")
    pipe.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per run")
    pipe.add_argument("--repeats", type=int, default=3, help="runs per mode (median reported)")
    pipe.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (~1M params, random), 'qwen2-0.5b' "
        "(random, Qwen2.5-0.5B shapes) or a model dir",
    )
    pipe.add_argument("--max-batch-size", type=int, default=64, help="slots per generator")
    pipe.add_argument(
        "--generators",
        type=int,
        default=1,
        help="generator instances in the sync and async modes (one core each)",
    )
    pipe.add_argument(
        "--colocated-generators",
        type=int,
        default=2,
        help="generator instances in the colocated mode (they share the cores "
        "with training, one phase after the other)",
    )
    pipe.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=256,
        help="the token ceiling of a micro-batch, every mode alike (small: training starts "
        "as soon as a few samples have streamed in)",
    )
    pipe.add_argument("--timeline-dir", help="write each mode's trace JSON and timeline PNG here")
    pipe.add_argument(
        "--cluster",
        choices=["local", "ray"],
        default="local",
        help="generators as local processes or Ray actors",
    )
    pipe.add_argument(
        "--weight-transport",
        choices=["gloo", "bucketed", "nccl"],
        default="gloo",
        help="how weights reach the generators",
    )
    pipe.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: generators and trainer share this machine's GPU(s)",
    )
    pipe.add_argument("--seed", type=int, default=0)
    pipe.set_defaults(func=_cmd_bench_pipeline)

    rew = bench_sub.add_parser(
        "reward", help="samples/s with rewards in worker processes vs in the trainer, same run"
    )
    rew.add_argument("--reward", default="math", help="a built-in reward or package.module:fn")
    rew.add_argument("--workers", default="0,1", help="reward worker counts; 0 = in the trainer")
    rew.add_argument("--mode", choices=["sync", "async"], default="sync", help="the RL mode")
    rew.set_defaults(
        func=_cmd_bench_reward,
        colocated_generators=2,
        timeline_dir=None,
    )
    for name, default, help_text in [
        ("--batch", 16, "prompts per iteration"),
        ("--group-size", 4, "samples per prompt"),
        ("--iterations", 6, "measured iterations per run"),
        ("--warmup", 1, "unmeasured iterations per run"),
        ("--repeats", 3, "runs per setting (median reported)"),
        ("--max-batch-size", 64, "slots per generator"),
        ("--generators", 1, "generator instances (one core each)"),
        ("--max-tokens-per-micro-batch", 256, "the token ceiling of a micro-batch"),
        ("--seed", 0, "seed"),
    ]:
        rew.add_argument(name, type=int, default=default, help=help_text)
    rew.add_argument("--model", default="tiny", help="'tiny' (~1M params, random) or a model dir")
    rew.add_argument("--lengths", help="forced output lengths (default: the long-tailed file)")

    disp = bench_sub.add_parser(
        "dispatch", help="generation makespan: random vs skew-aware (predicted) vs oracle dispatch"
    )
    disp.add_argument(
        "--lengths",
        help="JSON list / JSONL 'length' of true output lengths "
        "(default: the shipped long-tailed file)",
    )
    disp.add_argument("--instances", type=int, default=2, help="generator instances")
    disp.add_argument("--policies", default="random,skew,oracle", help="any of random,skew,oracle")
    disp.add_argument(
        "--predictions",
        help="comma-separated sources of the skew policy's predicted lengths, one row each, "
        "the first the headline 'skew' row: 'ranker' (the library's LengthRanker trained on an "
        "earlier iteration), 'noisy' (true lengths x log-normal noise, a stand-in), 'file' "
        "(--predicted); default 'ranker,noisy', or 'file' with --predicted",
    )
    disp.add_argument("--predicted", help="JSON list of predicted lengths, one per prompt")
    disp.add_argument(
        "--ranker-noise",
        type=float,
        default=0.25,
        help="'noisy' predictions: sigma of the log-normal noise on the true lengths",
    )
    disp.add_argument(
        "--history",
        type=int,
        help="samples of the earlier iteration that the ranker trains on and D (P50/P90) comes "
        "from (default: twice --prompts)",
    )
    disp.add_argument(
        "--sample-sigma",
        type=float,
        default=0.25,
        help="log-normal spread of a sample's length around the length its prompt asks for "
        "(sampling variation, which no ranker can see)",
    )
    disp.add_argument(
        "--simulate",
        action="store_true",
        help="replay continuous batching with the latency model (no models run)",
    )
    disp.add_argument(
        "--latency",
        help="latency model: 'paper-7b-h800', a JSON file from "
        "'streamrl profile', or (default) measured on --model now",
    )
    disp.add_argument(
        "--objective",
        choices=["max", "sum"],
        default="max",
        help="Algorithm 2 objective: pools' makespan (default) or the paper's sum",
    )
    disp.add_argument("--prompts", type=int, help="prompts (default: one per length in the file)")
    disp.add_argument("--max-batch-size", type=int, default=32, help="slots per instance")
    disp.add_argument(
        "--tail-batch-size",
        type=int,
        default=None,
        help="batch size of the skew policies' long-tail instances (default: --max-batch-size)",
    )
    disp.add_argument("--repeats", type=int, default=3, help="real runs per policy (median)")
    disp.add_argument("--model", default="tiny", help="'tiny' (~1M params, random) or a model dir")
    disp.add_argument("--seed", type=int, default=0)
    disp.set_defaults(func=_cmd_bench_dispatch)

    rank = bench_sub.add_parser("ranker", help="recall@k of the length ranker on a 80/20 split")
    rank.add_argument(
        "--data", help='JSONL rows {"prompt": str, "lengths": [int, ...]} or {"prompt", "length"}'
    )
    rank.add_argument(
        "--make-data",
        help="instead of --data: write chat prompts with SYNTHETIC lengths "
        "(streamrl/bench/length_data.py) and their tokenizer to this file, then bench",
    )
    rank.add_argument(
        "--tokenizer",
        help="tokenizer.json or model dir of the policy for the ranker's token features "
        "(default: words)",
    )
    rank.add_argument(
        "--from-policy",
        help="instead of --data: sample this model directory's "
        "lengths on the built-in task mix, write them to --write-data, then bench",
    )
    rank.add_argument("--prompts", type=int, default=2000, help="prompts sampled (--from-policy)")
    rank.add_argument("--samples", type=int, default=4, help="samples per prompt (--from-policy)")
    rank.add_argument("--write-data", default="policy_lengths.jsonl", help="data file written")
    rank.add_argument("--seed", type=int, default=0, help="split and initialisation seed")
    rank.add_argument(
        "--backbone",
        help="local causal-LM dir: train the LoRA backbone ranker (needs streamrl[peft]) "
        "instead; the fast ranker runs as baseline",
    )
    rank.set_defaults(func=_bench_ranker)
    from streamrl.bench.commands import (
        add_episodes_command,
        add_memory_command,
        add_weights_command,
    )

    add_episodes_command(bench_sub)
    add_memory_command(bench_sub)
    add_weights_command(bench_sub)

    model = sub.add_parser(
        "model", help="write a random-init model directory of a built-in shape (e.g. 0.5b)"
    )
    model.add_argument("--size", choices=["test", "demo", "0.5b"], default="0.5b")
    model.add_argument("--out", required=True, help="the directory to write")
    model.add_argument("--context", type=int, default=2048, help="positions (prompt + output)")
    model.add_argument("--seed", type=int, default=0)
    model.set_defaults(func=_cmd_model)

    prof = sub.add_parser("profile", help="measure PTL(BS), the per-token decode latency")
    prof.add_argument("--model", default="tiny", help="'tiny' (~1M params, random) or a model dir")
    prof.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma-separated")
    prof.add_argument("--tokens", type=int, default=32, help="forced output length per sequence")
    prof.add_argument("--repeats", type=int, default=3, help="runs per batch size (median)")
    prof.add_argument("-o", "--output", default="profile.json", help="where to save the model")
    prof.set_defaults(func=_cmd_profile)

    from streamrl.sim.cli import add_plan_command, add_sim_command, add_simulate_command
    from streamrl.training.timeline_chart import add_timeline_command

    add_timeline_command(sub)
    add_simulate_command(sub)
    add_plan_command(sub)
    add_sim_command(sub)
    return parser


class _FitHelp(argparse.Action):
    """``--help`` of the ``fit`` entry: the jsonargparse parser's help."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        build_fit_parser().print_help()
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit"]:
        command = "fit"
        try:
            fit = parse_fit(argv[1:])
        except ConfigError as err:
            print(f"streamrl fit: error: {err}", file=sys.stderr)
            return 2
        if fit.print_config is not None:
            print_fit_config(fit.config, fit.print_config)
            return 0
        func = functools.partial(_cmd_fit, fit)
        # Your own `module:Name` imports from here and beside each config file, as `python -m`.
        add_search_dirs([Path.cwd(), *(Path(f).parent for f in fit.config_files)])
    else:
        args = build_parser().parse_args(argv)
        command, func = args.command, functools.partial(args.func, args)
        add_search_dirs([Path.cwd()])
    quiet_libraries()
    show_plainly()  # a run that cannot learn says so in one line of its own
    from streamrl.components.generation.service import GeneratorError

    try:
        with stop_on_signals():
            result = func()
    except Stopped as stop:  # SIGTERM or Ctrl-C: every child is stopped by now
        resume = resume_hint(fit.config.output_dir, argv) if command == "fit" else ""
        print(f"streamrl {command}: {stop}{resume}", file=sys.stderr)
        return stop.exit_code
    except TrainerRankError as err:  # stopped with every child: it goes on from a checkpoint
        resume = resume_hint(fit.config.output_dir, argv) if command == "fit" else ""
        print(f"streamrl {command}: stopped: {err}{resume}", file=sys.stderr)
        return 1
    except (ConfigError, FileNotFoundError) as err:  # bad input, found before any work
        print(f"streamrl {command}: error: {err}", file=sys.stderr)
        return 2
    except (RewardError, EnvError, GeneratorError, NonFiniteLossError) as err:  # cleaned up
        print(f"streamrl {command}: stopped: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"streamrl {command}: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
