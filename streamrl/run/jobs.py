"""The jobs behind ``streamrl fit`` and ``streamrl demo``: plain functions a notebook can call.

``run_fit`` is the whole main job, top to bottom: check inputs, warm-start, evaluate, start the
stream generation service, let Lightning drive the disaggregated RL loop, evaluate again, save
the policy. Single-turn runs (``PromptJob``) and multi-turn episode runs (``EpisodeJob``) share
it; they differ only in their rows, warm start, evaluator and sampler.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.errors import ConfigError
from streamrl.policy.models import load_tokenizer
from streamrl.protocols import Sampler
from streamrl.run.config import RunConfig
from streamrl.run.config_checks import check_values, placement_of
from streamrl.run.episode_fit import EpisodeJob
from streamrl.run.parts import build_run_algorithm, check_parts
from streamrl.run.prompt_job import PromptJob
from streamrl.run.reruns import finished_run, resolve_resume
from streamrl.run.rl_job import HeldoutEvals, ledger, rl_summary, train_rl, write_summary
from streamrl.run.stages import RunStages
from streamrl.run.trainer_ranks import (
    RankSetup,
    join_launched_job,
    launched_job,
    pin_threads,
    rank_timeouts,
    wait_for_rank_zero,
)
from streamrl.runtime.stopping import ignore_signals


class JobKind(Protocol):
    """What single-turn runs (``PromptJob``) and episode runs (``EpisodeJob``) differ in: their
    rows and warm start, their evaluator and their sampler; the rest of a job is one body."""

    unit: str
    train: Sequence
    heldout: Sequence

    def policy_dir(self, show_progress: bool) -> Path: ...

    def context(self, model_config: PretrainedConfig) -> int: ...

    def evaluator(
        self, tokenizer: PreTrainedTokenizerBase, context: int
    ) -> Callable[[StreamGenerationService, int], Any]: ...

    def sampler(
        self, tokenizer: PreTrainedTokenizerBase, context: int
    ) -> Callable[[StreamGenerationService], Sampler] | None: ...

    def eval_summary(self, result: Any, when: str) -> dict: ...

    def run_summary(self, sampler: Sampler) -> dict: ...


def job_kind(config: RunConfig) -> JobKind:
    """The run's kind, its inputs checked: episodes when ``env.name`` is set, else prompts."""
    return EpisodeJob(config) if config.env.name is not None else PromptJob(config)


def run_fit(
    config: RunConfig,
    show_progress: bool = True,
    resume: str | None = None,
    stages: RunStages | None = None,
) -> dict:
    """Run the main job and return its summary (also written to ``<output_dir>/summary.json``).

    Single-turn runs and episode runs (``env.name``) go through the same body; they differ only
    in their ``JobKind``: rows, warm start, evaluator and sampler.

    Args:
        config: the run's settings.
        show_progress: draw progress bars on stderr.
        resume: a checkpoint (``<output_dir>/checkpoints/last.ckpt``) to continue from, or
            ``"auto"``: the output directory's last checkpoint, if any. Without it, an output
            directory that holds an earlier run's checkpoints is refused (``reruns``).
        stages: the stage headings printed on stderr (``streamrl demo`` gives their expected
            lengths); by default ``RunStages()``.

    Returns:
        ``reward_first`` / ``reward_last`` (mean reward of the first / last 3 iterations), the
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
    started = time.perf_counter()
    done = finished_run(config.output_dir, resume, config.rl.iterations)
    if done is not None and launched_job() is None:
        print(
            f"streamrl fit: {config.output_dir} finished its {done['iterations']} iterations "
            "already; nothing to do (its summary.json is kept and printed). Raise "
            "rl.iterations to go on, or start a new run in another output_dir.",
            file=sys.stderr,
        )
        return done
    # Every extension point resolves and fits where the trainer runs, before any work.
    check_parts(config.rl, placement_of(config))
    job = launched_job()  # torchrun or SLURM started this process as one of several ranks
    if job is not None:
        check_launched(config, job.world_size())
        join_launched_job(job, placement_of(config), rank_timeouts(config))
        if job.global_rank() > 0:
            return _follow_rank_zero(config, job, resume)
    L.seed_everything(config.seed, verbose=False)
    kind = job_kind(config)  # every input check happens here, before any training
    stages.policy(config)
    model_dir = kind.policy_dir(progress)
    if job is not None:  # the other ranks build the policy now
        wait_for_rank_zero(rank_timeouts(config, model_dir).prepare_s)
    tokenizer = load_tokenizer(model_dir)
    context = kind.context(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    evals = HeldoutEvals(
        kind.evaluator(tokenizer, context),
        every=config.rl.eval.every,
        output_dir=config.output_dir,
        announce=lambda when: stages.evaluation(when, len(kind.heldout), kind.unit),
        zero_hint=zero_reward_hint(config),
    )
    started_training = time.perf_counter()
    module = train_rl(
        config,
        kind.train,
        context,
        model_dir,
        tokenizer,
        progress,
        resume,
        job,
        sampler=kind.sampler(tokenizer, context),
        evals=evals,
        announce_rl=lambda: stages.rl(config),
    )
    summary: dict = kind.eval_summary(evals.results["before"], "before")
    summary["train_wall_s"] = time.perf_counter() - started_training - sum(evals.wall_s.values())
    summary.update(kind.eval_summary(evals.results["after"], "after"))
    summary.update(eval_wall_s={when: round(s, 3) for when, s in evals.wall_s.items()})
    if module.history:  # a resumed run may have had no iteration left
        summary.update(rl_summary(module, len(module.history)))
    summary.update(ledger(module), **kind.run_summary(module.rollouts.sampler))
    # The trained policy as a model directory (its weights written by the trainer ranks):
    # `--config` with `model: <this dir>` goes on.
    trained = Path(config.output_dir) / "policy"
    tokenizer.save_pretrained(trained)
    summary["policy_dir"] = str(trained)
    write_summary(summary, config, model_dir, started)
    stages.files(config.output_dir)
    stages.result(summary)
    return summary


def zero_reward_hint(config: RunConfig) -> str:
    """What to change when a run's policy earns no reward before RL (``HeldoutEvals``)."""
    if config.model != "tiny":
        return (
            "check the reward on a few completions (streamrl bench reward) and the prompt "
            "format (data.chat_template, data.system_prompt), or warm-start the model first."
        )
    if config.data.path or config.data.prompt_file:
        return (
            "the tiny policy's warm start learned too little of your task: try sft.tokenizer: "
            "char (one id per character: copying and reversing text), more training rows, or "
            "more sft.steps (docs/own-task.md)."
        )
    return "give the warm start more sft.steps (or sft.model_size: demo)."


def check_launched(config: RunConfig, world: int) -> None:
    """Under an external launcher the trainer ranks are the launcher's; ``ConfigError`` if the
    config asks for another number (it would spawn ranks of its own on top)."""
    devices = config.trainer.devices
    asked = len(devices) if isinstance(devices, list) else (devices or 1)
    asked *= config.trainer.num_nodes
    if asked not in (1, world):
        raise ConfigError(
            f"The launcher started {world} trainer ranks but trainer.devices x "
            f"trainer.num_nodes is {asked}; leave them unset or ask for {world} (under torchrun "
            "or SLURM the launcher's processes are the ranks)."
        )


def _follow_rank_zero(config: RunConfig, job: ClusterEnvironment, resume: str | None) -> dict:
    """A launched trainer rank > 0: the same module and trainer as rank 0, without the
    generation service; it trains on the micro-batch shares rank 0 deals it."""
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
