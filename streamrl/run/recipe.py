"""The recipe ``streamrl fit`` runs, top to bottom: a checked config -> the run's component objects
-> the public builders (``streamrl.build_module``, ``streamrl.build_trainer``). Read it to see
what a run does; copy ``fit_checked`` to make a run do something else.

1. Check everything before any work: values (``config_checks``), every extension point
   (``parts.check_parts``), the rows (the job's kind).
2. The policy: your model directory, or the tiny policy warm-started on the rows (cached).
3. The run's objects (``RunParts``: algorithm, engine, dispatcher, scheduler, length predictor,
   rewards, elastic controller) and the trainer ranks' setup (``RankSetup``).
4. Start the stream generation service (§3), evaluate the starting policy on it, and let a
   Lightning ``Trainer`` drive the RL iterations on streamed samples (§4), on FSDP2 ranks when
   there are several; evaluate the trained policy.
5. The timeline, the trained policy as a model directory and ``summary.json``.

Single-turn runs (``PromptJob``) and episode runs (``EpisodeJob``, ``env.name`` set) share it:
they differ in their rows, warm start, evaluator and sampler (``prompt_job.JobKind``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.skewness.instance_profile import LatencyProfile
from streamrl.policy.chat import stop_token_ids
from streamrl.policy.model_dir import empty_model
from streamrl.policy.models import load_tokenizer
from streamrl.policy.sft import default_cache_dir
from streamrl.run.config import RunConfig
from streamrl.run.config_checks import check_values, placement_of
from streamrl.run.episode_fit import EpisodeJob
from streamrl.run.parts import RunParts, build_run_algorithm, check_parts, reward_pool
from streamrl.run.prepare import policy_heading, zero_reward_hint
from streamrl.run.prompt_job import JobKind, PromptJob
from streamrl.run.reports import HeldoutEvals, ledger, rl_summary, write_summary
from streamrl.run.reruns import finished_run, resolve_resume
from streamrl.run.stages import RunStages
from streamrl.run.trainer_ranks import (
    RankSetup,
    check_launched,
    fit_on_ranks,
    join_launched_job,
    launched_job,
    pin_threads,
    rank_timeouts,
    trainer_device,
    wait_for_rank_zero,
)
from streamrl.runtime.stopping import ignore_signals
from streamrl.training.builders import make_logger
from streamrl.training.prompts import PromptSource
from streamrl.training.rollout import RolloutStream
from streamrl.training.rollout_files import ParquetRollouts, RolloutRecorder
from streamrl.training.timeline_chart import draw_timeline


def run_fit(
    config: RunConfig,
    show_progress: bool = True,
    resume: str | None = None,
    stages: RunStages | None = None,
) -> dict:
    """Run the main job and return its summary (also written to ``<output_dir>/summary.json``).

    Args:
        config: the run's settings.
        show_progress: draw progress bars on stderr.
        resume: a checkpoint (``<output_dir>/checkpoints/last.ckpt``) to continue from, or
            ``"auto"``: the output directory's last checkpoint, if any. Without it, an output
            directory that holds an earlier run's checkpoints is refused (``reruns``).
        stages: the stage headings printed on stderr (``streamrl demo`` gives their expected
            lengths); by default ``RunStages()``.

    Returns:
        ``reward_first`` / ``reward_last`` (mean reward of the first / last 3 iterations),
        ``reward_per_iteration`` (each iteration's mean reward, from a resumed run's start), the
        held-out figures before and after (``heldout_acc_*``: greedy exact match on held-out
        prompts; episodes: ``heldout_success_*``), ``samples_per_s`` (over the iterations' own
        time, ``rl_wall_s``), ``train_wall_s`` (the whole training call: service start,
        profiling, checkpoints, shutdown), ``trainer_wait_frac`` (share of RL time the trainer
        waited for samples), ``iterations``, ``wall_s``, the ledger, and ``policy_dir``: the
        trained policy saved as a model directory (``<output_dir>/policy``, LoRA merged).
    """
    resume = resolve_resume(config.output_dir, resume)  # one output directory, one run
    check_values(config)
    return fit_checked(config, resume, show_progress, stages or RunStages())


def fit_checked(config: RunConfig, resume: str | None, progress: bool, stages: RunStages) -> dict:
    """``run_fit`` once its values and its resume point (a path, or ``None``) are checked;
    ``progress``: draw progress bars."""
    started, rl, out = time.perf_counter(), config.rl, Path(config.output_dir)
    done = finished_run(config.output_dir, resume, rl.iterations)
    if done is not None and launched_job() is None:
        print(
            f"streamrl fit: {out} finished its {done['iterations']} iterations already; nothing "
            "to do (its summary.json is kept and printed). Raise rl.iterations to go on, or "
            "start a new run in another output_dir.",
            file=sys.stderr,
        )
        return done
    # 1. Every extension point resolves and fits where the trainer runs, before any work.
    check_parts(rl, placement_of(config))
    job = launched_job()  # torchrun or SLURM started this process as one of several ranks
    if job is not None:
        check_launched(config, job.world_size())
        join_launched_job(job, placement_of(config), rank_timeouts(config))
        if job.global_rank() > 0:
            return follow_rank_zero(config, job, resume)
    L.seed_everything(config.seed, verbose=False)
    kind = job_kind(config)  # every input check happens here, before any training
    # 2. The policy: yours, or the tiny one warm-started on the rows.
    stages.start("policy", policy_heading(config))
    model_dir = kind.policy_dir(progress)
    if job is not None:  # the other ranks build the policy now
        wait_for_rank_zero(rank_timeouts(config, model_dir).prepare_s)
    tokenizer = load_tokenizer(model_dir)
    context = kind.context(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    # 3. The run's objects; the policy stays empty until each rank reads its own shards.
    parts = RunParts.from_config(config, empty_model(model_dir, torch.float32), tokenizer)
    setup = RankSetup.from_config(config, parts.algorithm, job, model_dir)
    pin_threads(setup.placement, model_dir)  # on the CPU the generators need the other cores
    policy = setup.empty_policy(model_dir)  # LoRA: adapters only train, and only they travel
    evals = HeldoutEvals(
        kind.evaluator(tokenizer, context),
        every=rl.eval.every,
        output_dir=config.output_dir,
        announce=lambda when: stages.evaluation(when, len(kind.heldout), kind.unit),
        zero_hint=zero_reward_hint(config),
    )
    started_training = time.perf_counter()
    # 4. Generate, evaluate, train, evaluate.
    with contextlib.ExitStack() as stack:
        service = generation_service(config, parts, setup, policy, model_dir, tokenizer)
        stack.enter_context(service)
        make_sampler = kind.sampler(tokenizer, context)  # None: the service samples
        samples = make_sampler(service) if make_sampler is not None else service
        stack.callback(samples.close)  # open episodes (an iteration dispatched ahead) close
        rewards = None  # a sampler that scores its samples (episodes) needs no reward
        if not samples.scores_samples:
            rewards = stack.enter_context(reward_pool(rl, parts.rewards, config.output_dir))
        if parts.latency is not None:  # the instances' own PTL(BS), before any dispatch
            parts.latency.update_from(service.measured_latency())
        evals.run("before", service, 0)  # the starting weights, on the instances holding them
        stages.start(
            "rl",
            f"RL ({type(parts.algorithm).__name__}, {rl.arg('module', 'mode')}): "
            f"{rl.iterations} iterations of {rl.prompts_per_iteration} prompts x "
            f"{rl.group_size} samples, {service.num_instances} generator processes streaming "
            "samples to the trainer",
        )
        rollouts = RolloutStream(
            service,
            PromptSource(kind.train, rl.prompts_per_iteration, seed=config.seed),
            tokenizer,
            parts.algorithm,
            **rl.rollouts,  # the section's own arguments; the rest is linked in from the run
            reward=rewards,
            system_prompt=config.data.system_prompt,
            chat_template=config.data.chat_template,
            stop_strings=config.data.stop_strings,
            context=context,
            ranker=parts.length_predictor,
            sampler=samples,
        )
        module = setup.module(policy, rollouts, elastic=parts.elastic)
        callbacks = evals.callbacks(service)
        if rl.save_rollouts:  # after the optimizer step, on a background thread
            callbacks.append(RolloutRecorder(ParquetRollouts(out / "rollouts")))
        logger = make_logger(config.logger, config.output_dir)
        trainer = functools.partial(
            setup.trainer, module, logger=logger, show_progress=progress, callbacks=callbacks
        )
        fit_on_ranks(setup, trainer, module, model_dir, resume, launched=job is not None)
        evals.run("after", service, module.weight_version)  # the instances hold the last one
        evals.plot()
    # 5. What the run leaves: its timeline, its trained policy, its summary.
    train_wall_s = time.perf_counter() - started_training - sum(evals.wall_s.values())
    out.mkdir(parents=True, exist_ok=True)
    trace_path = rollouts.trace.to_json(out / "trace.json")
    if rollouts.trace.spans:  # a resumed run may have had nothing left to do
        draw_timeline(rollouts.trace.spans, out / "timeline.png", title=f"streamrl {module.mode}")
        print(f"timeline: {trace_path} -> {out / 'timeline.png'}", file=sys.stderr)
    summary: dict = kind.eval_summary(evals.results["before"], "before")
    summary["train_wall_s"] = train_wall_s
    summary.update(kind.eval_summary(evals.results["after"], "after"))
    summary.update(eval_wall_s={when: round(s, 3) for when, s in evals.wall_s.items()})
    if module.history:  # a resumed run may have had no iteration left
        summary.update(rl_summary(module, len(module.history)))
    summary.update(ledger(module), **kind.run_summary(module.rollouts.sampler))
    tokenizer.save_pretrained(out / "policy")  # beside the weights the ranks wrote
    summary.update(
        policy_dir=str(out / "policy"),  # `--config` with `model: <this dir>` goes on
        iterations=rl.iterations,
        model_dir=str(model_dir),
        output_dir=config.output_dir,
        wall_s=time.perf_counter() - started,
    )
    write_summary(summary, out)
    stages.files(out)
    stages.result(summary)
    return summary


def job_kind(config: RunConfig) -> JobKind:
    """The run's kind, its inputs checked: episodes when ``env.name`` is set, else prompts."""
    return EpisodeJob(config) if config.env.name is not None else PromptJob(config)


def generation_service(
    config: RunConfig,
    parts: RunParts,
    setup: RankSetup,
    policy: PreTrainedModel,
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> StreamGenerationService:
    """The run's stream generation service (§3), not started: its instances, engine, dispatcher
    and scheduler, where they run, and how each weight version reaches them."""
    rl = config.rl
    policy_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    return StreamGenerationService(
        model_dir,
        # The section's own arguments, its GPUs as the placement resolved them (the trainer's
        # left out); the rest is linked in from the run.
        **{**rl.generation, "gpu_ids": setup.placement.generator_gpus or None},
        engine=parts.engine,
        dispatcher=parts.dispatcher,
        scheduler=parts.scheduler,
        seed=config.seed,
        status_path=Path(config.output_dir) / "instances.json",
        cluster=rl.cluster,
        weights=rl.weights,
        timeouts=Timeouts.for_model(policy_bytes, rl.arg("rollouts", "max_tokens"), **rl.timeouts),
        profile_latency=(
            LatencyProfile.up_to(rl.arg("generation", "max_batch_size"), str(default_cache_dir()))
            if parts.latency is not None
            else None
        ),
        stop_token_ids=stop_token_ids(tokenizer),
        stop_strings=config.data.stop_strings,
        trainer_device=trainer_device(setup.placement),
    )


def follow_rank_zero(config: RunConfig, job: ClusterEnvironment, resume: str | None) -> dict:
    """The recipe of a launched trainer rank > 0: the same module and trainer as rank 0, without
    the generation service; it trains on the micro-batch shares rank 0 deals it."""
    wait_for_rank_zero(rank_timeouts(config).prepare_s)  # rank 0 prepared the policy
    ignore_signals()  # a signal to every rank is rank 0's to act on: it stops this one
    L.seed_everything(config.seed, verbose=False)
    model_dir = job_kind(config).policy_dir(show_progress=False)
    hidden = AutoConfig.from_pretrained(model_dir, local_files_only=True).hidden_size
    setup = RankSetup.from_config(config, build_run_algorithm(config.rl, hidden), job, model_dir)
    pin_threads(setup.placement, model_dir)
    module = setup.module(setup.empty_policy(model_dir), None)  # it reads its own shards
    wait_for_rank_zero(setup.timeouts.prepare_s)  # rank 0's generators run, its evaluation done
    setup.trainer(module).fit(module, ckpt_path=resume)
    dist.destroy_process_group()
    return {"trainer_rank": job.global_rank(), "output_dir": config.output_dir}
