"""``streamrl bench memory``, ``weights`` and ``contention``: cases run a process each
(``streamrl.bench.memory``, ``weights``, ``contention``), each command a dataclass of options
and the function that runs it (``streamrl.cli.parsing.Command``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from streamrl.cli.parsing import Command
from streamrl.errors import ConfigError


@dataclass
class MemoryBench:
    """Peak memory and tokens/s of one training step: the old log-prob path (full vocabulary,
    float32) vs the new (chunked head, FSDP2 bf16-mixed), a process per case.

    Attributes:
        shape: model shape preset: '0.5b' (Qwen2.5-0.5B's, random).
        model: instead of --shape: a local HF model dir (its config, random weights).
        hidden: hidden size (replaces the preset's).
        layers: decoder layers.
        heads: attention heads.
        kv_heads: key/value heads.
        vocab: vocabulary size.
        intermediate: MLP width (default with --hidden: hidden x 38/7, Qwen2.5-0.5B's ratio,
            rounded up to a multiple of 64).
        seq: comma list of completion lengths.
        prompt: prompt tokens per sample.
        batch: samples per step.
        paths: any of old,new,vllm,protocol.
        repeats: timed steps per case (median; >1 adds a warm-up).
        chunk_tokens: tokens per chunk of the new path's head.
        timeout_s: per case.
        memory_limit_gib: what a case may allocate; default: available memory minus 2 GiB
            (CPU), the whole GPU (CUDA); a case past it is reported as oom.
        device: where the step runs.
        seed: weights and tokens.
    """

    shape: str = "0.5b"
    model: str | None = None
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    intermediate: int | None = None
    seq: str = "1024,4096,8192"
    prompt: int = 64
    batch: int = 1
    paths: str = "old,new"
    repeats: int = 1
    chunk_tokens: int | None = None
    timeout_s: float = 3600.0
    memory_limit_gib: float | None = None
    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = 0


def memory(options: MemoryBench) -> dict:
    from streamrl.bench.memory import (
        MemoryCase,
        bench_memory,
        default_memory_limit_bytes,
        model_shape,
    )

    overrides = dict(
        hidden_size=options.hidden,
        num_hidden_layers=options.layers,
        num_attention_heads=options.heads,
        num_key_value_heads=options.kv_heads,
        vocab_size=options.vocab,
        intermediate_size=options.intermediate,
    )
    if options.model and any(v is not None for v in overrides.values()):
        raise ConfigError(
            "bench memory: --model takes its shape from the model's config; drop "
            "--hidden/--layers/--heads/--kv-heads/--vocab/--intermediate."
        )
    seqs = _integers(options.seq, "bench memory: --seq")
    _check_cuda(options.device)
    limit = options.memory_limit_gib
    common = dict(
        prompt=options.prompt,
        batch=options.batch,
        shape=model_shape(options.shape, **overrides),
        model_dir=options.model,
        device=options.device,
        repeats=options.repeats,
        chunk_tokens=options.chunk_tokens,
        memory_limit_bytes=(
            default_memory_limit_bytes(options.device) if limit is None else int(limit * 1024**3)
        ),
        seed=options.seed,
    )
    paths = options.paths.split(",")
    cases = [MemoryCase(path, seq, **common) for seq in seqs for path in paths]
    return bench_memory(cases, options.timeout_s)


@dataclass
class WeightsBench:
    """Seconds, memory and trainer egress per weight version: the old path (float32,
    whole-model copies, one instance at a time) vs the new (staged buckets in the engine's
    dtype down a chain, HF instances); vllm: vLLM instances on that staging path; protocol:
    vLLM instances on vLLM's weight-transfer protocol (run these two where vLLM is
    installed); a process per case.

    Attributes:
        size: a built-in shape with random weights (0.5b: Qwen2.5-0.5B's).
        model: instead of --size: a local HF model directory.
        instances: comma list of instance counts.
        trainer_ranks: comma list of FSDP2 rank counts.
        paths: any of old,new,vllm,protocol.
        versions: versions pushed per case.
        bucket_mb: the new path's buckets.
        dtype: the new path's engine and wire dtype.
        timeout_s: per case.
    """

    size: Literal["test", "demo", "0.5b"] = "0.5b"
    model: str | None = None
    instances: str = "1,2,4"
    trainer_ranks: str = "1"
    paths: str = "old,new"
    versions: int = 3
    bucket_mb: int = 256
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    timeout_s: float = 3600.0


def weights(options: WeightsBench) -> dict:
    from streamrl.bench.weights import bench_weights, random_model_dir, weight_cases

    instances = _integers(options.instances, "bench weights: --instances")
    ranks = _integers(options.trainer_ranks, "bench weights: --trainer-ranks")
    if options.model is not None and not (Path(options.model) / "config.json").is_file():
        raise ConfigError(f"bench weights: --model {options.model!r} has no config.json.")
    cases = weight_cases(
        options.model or "",
        instances,
        ranks,
        options.paths.split(","),
        versions=options.versions,
        bucket_bytes=options.bucket_mb * 2**20,
        wire_dtype=options.dtype,
        timeout_s=min(options.timeout_s, 900.0),
    )
    model_dir = options.model or random_model_dir(options.size)  # after the checks: fail fast
    cases = [replace(case, model_dir=model_dir) for case in cases]
    return bench_weights(cases, options.timeout_s)


def _integers(text: str, option: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; ``ConfigError`` naming ``option`` otherwise."""
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated integers, got {text!r}.") from None


def _check_cuda(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("bench memory: --device cuda, but no CUDA GPU is visible.")


@dataclass
class ContentionBench:
    """The warm start's SFT steps alone and beside a CPU-bound neighbour (a second warm start
    with today's setting): today's thread setting (every core, fixed) vs the new (the cores
    free before each step), each case a fresh process.

    Attributes:
        steps: SFT steps timed per case (after 3 untimed).
        repeats: runs of every case (median reported).
        timeout_s: per case.
    """

    steps: int = 60
    repeats: int = 3
    timeout_s: float = 900.0


def contention(options: ContentionBench) -> dict:
    from streamrl.bench.contention import bench_contention

    if options.steps < 1 or options.repeats < 1:
        raise ConfigError(
            f"bench contention: need --steps >= 1 and --repeats >= 1, got {options.steps} and "
            f"{options.repeats}."
        )
    return bench_contention(options.steps, options.repeats, options.timeout_s)


COMMANDS = {
    "memory": Command(
        "peak memory and tokens/s of one training step: the old log-prob path (full "
        "vocabulary, float32) vs the new (chunked head, FSDP2 bf16-mixed), a process per case",
        MemoryBench,
        memory,
    ),
    "weights": Command(
        "seconds, memory and trainer egress per weight version: the old path (float32, "
        "whole-model copies, one instance at a time) vs the new (staged buckets in the "
        "engine's dtype down a chain), a process per case",
        WeightsBench,
        weights,
    ),
    "contention": Command(
        "the warm start's steps/s alone and beside a CPU-bound neighbour: today's thread "
        "setting (every core) vs the new (the free cores, before each step), one run",
        ContentionBench,
        contention,
    ),
}
