"""Sub-commands of ``streamrl bench`` defined beside their benchmarks (the command line imports
this light module; the benchmark itself loads when it runs)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
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


def add_memory_command(bench_sub: Any) -> None:
    """``streamrl bench memory`` (``streamrl.bench.memory``)."""
    memory = bench_sub.add_parser(
        "memory",
        help="peak memory and tokens/s of one training step: the old log-prob path (full "
        "vocabulary, float32) vs the new (chunked head, FSDP2 bf16-mixed), a process per case",
    )
    memory.add_argument(
        "--shape", default="0.5b", help="model shape preset: '0.5b' (Qwen2.5-0.5B's, random)"
    )
    memory.add_argument(
        "--model", help="instead of --shape: a local HF model dir (its config, random weights)"
    )
    for name, help_text in [
        ("--hidden", "hidden size (replaces the preset's)"),
        ("--layers", "decoder layers"),
        ("--heads", "attention heads"),
        ("--kv-heads", "key/value heads"),
        ("--vocab", "vocabulary size"),
        (
            "--intermediate",
            "MLP width (default with --hidden: hidden x 38/7, Qwen2.5-0.5B's "
            "ratio, rounded up to a multiple of 64)",
        ),
    ]:
        memory.add_argument(name, type=int, help=help_text)
    memory.add_argument("--seq", default="1024,4096,8192", help="comma list of completion lengths")
    memory.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    memory.add_argument("--batch", type=int, default=1, help="samples per step")
    memory.add_argument("--paths", default="old,new", help="any of old,new")
    memory.add_argument(
        "--repeats", type=int, default=1, help="timed steps per case (median; >1 adds a warm-up)"
    )
    memory.add_argument("--chunk-tokens", type=int, help="tokens per chunk of the new path's head")
    memory.add_argument("--timeout-s", type=float, default=3600.0, help="per case")
    memory.add_argument(
        "--memory-limit-gib",
        type=float,
        help="what a case may allocate; default: available memory minus 2 GiB (CPU), the whole "
        "GPU (CUDA); a case past it is reported as oom",
    )
    memory.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    memory.add_argument("--seed", type=int, default=0, help="weights and tokens")
    memory.set_defaults(func=_run_memory)


def _run_memory(args: argparse.Namespace) -> dict:
    from streamrl.bench.memory import (
        MemoryCase,
        bench_memory,
        default_memory_limit_bytes,
        model_shape,
    )
    from streamrl.errors import ConfigError

    overrides = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        intermediate_size=args.intermediate,
    )
    if args.model and any(v is not None for v in overrides.values()):
        raise ConfigError(
            "bench memory: --model takes its shape from the model's config; drop "
            "--hidden/--layers/--heads/--kv-heads/--vocab/--intermediate."
        )
    try:
        seqs = [int(s) for s in args.seq.split(",")]
    except ValueError:
        message = f"bench memory: --seq takes comma-separated integers, got {args.seq!r}."
        raise ConfigError(message) from None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("bench memory: --device cuda, but no CUDA GPU is visible.")
    limit = args.memory_limit_gib
    common = dict(
        prompt=args.prompt,
        batch=args.batch,
        shape=model_shape(args.shape, **overrides),
        model_dir=args.model,
        device=args.device,
        repeats=args.repeats,
        chunk_tokens=args.chunk_tokens,
        memory_limit_bytes=(
            default_memory_limit_bytes(args.device) if limit is None else int(limit * 1024**3)
        ),
        seed=args.seed,
    )
    cases = [MemoryCase(path, seq, **common) for seq in seqs for path in args.paths.split(",")]
    return bench_memory(cases, args.timeout_s)


def add_weights_command(bench_sub: Any) -> None:
    """``streamrl bench weights`` (``streamrl.bench.weights``)."""
    weights = bench_sub.add_parser(
        "weights",
        help="seconds, memory and trainer egress per weight version: the old path (float32, "
        "whole-model copies, one instance at a time) vs the new (staged buckets in the "
        "engine's dtype down a chain), a process per case",
    )
    weights.add_argument(
        "--size",
        choices=["test", "demo", "0.5b"],
        default="0.5b",
        help="a built-in shape with random weights (0.5b: Qwen2.5-0.5B's)",
    )
    weights.add_argument("--model", help="instead of --size: a local HF model directory")
    weights.add_argument("--instances", default="1,2,4", help="comma list of instance counts")
    weights.add_argument("--trainer-ranks", default="1", help="comma list of FSDP2 rank counts")
    weights.add_argument("--paths", default="old,new", help="any of old,new")
    weights.add_argument("--versions", type=int, default=3, help="versions pushed per case")
    weights.add_argument("--bucket-mb", type=int, default=256, help="the new path's buckets")
    weights.add_argument("--dtype", default="bfloat16", help="the new path's engine and wire dtype")
    weights.add_argument("--timeout-s", type=float, default=3600.0, help="per case")
    weights.set_defaults(func=_run_weights)


def _run_weights(args: argparse.Namespace) -> dict:
    from streamrl.bench.weights import bench_weights, random_model_dir, weight_cases
    from streamrl.errors import ConfigError

    try:
        instances = [int(n) for n in args.instances.split(",")]
        ranks = [int(n) for n in args.trainer_ranks.split(",")]
    except ValueError:
        raise ConfigError(
            "bench weights: --instances and --trainer-ranks take comma-separated integers, got "
            f"{args.instances!r} and {args.trainer_ranks!r}."
        ) from None
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"bench weights: --dtype {args.dtype!r}: float32, bfloat16 or float16.")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"bench weights: --model {args.model!r} has no config.json.")
    cases = weight_cases(
        args.model or "",
        instances,
        ranks,
        args.paths.split(","),
        versions=args.versions,
        bucket_bytes=args.bucket_mb * 2**20,
        wire_dtype=args.dtype,
        timeout_s=min(args.timeout_s, 900.0),
    )
    model_dir = args.model or random_model_dir(args.size)  # after the checks: fail fast
    cases = [replace(case, model_dir=model_dir) for case in cases]
    return bench_weights(cases, args.timeout_s)
