"""The RL part of a run: the generation service, the sample (or episode) stream and Lightning's
trainer, and what a run reports of them (its RL figures, its ledger, its ``summary.json``).

``streamrl.run.jobs.run_fit`` trains single-turn and episode runs alike through ``train_rl``:
config -> component objects -> the public builders; only the sampler differs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.skewness.instance_profile import LatencyProfile
from streamrl.eval.periodic import PeriodicEval, plot_eval
from streamrl.policy.chat import stop_token_ids
from streamrl.policy.models import load_policy
from streamrl.policy.sft import default_cache_dir
from streamrl.protocols import Sampler
from streamrl.run.config import RunConfig
from streamrl.run.parts import RunParts, reward_pool
from streamrl.run.trainer_ranks import RankSetup, pin_threads, trainer_ranks
from streamrl.runtime.stopping import shielded
from streamrl.training.builders import make_logger
from streamrl.training.module import StreamRLModule
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream
from streamrl.training.rollout_files import ParquetRollouts, RolloutRecorder
from streamrl.training.timeline_chart import draw_timeline


def train_with_eval(
    config: RunConfig,
    evaluator: Callable[[PreTrainedModel], Any],
    before: Any,
    train: Callable[[list[L.Callback]], tuple[StreamRLModule, PreTrainedModel]],
    announce_eval: Callable[[], None] = lambda: None,
) -> tuple[StreamRLModule, PreTrainedModel, Any, float]:
    """``train(callbacks)`` with ``rl.eval_every``'s ``PeriodicEval`` (its history starting at
    ``before``, ``eval.png`` drawn at the end), then ``announce_eval()`` and the held-out
    evaluation after training.

    Returns:
        ``(module, policy, after, train_wall_s)``; ``train_wall_s`` is a user's stopwatch on
        the training call: process spawns, profiling, checkpoint writes and Lightning's own
        overhead included (``rl_wall_s`` counts the iterations only).
    """
    periodic = None
    if config.rl.eval_every > 0:
        periodic = PeriodicEval(evaluator, every=config.rl.eval_every, output_dir=config.output_dir)
        periodic.record(0, before)
    started = time.perf_counter()
    module, policy = train([periodic] if periodic else [])
    train_wall_s = time.perf_counter() - started
    announce_eval()
    after = evaluator(policy)
    if periodic is not None:
        periodic.record(module.weight_version, after)
        plot_eval(periodic.history, Path(config.output_dir) / "eval.png")
    return module, policy, after, train_wall_s


def write_summary(summary: dict, config: RunConfig, model_dir: Path, started: float) -> dict:
    """Add what every run's summary ends with (iterations, directories, wall time since
    ``started``) and write it to ``<output_dir>/summary.json``; returns it."""
    summary.update(
        iterations=config.rl.iterations,
        model_dir=str(model_dir),
        output_dir=config.output_dir,
        wall_s=time.perf_counter() - started,
    )
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def train_rl(
    config: RunConfig,
    train_set: datasets.Dataset,
    context: int,
    model_dir: Path,
    policy_and_tokenizer: tuple[PreTrainedModel, PreTrainedTokenizerBase],
    show_progress: bool,
    resume: str | None = None,
    job: ClusterEnvironment | None = None,
    callbacks: Sequence[L.Callback] = (),
    sampler: Callable[[StreamGenerationService], Sampler] | None = None,
) -> tuple[StreamRLModule, PreTrainedModel]:
    """Config -> component objects -> the public builders: start the generation service and
    let a Lightning ``Trainer`` run the RL iterations (from the checkpoint ``resume``, if given:
    weights, optimizer, stream position, in-flight prompts, component states).

    ``sampler`` makes the stream's sampler on the started service (a multi-turn run's
    ``EpisodeRunner``, whose environments reward the samples; ``None``: the service samples);
    ``callbacks`` go to rank 0's trainer (a ``streamrl.training.rollout_files.RolloutRecorder``
    hands your function each iteration's trained samples; ``rl.save_rollouts`` adds one writing
    Parquet files). Returns the module and the trained policy (unsharded)."""
    rl = config.rl
    policy, tokenizer = policy_and_tokenizer
    parts = RunParts.from_config(config, policy, tokenizer)
    setup = RankSetup.from_config(config, parts.algorithm, job)
    pin_threads(setup.placement)  # on the CPU the generators need the other cores
    policy = setup.trainable(policy)  # LoRA: adapters only train, and only they travel
    timeouts = Timeouts.for_model(
        sum(p.numel() * p.element_size() for p in policy.parameters()),
        rl.max_tokens,
        start_s=rl.start_timeout_s,
        sample_s=rl.sample_timeout_s,
        heartbeat_s=rl.heartbeat_timeout_s,
        weight_s=rl.weight_timeout_s,
    )
    service = StreamGenerationService(
        model_dir,
        rl.generators,
        engine=parts.engine,
        dispatcher=parts.dispatcher,
        scheduler=parts.scheduler,
        max_batch_size=rl.max_batch_size,
        temperature=rl.temperature,
        seed=config.seed,
        max_restarts=rl.max_restarts,
        status_path=Path(config.output_dir) / "instances.json",
        cluster=rl.cluster,
        gpus_per_instance=rl.gpus,
        gpu_ids=setup.placement.generator_gpus or None,
        weight_transport=rl.weight_transport,
        weight_bucket_bytes=rl.weight_bucket_mb * 2**20,
        weight_fanout=rl.weight_fanout,
        start_timeout_s=timeouts.start_s,
        sample_timeout_s=timeouts.sample_s,
        heartbeat_timeout_s=timeouts.heartbeat_s,
        weight_timeout_s=timeouts.weight_s,
        profile_latency=(
            LatencyProfile.up_to(rl.max_batch_size, str(default_cache_dir()))
            if parts.latency is not None
            else None
        ),
        sites=rl.sites or None,
        trainer_site=rl.trainer_site,
        stop_token_ids=stop_token_ids(tokenizer),
        stop_strings=config.data.stop_strings,
        partial_rollout=rl.partial_rollout,
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(service)
        samples: Sampler = sampler(service) if sampler is not None else service
        stack.callback(samples.close)  # open episodes (an iteration dispatched ahead) close
        rewards = None  # a sampler that scores its samples (episodes) needs no reward
        if not samples.scores_samples:
            status = Path(config.output_dir) / "reward_workers.json"
            rewards = stack.enter_context(reward_pool(rl, parts.rewards, status))
        if parts.latency is not None:  # the instances' own PTL(BS), before any dispatch
            parts.latency.update_from(service.measured_latency())
        rollouts = RolloutStream(
            service,
            PromptSource(train_set, rl.prompts_per_iteration, seed=config.seed),
            tokenizer,
            parts.algorithm,
            reward=rewards,
            system_prompt=config.data.system_prompt,
            chat_template=config.data.chat_template,
            stop_strings=config.data.stop_strings,
            max_tokens=rl.max_tokens,
            context=context,
            ranker=parts.length_predictor,
            ranker_refresh_every=rl.ranker_refresh_every,
            sampler=samples,
        )
        module = setup.module(policy, rollouts, elastic=parts.elastic)
        if rl.save_rollouts:  # after the optimizer step, on a background thread
            rollout_dir = Path(config.output_dir) / "rollouts"
            callbacks = [*callbacks, RolloutRecorder(ParquetRollouts(rollout_dir))]
        logger = make_logger(config.logger, config.output_dir)
        make_trainer = functools.partial(
            setup.trainer, module, logger=logger, show_progress=show_progress, callbacks=callbacks
        )
        # Several ranks: a stop lands only where they can all follow (fsdp.stop_ranks).
        ranks_follow = shielded() if setup.ranks > 1 else contextlib.nullcontext()
        if job is not None:  # rank 0 of a launcher's ranks: the others run _follow_rank_zero
            with ranks_follow:
                make_trainer().fit(module, ckpt_path=resume)
            dist.destroy_process_group()
        elif setup.ranks > 1:  # rank 0 of trainer.devices FSDP2 ranks; the others start here
            # The Trainer is made once this process is rank 0 (LOCAL_RANK set), as on the other
            # ranks: Lightning then launches no processes of its own, and does not refuse the
            # strategy in a Jupyter kernel (where it refuses any that would launch them).
            with trainer_ranks(setup, model_dir, resume), ranks_follow:
                make_trainer().fit(module, ckpt_path=resume)
        else:
            try:
                make_trainer().fit(module, ckpt_path=resume)
            finally:
                if setup.placement.sharded and dist.is_initialized():  # one FSDP2 rank
                    dist.destroy_process_group()  # a later run in this process starts afresh
        if setup.placement.sharded:
            # the sharded copy's full weights, unsharded
            policy = setup.trainable(load_policy(model_dir)[0])
            policy.load_state_dict(module.final_weights, strict=False)
    policy.eval()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = rollouts.trace.to_json(out / "trace.json")
    if rollouts.trace.spans:  # a resumed run may have had nothing left to do
        draw_timeline(rollouts.trace.spans, out / "timeline.png", title=f"streamrl {rl.mode}")
        print(f"timeline: {trace_path} -> {out / 'timeline.png'}", file=sys.stderr)
    return module, policy


def rl_summary(module: StreamRLModule, iterations: int) -> dict:
    history = module.history
    rewards = [h["rollout/reward"] for h in history]
    rl_wall = sum(h["time/iteration_s"] for h in history)
    samples = iterations * module.rollouts.samples_per_iteration
    head = rewards[: min(3, len(rewards))]
    tail = rewards[-min(3, len(rewards)) :]
    return {
        "reward_first": sum(head) / len(head),
        "reward_last": sum(tail) / len(tail),
        "samples_per_s": samples / rl_wall,
        "trainer_wait_frac": sum(h["time/wait_s"] for h in history) / rl_wall,
        "rl_wall_s": rl_wall,
        "mode": module.mode,
        "staleness_bound": module.staleness_bound,
        "partial_rollout": module.rollouts.service.partial_rollout,
        "correction": module.correction,
        "staleness_max": max(h["train/staleness_max"] for h in history),
        "token_staleness": token_staleness(history),
        "dropped_stale": module.pipeline.dropped_stale,
        "sync_exposed_s_total": sum(h["time/sync_exposed_s"] for h in history),
        "sync_transfer_s_total": module.sync_transfer_s,
        "trainer": {
            "device": module.trained_on,
            "ranks": module.trainer.world_size,
            "precision": getattr(module, "precision", "32-true"),
            "activation_checkpointing": any(
                getattr(m, "gradient_checkpointing", False) for m in module.policy.modules()
            ),
            "peak_memory_bytes_per_rank": module.peak_memory_bytes,
        },
    }


def token_staleness(history: list[dict]) -> dict[str, float]:
    """The run's staleness histogram: trained tokens at each lag, summed over iterations."""
    lags: dict[str, float] = {}
    for row in history:
        for key, value in row.items():
            if key.startswith("train/tokens_lag_"):
                lag = key.rsplit("_", 1)[1]
                lags[lag] = lags.get(lag, 0.0) + value
    return dict(sorted(lags.items(), key=lambda item: int(item[0])))


def ledger(module: StreamRLModule) -> dict:
    """Where every requested sample went; ``samples_lost`` must be 0 (see docs/failures.md)."""
    service, rollouts = module.rollouts.service, module.rollouts
    requested = rollouts.prompts_dispatched * rollouts.algorithm.group_size
    filtered = module.pipeline.dropped_stale + rollouts.samples_filtered
    env_fault = rollouts.samples_env_fault  # episodes the environment cut, left out of the loss
    return {
        "prompts_dispatched": rollouts.prompts_dispatched,
        "samples_requested": requested,
        # one request per sample; an episode run counts its episodes (EpisodeJob.run_summary)
        "samples_generated": service.counts["samples_returned"],
        "samples_env_fault": env_fault,
        "samples_trained": module.samples_trained,
        "samples_filtered": filtered,
        "samples_requeued": service.counts["requests_requeued"],
        "samples_discarded_late": service.counts["samples_discarded"],
        "samples_lost": requested - module.samples_trained - filtered - env_fault,
        "instances_restarted": service.counts["instances_restarted"],
        "generators_final": sum(i.state != "failed" for i in service.instances()),
    }
