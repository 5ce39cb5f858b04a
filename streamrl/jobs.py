"""The jobs behind ``streamrl fit`` and ``streamrl demo``: plain functions a notebook can call.

``run_fit`` is the whole main job, top to bottom: check inputs, warm-start, evaluate, start the
stream generation service, let Lightning drive the disaggregated RL loop, evaluate again.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from pathlib import Path

import datasets
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.algorithms import build_algorithm
from streamrl.algorithms.base import Algorithm
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.profiler import Profiler
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.config import RunConfig, check_values
from streamrl.evaluation import evaluate
from streamrl.fsdp import ShardedStreamRLModule, sharded_trainer
from streamrl.lora import LoRASpec, apply_lora
from streamrl.models import load_policy, save_policy
from streamrl.module import StreamRLModule, rl_trainer
from streamrl.prepare import ensure_policy, prepare_run
from streamrl.rollout import PromptSource, RolloutStream
from streamrl.tasks.rewards import get_reward
from streamrl.timeline import draw_timeline
from streamrl.trainer_ranks import trainer_ranks


def run_fit(config: RunConfig, show_progress: bool = True, resume: str | None = None) -> dict:
    """Run the main job and return its summary (also written to ``<output_dir>/summary.json``).

    Args:
        config: the run's settings.
        show_progress: draw progress bars on stderr.
        resume: a checkpoint (``<output_dir>/checkpoints/last.ckpt``) to continue from.

    Returns:
        ``reward_first`` / ``reward_last`` (mean reward of the first / last 3 iterations),
        ``heldout_acc_before`` / ``heldout_acc_after`` (greedy exact match on held-out prompts),
        ``samples_per_s`` (over the iterations' own time, ``rl_wall_s``), ``train_wall_s`` (the
        whole training call: service start, profiling, checkpoints, shutdown),
        ``trainer_wait_frac`` (share of RL time the trainer waited for samples), ``iterations``,
        ``wall_s``, the starting policy's output lengths, and
        ``policy_dir``: the trained policy saved as a model directory (``<output_dir>/policy``).
    """
    started = time.perf_counter()
    check_values(config)
    L.seed_everything(config.seed, verbose=False)
    run = prepare_run(config)  # every input check happens here, before any training
    model_dir = ensure_policy(config, run, show_progress=show_progress)
    policy, tokenizer = load_policy(model_dir)
    before = evaluate(policy, tokenizer, run.heldout)
    summary: dict = {
        "heldout_acc_before": before.accuracy,
        "length_median": before.length_median,
        "length_p90": before.length_p90,
        "length_max": before.length_max,
    }
    rl = config.rl
    if rl.iterations > 0:
        training_started = time.perf_counter()
        module, policy = _train(
            config, run.train, run.context, model_dir, policy, tokenizer, show_progress, resume
        )
        # A user's stopwatch on the training call: process spawns, profiling, checkpoint writes
        # and Lightning's own overhead included (``rl_wall_s`` counts the iterations only).
        summary["train_wall_s"] = time.perf_counter() - training_started
        after = evaluate(policy, tokenizer, run.heldout)
        if module.history:  # a resumed run may have had no iteration left
            summary.update(_rl_summary(module, len(module.history)))
        summary.update(ledger(module), heldout_acc_after=after.accuracy)
        summary["accuracy_by_task_after"] = after.accuracy_by_task
        # The trained policy as a model directory: `--config` with `model: <this dir>` goes on.
        trained = save_policy(_plain(policy), tokenizer, Path(config.output_dir) / "policy")
        summary["policy_dir"] = str(trained)
    summary.update(
        accuracy_by_task_before=before.accuracy_by_task,
        iterations=rl.iterations,
        model_dir=str(model_dir),
        output_dir=config.output_dir,
        wall_s=time.perf_counter() - started,
    )
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def build_run_algorithm(config: RunConfig, policy: PreTrainedModel) -> Algorithm:
    """The run's RL algorithm, as every trainer rank builds it."""
    rl = config.rl
    return build_algorithm(
        rl.algorithm,
        get_reward(rl.reward),
        group_size=rl.group_size,
        clip_eps=rl.clip_eps,
        kl_coef=rl.kl_coef,
        max_tokens=rl.max_tokens,
        hidden_size=policy.config.hidden_size,
        samples_per_iteration=rl.prompts_per_iteration * rl.group_size,
    )


def _train(
    config: RunConfig,
    train_set: datasets.Dataset,
    context: int,
    model_dir: Path,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    show_progress: bool,
    resume: str | None = None,
) -> tuple[StreamRLModule, PreTrainedModel]:
    """Start the generation service and let a Lightning ``Trainer`` run the RL iterations
    (from the checkpoint ``resume``, if given: weights, optimizer, stream position, in-flight
    prompts, component states). Returns the module and the trained policy (unsharded)."""
    rl = config.rl
    algorithm = build_run_algorithm(config, policy)
    reference = copy.deepcopy(policy) if rl.kl_coef > 0 else None
    torch.set_num_threads(1)  # one thread per process: the generators need the other cores
    skew = rl.skew_dispatch and rl.generators >= 2
    latency = _measure_latency(policy, tokenizer, rl.max_batch_size) if skew or rl.elastic else None
    dispatcher = SkewAwareDispatcher(latency, rl.max_batch_size) if skew else None
    elastic = None
    if rl.elastic:
        elastic = ElasticController(latency, rl.max_batch_size, max_instances=rl.max_generators)
    lora = None
    if rl.lora_r > 0:  # adapters only: they train, and only they travel to the generators
        lora = LoRASpec(rl.lora_r, rl.lora_alpha, 0.0, tuple(rl.lora_target_modules))
        policy = apply_lora(policy, lora)
    service = StreamGenerationService(
        model_dir,
        rl.generators,
        max_batch_size=rl.max_batch_size,
        temperature=rl.temperature,
        seed=config.seed,
        dispatcher=dispatcher,
        scheduler="lpt" if skew else "fifo",
        max_restarts=rl.max_restarts,
        status_path=Path(config.output_dir) / "instances.json",
        lora=lora,
        backend=rl.backend,
        cluster=rl.cluster,
        gpus_per_instance=rl.gpus,
        weight_transport=rl.weight_transport,
        sites=rl.sites or None,
        trainer_site=rl.trainer_site,
    )
    with service:
        rollouts = RolloutStream(
            service,
            PromptSource(train_set, rl.prompts_per_iteration, seed=config.seed),
            tokenizer,
            algorithm,
            max_tokens=rl.max_tokens,
            context=context,
            ranker=LengthRanker(seed=config.seed) if skew else None,
            ranker_refresh_every=rl.ranker_refresh_every,
        )
        pipeline = DynamicBatchPipeline(
            rl.token_budget, rl.min_samples, staleness_bound=int(rl.mode == "async")
        )
        sharded = rl.trainer_ranks > 1
        module_class = ShardedStreamRLModule if sharded else StreamRLModule
        extra = dict(share_stream=True) if sharded else {}
        module = module_class(
            policy.train(),
            algorithm,
            rollouts,
            rl.iterations,
            lr=rl.lr,
            reference=reference,
            temperature=rl.temperature,
            mode=rl.mode,
            pipeline=pipeline,
            elastic=elastic,
            is_cap=rl.is_cap,
            **extra,
        )
        settings = dict(
            logger=make_logger(config),
            default_root_dir=config.output_dir,
            log_every_n_steps=1,
            enable_progress_bar=show_progress,
            enable_checkpointing=True,
            callbacks=[checkpoints(config)],
        )
        if sharded:  # rank 0 of rl.trainer_ranks FSDP2 ranks; the others are spawned here
            with trainer_ranks(config, model_dir, rl.trainer_ranks, resume):
                trainer = sharded_trainer(rl.trainer_ranks, rl.iterations, **settings)
                trainer.fit(module, ckpt_path=resume)
            policy = load_policy(model_dir)[0]  # the sharded copy's full weights, unsharded
            policy.load_state_dict(module.final_weights, strict=False)
        else:
            rl_trainer(rl.iterations, **settings).fit(module, ckpt_path=resume)
    policy.eval()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = rollouts.trace.to_json(out / "trace.json")
    if rollouts.trace.spans:  # a resumed run may have had nothing left to do
        draw_timeline(rollouts.trace.spans, out / "timeline.png", title=f"streamrl {rl.mode}")
        print(f"timeline: {trace_path} -> {out / 'timeline.png'}", file=sys.stderr)
    return module, policy


def _plain(policy: PreTrainedModel) -> PreTrainedModel:
    """The policy without LoRA wrappers (adapters merged into a copy), ready to save."""
    if hasattr(policy, "merge_and_unload"):
        return copy.deepcopy(policy).merge_and_unload()
    return policy


def checkpoints(config: RunConfig) -> ModelCheckpoint:
    """Checkpoints every ``rl.checkpoint_every`` iterations, and ``last.ckpt`` (every trainer
    rank builds the same callback: saving is collective under FSDP)."""
    # A checkpoint holds the state after an iteration's optimizer step: what a resume needs.
    warnings.filterwarnings("ignore", "Using ModelCheckpoint with manual optimization")
    every = config.rl.checkpoint_every
    return ModelCheckpoint(
        Path(config.output_dir) / "checkpoints",
        save_last=True,
        every_n_train_steps=every or None,
        save_top_k=1 if every else 0,
    )


def make_logger(config: RunConfig) -> Logger:
    """The run's Lightning logger; metrics are namespaced ``stage/metric``."""
    if config.logger == "tensorboard":
        return TensorBoardLogger(config.output_dir, name="logs")
    if config.logger == "wandb":
        return WandbLogger(project="streamrl", save_dir=config.output_dir, offline=True)
    return CSVLogger(config.output_dir, name="logs")


def _measure_latency(
    policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_batch_size: int
) -> LatencyModel:
    """``PTL(BS)`` measured on this policy now, for Algorithm 2 and the elastic controller
    (§5.1: never assumed)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch_size]
    prompt = tokenizer("copy abcdefgh=")["input_ids"]
    return Profiler(policy.eval(), prompt, tokens=16, repeats=1).fit(sizes)


def _rl_summary(module: StreamRLModule, iterations: int) -> dict:
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
        "staleness_max": max(h["train/staleness_max"] for h in history),
        "dropped_stale": module.pipeline.dropped_stale,
        "sync_exposed_s_total": sum(h["time/sync_exposed_s"] for h in history),
        "sync_transfer_s_total": module.sync_transfer_s,
    }


def ledger(module: StreamRLModule) -> dict:
    """Where every requested sample went; ``samples_lost`` must be 0 (see docs/failures.md)."""
    service, rollouts = module.rollouts.service, module.rollouts
    requested = rollouts.prompts_dispatched * rollouts.algorithm.group_size
    filtered = module.pipeline.dropped_stale + rollouts.samples_filtered
    return {
        "prompts_dispatched": rollouts.prompts_dispatched,
        "samples_requested": requested,
        "samples_generated": service.counts["samples_returned"],
        "samples_trained": module.samples_trained,
        "samples_filtered": filtered,
        "samples_requeued": service.counts["requests_requeued"],
        "samples_discarded_late": service.counts["samples_discarded"],
        "samples_lost": requested - module.samples_trained - filtered,
        "instances_restarted": service.counts["instances_restarted"],
        "generators_final": sum(i.state != "failed" for i in service.instances()),
    }
