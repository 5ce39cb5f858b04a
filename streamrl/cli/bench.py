"""``streamrl bench generate|pipeline|reward|dispatch|ranker|episodes|packing``: measurements,
each a dataclass of options and the function that runs it (``streamrl.cli.parsing.Command``).

The options of the benchmarks that run the trainer are ``streamrl.bench.settings``' dataclasses,
which notebooks and ``streamrl.sim.validate`` build in Python too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from streamrl.bench.settings import DispatchBench, EpisodesBench, PipelineBench, RewardBench
from streamrl.cli.bench_cases import COMMANDS as CASE_COMMANDS
from streamrl.cli.parsing import Command
from streamrl.errors import ConfigError
from streamrl.runtime.quiet import quiet_lightning


@dataclass
class GenerateBench:
    """Decode throughput: continuous batching vs batched HF generate (or --speculative).

    With --speculative: the long tail's time with and without speculative decoding.

    Attributes:
        model: 'tiny' (~1M params, random; with --speculative: a warm start trained to copy,
            cached) or a model dir.
        batch_sizes: comma-separated batch sizes.
        max_tokens: forced output length per prompt (--speculative: the token budget, EOS
            ends each copy first).
        prompts: prompts per measurement.
        repeats: runs per setting (median reported).
        speculative: time the tail phase (at most --max-running sequences left) of copy
            prompts with long-tailed lengths, with and without speculative decoding.
        draft_tokens: --speculative: tokens drafted per sequence and step.
        max_running: --speculative: speculate (and time the tail) from this batch size down.
    """

    model: str = "tiny"
    batch_sizes: str = "1,8,32"
    max_tokens: int = 64
    prompts: int = 32
    repeats: int = 3
    speculative: bool = False
    draft_tokens: int = 4
    max_running: int = 4


def generate(options: GenerateBench) -> dict:
    sizes = [int(s) for s in options.batch_sizes.split(",")]
    if options.speculative:
        from streamrl.bench.speculative import bench_speculative

        return bench_speculative(
            options.model,
            sizes,
            options.max_tokens,
            options.repeats,
            options.prompts,
            draft_tokens=options.draft_tokens,
            max_running=options.max_running,
        )
    from streamrl.bench.generate import bench_generate

    return bench_generate(
        options.model, sizes, options.max_tokens, options.repeats, options.prompts
    )


def pipeline(settings: PipelineBench) -> dict:
    from streamrl.bench.pipeline import bench_pipeline

    quiet_lightning()
    return bench_pipeline(settings)


def reward(settings: RewardBench) -> dict:
    from streamrl.bench.reward import bench_reward

    quiet_lightning()
    return bench_reward(settings)


def dispatch(settings: DispatchBench) -> dict:
    from streamrl.bench.dispatch import bench_dispatch
    from streamrl.sim.moves import simulate_generation

    return bench_dispatch(settings, simulator=simulate_generation)


def episodes(settings: EpisodesBench) -> dict:
    from streamrl.bench.episodes import bench_episodes

    return bench_episodes(settings)


@dataclass
class RankerBench:
    """Recall@k of the length ranker on a 80/20 split.

    Attributes:
        data: JSONL rows {"prompt": str, "lengths": [int, ...]} or {"prompt", "length"}.
        make_data: instead of --data: write prompts with SYNTHETIC lengths (of --data-kind)
            and their tokenizer to this file, then bench.
        data_kind: what --make-data writes: 'chat' (reasoning-gym questions,
            streamrl/bench/length_data.py) or 'requests' (everyday requests with other length
            rules and heavier-tailed noise, streamrl/bench/length_data_requests.py).
        tokenizer: tokenizer.json or model dir of the policy for the ranker's token features
            (default: words).
        from_policy: instead of --data: sample this model directory's lengths on the built-in
            task mix, write them to --write_data, then bench.
        prompts: prompts sampled (--from_policy).
        samples: samples per prompt (--from_policy).
        write_data: data file written (--from_policy).
        seed: split and initialisation seed.
        backbone: local causal-LM dir: train the LoRA backbone ranker (needs streamrl[peft])
            instead; the fast ranker runs as baseline.
    """

    data: str | None = None
    make_data: str | None = None
    data_kind: Literal["chat", "requests"] = "chat"
    tokenizer: str | None = None
    from_policy: str | None = None
    prompts: int = 2000
    samples: int = 4
    write_data: str = "policy_lengths.jsonl"
    seed: int = 0
    backbone: str | None = None


def ranker(options: RankerBench) -> dict:
    from streamrl.bench.ranker import bench_ranker, policy_lengths, sampling_ceiling

    chosen = (options.data, options.from_policy, options.make_data)
    if sum(map(bool, chosen)) != 1:
        raise ConfigError("bench ranker: pass exactly one of --data, --from-policy, --make-data.")
    if options.make_data:
        if options.data_kind == "requests":
            from streamrl.bench.length_data_requests import write_request_data as write
        else:
            from streamrl.bench.length_data import write_length_data as write

        made = write(options.make_data, options.seed)
        tokenizer = options.tokenizer or made
        return bench_ranker(options.make_data, options.seed, options.backbone, tokenizer)
    if options.data:
        return bench_ranker(
            options.data, options.seed, backbone=options.backbone, tokenizer=options.tokenizer
        )
    rows = policy_lengths(options.from_policy, options.prompts, options.samples, seed=options.seed)
    with open(options.write_data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    result = bench_ranker(options.write_data, options.seed, backbone=options.backbone)
    result["ceiling@20"] = round(sampling_ceiling(rows, options.seed), 4)
    result["data"] = options.write_data
    return result


@dataclass
class PackingBench:
    """Tokens/s of one training step (forward and backward of the trainer's log-probs) on the
    demo's micro-batch and on a long-tailed one: padded rows (SDPA, a mask) vs one packed row
    under Hugging Face's block-diagonal mask vs one packed row through streamrl_varlen (SDPA on
    a jagged tensor of the samples, no mask).

    Attributes:
        size: the model's shape (random weights): demo (~1M parameters), test or 0.5b.
        repeats: timed steps per path (median; one warm-up round first).
        seed: weights and tokens.
    """

    size: Literal["test", "demo", "0.5b"] = "demo"
    repeats: int = 5
    seed: int = 0


def packing(options: PackingBench) -> dict:
    from streamrl.bench.packing import bench_packing

    return bench_packing(options.size, options.repeats, options.seed)


COMMANDS = {
    "generate": Command(
        "decode throughput: continuous batching vs batched HF generate; --speculative: the "
        "long tail's time with and without speculative decoding",
        GenerateBench,
        generate,
    ),
    "pipeline": Command(
        "colocated vs disaggregated sync vs async (one-step, k=2, partial rollout), same cores "
        "and lengths",
        PipelineBench,
        pipeline,
    ),
    "reward": Command(
        "samples/s with rewards in worker processes vs in the trainer, same run",
        RewardBench,
        reward,
    ),
    "dispatch": Command(
        "generation makespan: random vs skew-aware (predicted) vs oracle dispatch",
        DispatchBench,
        dispatch,
    ),
    "ranker": Command("recall@k of the length ranker on a 80/20 split", RankerBench, ranker),
    "episodes": Command(
        "episodes/s of multi-turn episodes: episode-aware dispatch vs round-robin",
        EpisodesBench,
        episodes,
    ),
    "packing": Command(
        "tokens/s of a training step: padded rows vs packed rows (dense mask, varlen SDPA)",
        PackingBench,
        packing,
    ),
    **CASE_COMMANDS,
}
