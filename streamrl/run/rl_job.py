"""The RL part of a run: the generation service, the sample (or episode) stream and Lightning's
trainer, and what a run reports of them (its RL figures, its ledger, its ``summary.json``).

``streamrl.run.jobs.run_fit`` trains single-turn and episode runs alike through ``train_rl``:
config -> component objects -> the public builders; only the sampler differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from transformers import PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.skewness.instance_profile import LatencyProfile
from streamrl.eval.periodic import PeriodicEval, plot_eval
from streamrl.policy.chat import stop_token_ids
from streamrl.policy.model_dir import empty_model
from streamrl.policy.routing import routing_metrics
from streamrl.policy.sft import default_cache_dir
from streamrl.protocols import Sampler
from streamrl.run.config import RunConfig
from streamrl.run.parts import RunParts, reward_pool
from streamrl.run.trainer_ranks import RankSetup, pin_threads, trainer_ranks, wait_for_rank_zero
from streamrl.runtime.devices import Placement
from streamrl.runtime.stopping import shielded
from streamrl.training.builders import make_logger
from streamrl.training.module import StreamRLModule
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream
from streamrl.training.rollout_files import ParquetRollouts, RolloutRecorder
from streamrl.training.timeline_chart import draw_timeline


@dataclass
class HeldoutEvals:
    """The run's held-out evaluations, on its generator instances (``streamrl.eval.
    on_generators``): before RL (the starting weights, version 0), every ``every`` iterations
    (``PeriodicEval``: logged, plotted to ``eval.png``) and after RL (the final version).

    Args:
        evaluator: ``(service, weight version) -> result`` (an ``EvalResult``, or an
            ``EpisodeEval`` for episodes), decoding on the service's instances once they hold
            that version.
        every: ``rl.eval.every`` (0: before and after only).
        output_dir: where ``eval.png`` goes.
        announce: prints a stage heading (``"before"`` / ``"after"``).

    Attributes:
        results: ``{"before": ..., "after": ...}`` once run.
        wall_s: each one's seconds, service start excluded.
    """

    evaluator: Callable[[StreamGenerationService, int], Any]
    every: int = 0
    output_dir: str | None = None
    announce: Callable[[str], None] = lambda when: None
    results: dict[str, Any] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    periodic: PeriodicEval | None = None
    #: What to change when the policy earns no reward at all before RL (RL then has nothing to
    #: reinforce: every advantage is 0), said on stderr; ``None``: nothing.
    zero_hint: str | None = None

    def run(self, when: str, service: StreamGenerationService, version: int) -> Any:
        """Evaluate ``version`` on ``service``'s instances now, as ``when``."""
        self.announce(when)
        started = time.perf_counter()
        result = self.results[when] = self.evaluator(service, version)
        self.wall_s[when] = time.perf_counter() - started
        if when == "before" and self.zero_hint and getattr(result, "reward", None) == 0:
            print(
                "warning: the policy earns no reward on any held-out prompt before RL, so RL "
                f"has little to reinforce; {self.zero_hint}",
                file=sys.stderr,
            )
        if self.periodic is not None:
            self.periodic.record(version, result, wall_s=self.wall_s[when])
        return result

    def callbacks(self, service: StreamGenerationService) -> list[L.Callback]:
        """``rl.eval.every``'s ``PeriodicEval`` on ``service`` (its history starting at the
        evaluation before RL), or none."""
        if self.every < 1:
            return []
        evaluator = functools.partial(_on_service, self.evaluator, service)
        self.periodic = PeriodicEval(evaluator, every=self.every, output_dir=self.output_dir)
        if "before" in self.results:
            self.periodic.record(0, self.results["before"], wall_s=self.wall_s["before"])
        return [self.periodic]

    def plot(self) -> None:
        """``eval.png`` with every evaluation, the last one included."""
        if self.periodic is not None and self.output_dir is not None:
            plot_eval(self.periodic.history, Path(self.output_dir) / "eval.png")


def _on_service(
    evaluator: Callable[[StreamGenerationService, int], Any],
    service: StreamGenerationService,
    module: StreamRLModule,
) -> Any:
    """``PeriodicEval``'s call: the module's version, on the run's instances."""
    return evaluator(service, module.weight_version)


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
    tokenizer: PreTrainedTokenizerBase,
    show_progress: bool,
    resume: str | None = None,
    job: ClusterEnvironment | None = None,
    callbacks: Sequence[L.Callback] = (),
    sampler: Callable[[StreamGenerationService], Sampler] | None = None,
    evals: HeldoutEvals | None = None,
    announce_rl: Callable[[], None] = lambda: None,
) -> StreamRLModule:
    """Config -> component objects -> the public builders: start the generation service, evaluate
    on it (``evals``: before, periodically, after), and let a Lightning ``Trainer`` run the RL
    iterations (from the checkpoint ``resume``, if given: weights, optimizer, stream position,
    in-flight prompts, component states).

    The policy is built empty (``RankSetup.empty_policy``) and each trainer rank reads only its
    own shards of ``model_dir`` once sharded; at the end every rank writes its part of the
    trained policy to ``<output_dir>/policy`` (``SavePolicy``).

    ``sampler`` makes the stream's sampler on the started service (a multi-turn run's
    ``EpisodeRunner``, whose environments reward the samples; ``None``: the service samples);
    ``callbacks`` go to rank 0's trainer (a ``streamrl.training.rollout_files.RolloutRecorder``
    hands your function each iteration's trained samples; ``rl.save_rollouts`` adds one writing
    Parquet files). Returns the module."""
    rl = config.rl
    parts = RunParts.from_config(config, empty_model(model_dir, torch.float32), tokenizer)
    setup = RankSetup.from_config(config, parts.algorithm, job, model_dir)
    pin_threads(setup.placement, model_dir)  # on the CPU the generators need the other cores
    policy = setup.empty_policy(model_dir)  # LoRA: adapters only train, and only they travel
    timeouts = Timeouts.for_model(
        sum(p.numel() * p.element_size() for p in policy.parameters()),
        rl.max_tokens,
        **rl.timeouts,
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
        weights=rl.weights,
        timeouts=timeouts,
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
        trainer_device=trainer_device(setup.placement),
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(service)
        samples: Sampler = sampler(service) if sampler is not None else service
        stack.callback(samples.close)  # open episodes (an iteration dispatched ahead) close
        rewards = None  # a sampler that scores its samples (episodes) needs no reward
        if not samples.scores_samples:
            rewards = stack.enter_context(reward_pool(rl, parts.rewards, config.output_dir))
        if parts.latency is not None:  # the instances' own PTL(BS), before any dispatch
            parts.latency.update_from(service.measured_latency())
        if evals is not None:  # the starting weights, on the instances that hold them
            evals.run("before", service, 0)
            callbacks = [*callbacks, *evals.callbacks(service)]
        announce_rl()
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
            wait_for_rank_zero(setup.timeouts.prepare_s)  # they wait for the service up to here
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
        if evals is not None:  # the final weights: the instances hold them (on_train_end)
            evals.run("after", service, module.weight_version)
            evals.plot()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = rollouts.trace.to_json(out / "trace.json")
    if rollouts.trace.spans:  # a resumed run may have had nothing left to do
        draw_timeline(rollouts.trace.spans, out / "timeline.png", title=f"streamrl {rl.mode}")
        print(f"timeline: {trace_path} -> {out / 'timeline.png'}", file=sys.stderr)
    return module


def trainer_device(placement: Placement) -> str:
    """The device trainer rank 0 holds, which the weights leave from: its GPU (the first of
    ``trainer.devices``), or the CPU."""
    if placement.accelerator == "cuda" and placement.trainer_gpus:
        return f"cuda:{placement.trainer_gpus[0]}"
    return "cpu"


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
        "algorithm": {
            "name": type(module.algorithm).__name__,
            "clip_eps": module.algorithm.clip_eps,
            "kl_coef": module.algorithm.kl_coef,
            "reference": module.reference is not None,  # a frozen policy of the KL term
        },
        "staleness_bound": module.staleness_bound,
        "partial_rollout": module.rollouts.service.partial_rollout,
        # the method, its truncation and thresholds, and whether fresh tokens were corrected too
        "correction": {**dataclasses.asdict(module.correction), **module.correction.thresholds},
        "staleness_max": max(h["train/staleness_max"] for h in history),
        "token_staleness": token_staleness(history),
        "dropped_stale": module.pipeline.dropped_stale,
        "sync_exposed_s_total": sum(h["time/sync_exposed_s"] for h in history),
        "sync_transfer_s_total": module.sync_transfer_s,
        "grad_norms": [h["train/grad_norm"] for h in history],
        "logprob_gap_max": max((h.get("train/logprob_gap", 0.0) for h in history), default=0.0),
        # over the whole run: trainer/generator log-prob gap, and the MoE routing mismatch
        **{
            k.removeprefix("train/"): v
            for k, v in routing_metrics(module.gap_totals, moe=module.routing is not None).items()
        },
        "routing_replay": module.routing_replay,
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
    reward_fault = rollouts.samples_reward_fault  # scoring crashed/hung reward workers twice
    events = rollouts.events()  # summed over every start of a resumed run
    return {
        "prompts_dispatched": rollouts.prompts_dispatched,
        "samples_requested": requested,
        # a completion, or an episode, once (a sample redone after a resume: once)
        "samples_generated": rollouts.samples_received,
        "samples_env_fault": env_fault,
        "samples_reward_fault": reward_fault,
        "samples_trained": module.samples_trained,
        "samples_filtered": filtered,
        "samples_requeued": events["requests_requeued"],
        "samples_discarded_late": events["samples_discarded"],
        "samples_lost": requested - module.samples_trained - filtered - env_fault - reward_fault,
        "instances_restarted": events["instances_restarted"],
        "reward_workers_restarted": events["reward_workers_restarted"],
        "weight_versions_verified": service.counts["weight_versions_verified"],
        "generators_final": sum(i.state != "failed" for i in service.instances()),
    }
