"""``streamrl bench pipeline``: colocated vs disaggregated sync vs asynchronous modes, same run.

Every mode uses the same generator and trainer code, the same model, prompts and forced output
lengths (the paper's throughput protocol, §7), and the same two cores (``BENCH_MODES``):

- ``colocated``: two generator instances decode on both cores, then the trainer trains on both
  cores (time-sharing, as verl and the paper's ColocationRL do; no overlap);
- ``sync``: one generator instance on one core and a one-thread trainer on the other, which
  back-propagates each micro-batch as soon as it has streamed in (dynamic-batch pipelining,
  §4.1);
- ``async``: as ``sync``, plus the next iteration is generated while this one trains and the
  weight transfer runs in the background (one-step staleness, §4.1); each sample comes from one
  weight version, so an instance finishes its running sequences before it loads new weights;
- ``async-k2``: as ``async``, two iterations ahead (staleness bound 2);
- ``partial-keep`` / ``partial-recompute``: as ``async``, with partial rollout: running
  sequences go on under new weights, keeping their key/value cache or computing it again
  (``streamrl.components.generation.partial``); ``partial-keep-k2``: keep, two ahead;
- ``async-adaptive``: as ``async``, with the long-tail parts past the paper (issue 34): the
  distributional ``LengthRanker`` learning online, the ``AdaptiveDispatcher`` (tail-aware costs,
  group context, moves between generators, least-slack order) and LPT admission;
  ``async-spec``: as ``async``, with speculative decoding in each generator's tail;
  ``async-all``: both.

With ``--prompt_set by_length`` each prompt is a task prompt built for its forced length (a
ranker can learn it from the text, as on real tasks); with ``tasks`` the lengths are dealt to
prompts in turn, whatever their text.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from streamrl.algorithms import GRPO
from streamrl.bench.inputs import load_lengths, model_dir_for, tokenizer_for
from streamrl.bench.predictions import task_prompts
from streamrl.bench.settings import PipelineBench
from streamrl.components.generation.engines import HFEngine
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.speculative import SpeculativeDecoding
from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.components.weights.path import WeightPath
from streamrl.errors import ConfigError
from streamrl.policy.models import load_policy
from streamrl.records import PIPELINE_COLUMNS
from streamrl.rewards.pool import RewardPool
from streamrl.rewards.spec import RewardSpec
from streamrl.tasks import make_prompt_set
from streamrl.training.builders import build_module, build_trainer
from streamrl.training.prompts import PromptSource
from streamrl.training.reward_signal import NoLearningSignalWarning
from streamrl.training.rollout import RolloutStream
from streamrl.training.timeline import busy_fraction, mean_running
from streamrl.training.timeline_chart import draw_timeline

DEFAULT_LENGTHS = Path(__file__).resolve().parents[1] / "data" / "lengths_longtail.json"
#: ``by_length`` prompts: spread of a sample's length around what its prompt asks for.
SAMPLE_SIGMA = 0.25
#: The long-tail modes' ranker learns from finished samples every this many iterations.
RANKER_REFRESH_EVERY = 2


@dataclass(frozen=True)
class BenchMode:
    """How one benchmarked mode runs: the module's ``mode``, its staleness bound, the
    instances' partial-rollout policy, and whether the long-tail planner (``planner``: ranker,
    adaptive dispatch, LPT) and speculative decoding (``speculative``) are on."""

    mode: str
    staleness_bound: int | None = None
    partial_rollout: str = "finish"
    planner: bool = False
    speculative: bool = False


BENCH_MODES: dict[str, BenchMode] = {
    "colocated": BenchMode("colocated"),
    "sync": BenchMode("sync"),
    "async": BenchMode("async"),
    "async-k2": BenchMode("async", 2),
    "partial-keep": BenchMode("async", 1, "keep"),
    "partial-recompute": BenchMode("async", 1, "recompute"),
    "partial-keep-k2": BenchMode("async", 2, "keep"),
    "async-adaptive": BenchMode("async", planner=True),
    "async-spec": BenchMode("async", speculative=True),
    "async-all": BenchMode("async", planner=True, speculative=True),
}


def run_mode(
    name: str,
    model_dir: Path,
    lengths: list[int],
    settings: PipelineBench,
    reward: str = "exact",
    reward_workers: int = 0,
) -> dict:
    """One timed run of the mode ``name`` (``BENCH_MODES``); medians over the measured
    (post-warm-up) iterations. ``bench reward`` varies where the rewards run (``reward_workers``
    processes, 0: in the trainer); ``bench pipeline`` scores exact match inline."""
    variant = BENCH_MODES[name]
    mode = variant.mode
    # A random policy at forced lengths rarely earns a reward: the bench times the pipeline.
    warnings.filterwarnings("ignore", category=NoLearningSignalWarning)
    torch.set_num_threads(1)
    L.seed_everything(settings.seed, verbose=False)
    policy, tokenizer = load_policy(model_dir)
    prompts = _prompt_set(settings, lengths)
    algorithm = GRPO(group_size=settings.group_size)
    steps = settings.warmup + settings.iterations
    # Two cores: colocated decodes on both, then trains on both; the disaggregated modes give
    # the generators --generators cores and the trainer the rest (default one each).
    instances = settings.colocated_generators if mode == "colocated" else settings.generators
    on_gpu = settings.device == "cuda"
    service = StreamGenerationService(
        model_dir,
        instances,
        max_batch_size=settings.max_batch_size,
        temperature=1.0,  # as its figures were measured
        gpus_per_instance=int(on_gpu),
        cluster=settings.cluster,
        weights=WeightPath(transport=settings.weight_transport),
        partial_rollout=variant.partial_rollout,
        **_long_tail_parts(variant, settings),
    )
    rewards = RewardPool(
        RewardSpec.from_config(reward, where="--reward"),
        workers=reward_workers,
    )
    with service as sgs, rewards:
        rollouts = RolloutStream(
            sgs,
            PromptSource(prompts, settings.batch, seed=settings.seed),
            tokenizer,
            algorithm,
            reward=rewards,
            max_tokens=max(lengths),
            context=policy.config.max_position_embeddings,
            forced_lengths=_forced_lengths(settings, lengths),
            ranker=_ranker(variant, settings, tokenizer),
            ranker_refresh_every=RANKER_REFRESH_EVERY,
        )
        module = build_module(
            policy,
            algorithm,
            rollouts,
            iterations=steps,
            lr=1e-5,
            mode=mode,
            pipeline=DynamicBatchPipeline(settings.max_tokens_per_micro_batch),
            staleness_bound=variant.staleness_bound,
        )
        accelerator = "gpu" if on_gpu else "cpu"
        build_trainer(module, show_progress=False, accelerator=accelerator, devices=1).fit(module)
    measured = module.history[settings.warmup :]
    spans = rollouts.trace.spans
    # The measured window: from the first trainer span of the first measured iteration to the
    # end of the last one (the trainer's spans carry their iteration).
    trainer = [s for s in spans if s.lane == "trainer" and s.iteration >= settings.warmup]
    start, end = min(s.start_s for s in trainer), max(s.end_s for s in trainer)
    lanes = sorted({s.lane for s in spans if s.lane.startswith("generator")})
    gen_busy = [busy_fraction(spans, lane, start, end) for lane in lanes]
    # Batch occupancy: the tail bubble shows here (few sequences running), not in idle time.
    running = sum(mean_running(spans, lane, start, end) for lane in lanes)
    iteration_s = statistics.median(h["time/iteration_s"] for h in measured)
    return {
        "samples_per_s": rollouts.samples_per_iteration / iteration_s,
        "iteration_s": iteration_s,
        "gen_s": statistics.median(h["time/generate_s"] for h in measured),
        "train_s": statistics.median(h["time/train_s"] for h in measured),
        "trainer_idle_frac": statistics.median(
            h["time/wait_s"] / h["time/iteration_s"] for h in measured
        ),
        "generator_idle_frac": 1 - statistics.mean(gen_busy) if gen_busy else 1.0,
        "exposed_sync_s": statistics.median(h["time/sync_exposed_s"] for h in measured),
        "slot_use": running / (instances * settings.max_batch_size),
        "token_lag_mean": statistics.mean(
            h.get("train/token_staleness_mean", 0.0) for h in measured
        ),
        "_trace": rollouts.trace,
    }


def bench_pipeline(settings: PipelineBench) -> dict:
    """Run every mode ``settings.repeats`` times; report medians and speedups over colocated."""
    modes = [m.strip() for m in settings.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in BENCH_MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes: unknown {unknown}; choose from {', '.join(BENCH_MODES)}.")
    lengths = load_lengths(settings.lengths or DEFAULT_LENGTHS)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() "
            "is False); run without --device to benchmark on the CPU."
        )
    tokenizer = tokenizer_for(settings.model)
    prompt_set = _prompt_set(settings, lengths)
    longest_prompt = max(len(tokenizer(row["prompt"])["input_ids"]) for row in prompt_set)
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        # Lengths past the built-in model's context: build it with the context they need (a
        # model directory too short fails here, before any generator starts).
        context = longest_prompt + max(lengths)
        model_dir = model_dir_for(settings.model, Path(tmp), settings.seed, context=context)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for repeat in range(settings.repeats):
            for mode in modes:  # interleaved, so drift on the machine hits every mode alike
                runs[mode].append(run_mode(mode, model_dir, lengths, settings))
                rate = runs[mode][-1]["samples_per_s"]
                tag = f"[{repeat + 1}/{settings.repeats}] {mode}"
                print(f"{tag}: {rate:.1f} samples/s", file=sys.stderr)
    result = {"modes": {m: _median_run(r) for m, r in runs.items()}}
    if "colocated" in runs:
        base = result["modes"]["colocated"]["samples_per_s"]
        result["speedup"] = {
            m: round(v["samples_per_s"] / base, 3)
            for m, v in result["modes"].items()
            if m != "colocated"
        }
    if "async" in runs:  # the asynchronous variants against the paper's one-step async
        base = result["modes"]["async"]["samples_per_s"]
        result["over_async"] = {
            m: round(v["samples_per_s"] / base, 3)
            for m, v in result["modes"].items()
            if BENCH_MODES[m].mode == "async" and m != "async"
        }
    if settings.timeline_dir:
        out = Path(settings.timeline_dir)
        out.mkdir(parents=True, exist_ok=True)
        for mode, mode_runs in runs.items():
            trace = mode_runs[-1]["_trace"]
            trace.to_json(out / f"pipeline-{mode}.json")
            draw_timeline(
                trace.spans, out / f"pipeline-{mode}.png", title=f"bench pipeline: {mode}"
            )
    _print_table(result)
    return result


def _prompt_set(settings: PipelineBench, lengths: list[int]) -> Any:
    """The task prompts every mode draws its batches from: the built-in tasks, or (``by_length``)
    one task prompt built for each forced length, the file's lengths in turn."""
    n = max(64, settings.batch * 4)
    if settings.prompt_set == "tasks":
        return make_prompt_set(n, seed=settings.seed, max_len=8)
    wanted = [lengths[i % len(lengths)] for i in range(n)]
    texts = task_prompts(wanted, SAMPLE_SIGMA, settings.seed, set())
    return [
        {"prompt_id": f"p{i:04d}", "prompt": text, "answer": "", "length": length}
        for i, (text, length) in enumerate(zip(texts, wanted))
    ]


def _forced_lengths(
    settings: PipelineBench, lengths: list[int]
) -> Iterator[int] | Callable[[Mapping[str, Any]], int]:
    """The lengths dealt in turn, or each prompt's own (``by_length``)."""
    if settings.prompt_set == "tasks":
        return itertools.cycle(lengths)
    return lambda row: row["length"]


def _ranker(variant: BenchMode, settings: PipelineBench, tokenizer: Any) -> LengthRanker | None:
    """The long-tail modes' length ranker, learning online from the policy's samples."""
    return LengthRanker(seed=settings.seed, tokenizer=tokenizer) if variant.planner else None


def _long_tail_parts(variant: BenchMode, settings: PipelineBench) -> dict:
    """The service's dispatcher, scheduler and engine for a mode (the defaults otherwise)."""
    parts: dict[str, Any] = {}
    if variant.planner:
        parts.update(
            dispatcher=AdaptiveDispatcher(None, settings.max_batch_size), scheduler=LPTScheduler
        )
    if variant.speculative:
        parts["engine"] = HFEngine(speculative=SpeculativeDecoding())
    return parts


def _median_run(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if not k.startswith("_")]
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}


def _print_table(result: dict) -> None:
    cols = [*PIPELINE_COLUMNS, "slot_use"]
    print(f"{'mode':<18}" + "".join(f"{c:>20}" for c in cols), file=sys.stderr)
    for mode, row in result["modes"].items():
        print(f"{mode:<18}" + "".join(f"{row[c]:>20.3f}" for c in cols), file=sys.stderr)
    for mode, speedup in result.get("speedup", {}).items():
        print(f"speedup {mode}/colocated: {speedup:.2f}x", file=sys.stderr)
    for mode, speedup in result.get("over_async", {}).items():
        print(f"speedup {mode}/async: {speedup:.2f}x", file=sys.stderr)
