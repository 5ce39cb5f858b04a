"""Sub-commands of ``streamrl bench`` defined beside their benchmarks (the command line imports
this light module; the benchmark itself loads when it runs)."""

from __future__ import annotations

import argparse
from typing import Any


def add_episodes_command(bench_sub: Any) -> None:
    """``streamrl bench episodes`` (``streamrl.bench.episodes``)."""
    episodes = bench_sub.add_parser(
        "episodes",
        help="episodes/s of multi-turn episodes: episode-aware dispatch vs round-robin",
    )
    for name, default, help_text in [
        ("--episodes", 96, "timed episodes per run"),
        ("--history", 192, "episodes the ranker learns their cost from (other prompts)"),
        ("--instances", 2, "generator instances"),
        ("--max-batch-size", 8, "slots per instance"),
        ("--turn-tokens", 16, "tokens per turn (most turns generate all of them)"),
        ("--repeats", 3, "runs per policy, interleaved (median reported)"),
        ("--seed", 0, "seed"),
    ]:
        episodes.add_argument(name, type=int, default=default, help=help_text)
    episodes.add_argument(
        "--model-size", choices=["test", "demo"], default="demo", help="the random tiny policy"
    )
    episodes.set_defaults(func=_run_episodes)


def _run_episodes(args: argparse.Namespace) -> dict:
    from streamrl.bench.episodes import bench_episodes

    return bench_episodes(args)
