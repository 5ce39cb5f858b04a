"""The jobs behind ``streamrl fit`` and ``streamrl demo``: plain functions a notebook can call.

``run_fit`` is the whole main job, top to bottom: check inputs, warm-start, evaluate, start the
stream generation service, let Lightning drive the disaggregated RL loop, evaluate again.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.errors import ConfigError
from streamrl.eval.heldout import EvalResult, evaluate
from streamrl.policy.chat import completion_text, render_prompt, stop_token_ids
from streamrl.policy.models import load_policy, save_policy
from streamrl.rewards.spec import load_rewards
from streamrl.run.config import RunConfig
from streamrl.run.config_checks import check_values, placement_of
from streamrl.run.parts import (
    build_run_algorithm,
    check_parts,
    reward_specs,
)
from streamrl.run.prepare import ensure_policy, prepare_run
from streamrl.run.reruns import resolve_resume
from streamrl.run.rl_job import ledger, rl_summary, train_rl, train_with_eval, write_summary
from streamrl.run.stages import RunStages
from streamrl.run.trainer_ranks import (
    RankSetup,
    join_launched_job,
    launched_job,
    pin_threads,
    wait_for_rank_zero,
)
from streamrl.runtime.stopping import ignore_signals


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
        ``heldout_acc_before`` / ``heldout_acc_after`` (greedy exact match on held-out prompts),
        ``samples_per_s`` (over the iterations' own time, ``rl_wall_s``), ``train_wall_s`` (the
        whole training call: service start, profiling, checkpoints, shutdown),
        ``trainer_wait_frac`` (share of RL time the trainer waited for samples), ``iterations``,
        ``wall_s``, the starting policy's output lengths, and
        ``policy_dir``: the trained policy saved as a model directory (``<output_dir>/policy``).
    """
    resume = resolve_resume(config.output_dir, resume)  # one output directory, one run
    if config.env.name is not None:  # multi-turn episodes: the same job, episode by episode
        from streamrl.run.episode_fit import run_episode_fit

        return run_episode_fit(config, show_progress, resume, stages)
    started = time.perf_counter()
    check_values(config)
    # Every extension point resolves and fits where the trainer runs, before any work.
    check_parts(config.rl, placement_of(config))
    job = launched_job()  # torchrun or SLURM started this process as one of several ranks
    if job is not None:
        check_launched(config, job.world_size())
        join_launched_job(job)
        if job.global_rank() > 0:
            return _follow_rank_zero(config, job, resume)
    L.seed_everything(config.seed, verbose=False)
    run = prepare_run(config)  # every input check happens here, before any training
    stages = stages or RunStages()
    stages.policy(config)
    model_dir = ensure_policy(config, run, show_progress=show_progress)
    if job is not None:
        wait_for_rank_zero()  # the other ranks load the policy now
    policy, tokenizer = load_policy(model_dir)
    evaluator = heldout_evaluator(config, tokenizer, run.heldout)
    stages.evaluation("before", len(run.heldout))
    before = evaluator(policy)
    summary: dict = {
        "heldout_acc_before": before.accuracy,
        **_eval_summary(before, "before"),
        "length_median": before.length_median,
        "length_p90": before.length_p90,
        "length_max": before.length_max,
    }
    stages.rl(config)
    module, policy, after, summary["train_wall_s"] = train_with_eval(
        config,
        evaluator,
        before,
        lambda callbacks: train_rl(
            config,
            run.train,
            run.context,
            model_dir,
            (policy, tokenizer),
            show_progress,
            resume,
            job,
            callbacks=callbacks,
        ),
        lambda: stages.evaluation("after", len(run.heldout)),
    )
    summary.update(_eval_summary(after, "after"))
    if module.history:  # a resumed run may have had no iteration left
        summary.update(rl_summary(module, len(module.history)))
    summary.update(ledger(module), heldout_acc_after=after.accuracy)
    summary["accuracy_by_task_after"] = after.accuracy_by_task
    # The trained policy as a model directory: `--config` with `model: <this dir>` goes on.
    trained = save_policy(_plain(policy), tokenizer, Path(config.output_dir) / "policy")
    summary["policy_dir"] = str(trained)
    summary["accuracy_by_task_before"] = before.accuracy_by_task
    write_summary(summary, config, model_dir, started)
    stages.files(config.output_dir)
    return summary


def heldout_evaluator(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, heldout: datasets.Dataset
) -> Callable[[PreTrainedModel], EvalResult]:
    """``policy -> EvalResult`` on the held-out rows, as training sees them: the same chat
    rendering, stop tokens and strings, and the run's own reward (computed in this process)."""
    data, rl = config.data, config.rl
    rewards = load_rewards(reward_specs(rl))

    def evaluator(policy: PreTrainedModel) -> EvalResult:
        return evaluate(
            policy,
            tokenizer,
            heldout,
            score=lambda completions, rows: rewards.score(completions, rows)[0],
            encode=lambda row: render_prompt(
                tokenizer, row["prompt"], system_prompt=data.system_prompt, chat=data.chat_template
            ),
            decode=lambda ids: completion_text(tokenizer, ids, stop_strings=data.stop_strings),
            eos_token_ids=stop_token_ids(tokenizer),
            k=rl.eval_k,
            seed=config.seed,
        )

    return evaluator


def _eval_summary(result: EvalResult, when: str) -> dict:
    """The summary's held-out figures of one evaluation (``before`` or ``after`` training)."""
    out = {
        f"heldout_reward_{when}": result.reward,
        f"heldout_pass1_{when}": result.pass_at_1,
        f"heldout_by_task_{when}": result.by_task,
    }
    if result.pass_at_k is not None:
        out[f"heldout_pass{result.k}_{when}"] = result.pass_at_k
    return out


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
    wait_for_rank_zero()  # rank 0 has prepared the policy (warm start, if any)
    ignore_signals()  # a signal to every rank is rank 0's to act on: it stops this one
    L.seed_everything(config.seed, verbose=False)
    model_dir = ensure_policy(config, prepare_run(config), show_progress=False)
    policy = load_policy(model_dir)[0]
    algorithm = build_run_algorithm(config.rl, policy.config.hidden_size)
    setup = RankSetup.from_config(config, algorithm, job)
    pin_threads(setup.placement)
    module = setup.module(setup.trainable(policy), None)
    setup.trainer(module).fit(module, ckpt_path=resume)
    dist.destroy_process_group()
    return {"trainer_rank": job.global_rank(), "output_dir": config.output_dir}


def _plain(policy: PreTrainedModel) -> PreTrainedModel:
    """The policy without LoRA wrappers (adapters merged into a copy), ready to save."""
    if hasattr(policy, "merge_and_unload"):
        return copy.deepcopy(policy).merge_and_unload()
    return policy
