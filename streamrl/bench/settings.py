"""The settings of the benchmarks that run the trainer: ``streamrl bench pipeline``, ``reward``,
``dispatch`` and ``episodes`` read them from the command line (one option per field, the field's
description its help), notebooks and ``streamrl.sim.validate`` build them in Python.

Examples:
    >>> PipelineBench(batch=8, iterations=2).group_size
    4
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal


@dataclass
class PipelineBench:
    """Colocated vs disaggregated sync vs async (one-step, k=2, partial rollout), same cores
    and lengths.

    Attributes:
        modes: comma-separated, any of colocated, sync, async, async-k2, partial-keep,
            partial-recompute, partial-keep-k2, async-adaptive, async-spec, async-all.
        lengths: JSON list (or JSONL with 'length') of forced output lengths, cycled; default:
            the shipped long-tailed file.
        batch: prompts per iteration.
        group_size: samples per prompt.
        iterations: measured iterations per run.
        warmup: unmeasured iterations per run.
        repeats: runs per mode (median reported).
        model: 'tiny' (~1M params, random), 'qwen2-0.5b' (random, Qwen2.5-0.5B shapes) or a
            model dir.
        max_batch_size: slots per generator.
        generators: generator instances in the sync and async modes (one core each).
        colocated_generators: generator instances in the colocated mode (they share the cores
            with training, one phase after the other).
        max_tokens_per_micro_batch: the token ceiling of a micro-batch, every mode alike
            (small: training starts as soon as a few samples have streamed in).
        timeline_dir: write each mode's trace JSON and timeline PNG here.
        cluster: generators as local processes or Ray actors.
        weight_transport: how weights reach the generators.
        device: cuda: generators and trainer share this machine's GPU(s).
        prompt_set: 'tasks' (the lengths dealt to prompts in turn) or 'by_length' (each prompt
            built for its length, which a ranker can learn from its text).
        seed: prompts, weights and sampling.
    """

    modes: str = "colocated,sync,async,async-k2,partial-keep,partial-recompute"
    lengths: str | None = None
    batch: int = 16
    group_size: int = 4
    iterations: int = 6
    warmup: int = 1
    repeats: int = 3
    model: str = "tiny"
    max_batch_size: int = 64
    generators: int = 1
    colocated_generators: int = 2
    max_tokens_per_micro_batch: int = 256
    timeline_dir: str | None = None
    cluster: Literal["local", "ray"] = "local"
    weight_transport: Literal["gloo", "bucketed", "nccl"] = "gloo"
    device: Literal["cpu", "cuda"] = "cpu"
    prompt_set: Literal["tasks", "by_length"] = "tasks"
    seed: int = 0


@dataclass
class RewardBench:
    """Samples/s with rewards in worker processes vs in the trainer, same run.

    Attributes:
        reward: a built-in reward or package.module:fn.
        workers: comma-separated reward worker counts; 0 = in the trainer.
        mode: the RL mode.
        batch: prompts per iteration.
        group_size: samples per prompt.
        iterations: measured iterations per run.
        warmup: unmeasured iterations per run.
        repeats: runs per setting (median reported).
        max_batch_size: slots per generator.
        generators: generator instances (one core each).
        max_tokens_per_micro_batch: the token ceiling of a micro-batch.
        model: 'tiny' (~1M params, random) or a model dir.
        lengths: forced output lengths (default: the long-tailed file).
        seed: prompts, weights and sampling.
    """

    reward: str = "math"
    workers: str = "0,1"
    mode: Literal["sync", "async"] = "sync"
    batch: int = 16
    group_size: int = 4
    iterations: int = 6
    warmup: int = 1
    repeats: int = 3
    max_batch_size: int = 64
    generators: int = 1
    max_tokens_per_micro_batch: int = 256
    model: str = "tiny"
    lengths: str | None = None
    seed: int = 0

    def pipeline(self) -> PipelineBench:
        """The same run as ``bench pipeline``'s settings (its other fields at their defaults)."""
        shared = {f.name for f in fields(PipelineBench)} & {f.name for f in fields(self)}
        return PipelineBench(**{name: getattr(self, name) for name in shared})


@dataclass
class DispatchBench:
    """Generation makespan: random vs skew-aware (predicted) vs oracle dispatch.

    Attributes:
        lengths: JSON list / JSONL 'length' of true output lengths (default: the shipped
            long-tailed file).
        instances: generator instances.
        policies: comma-separated, any of random, skew (Algorithm 2 + LPT on the point
            ranker), adaptive (distributions, group context, moves mid-flight), oracle.
        predictions: comma-separated sources of the skew policy's predicted lengths, one row
            each, the first the headline 'skew' row: 'ranker' (the library's LengthRanker
            trained on an earlier iteration), 'noisy' (true lengths x log-normal noise, a
            stand-in), 'file' (--predicted); default 'ranker,noisy', or 'file' with --predicted.
        predicted: JSON list of predicted lengths, one per prompt.
        ranker_noise: 'noisy' predictions: sigma of the log-normal noise on the true lengths.
        history: samples of the earlier iteration that the ranker trains on and D (P50/P90)
            comes from (default: twice --prompts).
        sample_sigma: log-normal spread of a sample's length around the length its prompt
            asks for (sampling variation, which no ranker can see).
        simulate: replay continuous batching with the latency model (no models run).
        latency: latency model: 'paper-7b-h800', a JSON file from 'streamrl profile', or
            (default) measured on --model now.
        objective: Algorithm 2 objective: pools' makespan (max) or the paper's sum.
        adaptive: the adaptive policy's AdaptiveDispatcher arguments, e.g. {moves: false}
            or {split_groups: true} (its latency model, batch slots and D are the bench's).
        prompts: prompts (default: one per length in the file).
        group_size: samples per prompt (a group); each sample's length is its prompt's times
            a log-normal factor of spread --group_sigma.
        group_sigma: spread of the log lengths inside a group (same-prompt samples correlate).
        max_batch_size: slots per instance.
        tail_batch_size: batch size of the skew policies' long-tail instances (default:
            --max_batch_size).
        tail_speedup: simulated runs: add skew+spec and adaptive+spec rows, with speculative
            decoding in the tail speeding each tail step up this much (the measured tail-phase
            speedup of streamrl bench generate --speculative, plain / speculative).
        tail_max_running: simulated speculation is on while at most this many samples run.
        repeats: real runs per policy (median).
        model: 'tiny' (~1M params, random) or a model dir.
        seed: lengths, noise and weights.
    """

    lengths: str | None = None
    instances: int = 2
    policies: str = "random,skew,adaptive,oracle"
    predictions: str | None = None
    predicted: str | None = None
    ranker_noise: float = 0.25
    history: int | None = None
    sample_sigma: float = 0.25
    simulate: bool = False
    latency: str | None = None
    objective: Literal["max", "sum"] = "max"
    adaptive: dict[str, Any] = field(default_factory=dict)
    prompts: int | None = None
    group_size: int = 1
    group_sigma: float = 0.3
    max_batch_size: int = 32
    tail_batch_size: int | None = None
    tail_speedup: float | None = None
    tail_max_running: int = 4
    repeats: int = 3
    model: str = "tiny"
    seed: int = 0


@dataclass
class EpisodesBench:
    """Episodes/s of multi-turn episodes: episode-aware dispatch vs round-robin.

    Attributes:
        episodes: timed episodes per run.
        history: episodes the ranker learns their cost from (other prompts).
        instances: generator instances.
        max_batch_size: slots per instance.
        turn_tokens: tokens per turn (most turns generate all of them).
        repeats: runs per policy, interleaved (median reported).
        seed: episodes and weights.
        model_size: the random tiny policy.
    """

    episodes: int = 96
    history: int = 192
    instances: int = 2
    max_batch_size: int = 8
    turn_tokens: int = 16
    repeats: int = 3
    seed: int = 0
    model_size: Literal["test", "demo"] = "demo"
