"""``streamrl fit`` with ``env.name`` set: RL on multi-turn episodes, top to bottom.

The same job as ``streamrl.run.jobs.run_fit``, with episodes for samples: check the inputs,
warm-start the tiny policy on demonstrated episodes (cached), measure held-out success, stream
episodes from the generation service through the ``EpisodeRunner`` into the Lightning-driven loop,
measure again. The summary holds ``heldout_success_before`` / ``_after``, the episodes' ledger and
how much prefill the kept prefixes saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import lightning as L
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.envs.demos import episode_tokenizer, sft_on_episodes
from streamrl.envs.runner import EpisodeRunner
from streamrl.errors import ConfigError
from streamrl.eval.episodes import EpisodeEval, evaluate_episodes
from streamrl.policy.models import build_tiny_model, load_policy, save_policy
from streamrl.policy.sft import progress_path, save_cached_policy
from streamrl.run.config import RunConfig
from streamrl.run.config_checks import check_values, placement_of
from streamrl.run.episode_task import EpisodeTask, episode_task
from streamrl.run.parts import check_parts
from streamrl.run.prepare import TINY_CONTEXT, recipe_dir, settings
from streamrl.run.rl_job import ledger, rl_summary, train_rl, train_with_eval, write_summary
from streamrl.run.stages import RunStages
from streamrl.runtime.cache_keys import announce_reuse, code_digest, rows_digest
from streamrl.tasks.local_data import check_enough_rows

#: Bump when the warm start on episodes changes, so stale caches are not reused.
EPISODE_RECIPE_VERSION = 1


def run_episode_fit(
    config: RunConfig,
    show_progress: bool = True,
    resume: str | None = None,
    stages: RunStages | None = None,
) -> dict:
    """Train on ``config.env``'s episodes; returns the summary (also ``summary.json``);
    ``stages``: the headings on stderr (``streamrl.run.jobs.run_fit``)."""
    started = time.perf_counter()
    check_values(config)
    check_parts(config.rl, placement_of(config))
    env, rl = config.env, config.rl
    if placement_of(config).ranks != 1:
        raise ConfigError("env: episode runs train on one trainer rank; set trainer.devices: 1.")
    L.seed_everything(config.seed, verbose=False)
    task = episode_task(config)
    check_enough_rows(task.train, rl.prompts_per_iteration, f"env {env.name!r}")
    stages = stages or RunStages()
    stages.policy(config)
    model_dir = episode_policy(config, task, show_progress)
    policy, tokenizer = load_policy(model_dir)
    context = int(policy.config.max_position_embeddings)

    def evaluator(model: PreTrainedModel) -> EpisodeEval:
        return evaluate_episodes(
            model,
            tokenizer,
            task.make_env,
            task.heldout,
            max_tokens=rl.max_tokens,
            context=context,
            max_turns=env.max_turns,
            env_timeout_s=env.timeout_s,
        )

    stages.evaluation("before", len(task.heldout), "episodes")
    before = evaluator(policy)
    summary: dict = {**_eval_summary(before, "before"), "env": env.name}
    stages.rl(config)
    module, policy, after, summary["train_wall_s"] = train_with_eval(
        config,
        evaluator,
        before,
        lambda callbacks: train_rl(
            config,
            task.train,
            context,
            model_dir,
            (policy, tokenizer),
            show_progress,
            resume,
            callbacks=callbacks,
            episodes=_runner_factory(config, task, tokenizer, context),
        ),
        lambda: stages.evaluation("after", len(task.heldout), "episodes"),
    )
    summary.update(_eval_summary(after, "after"))
    if module.history:
        summary.update(rl_summary(module, len(module.history)))
    summary.update(ledger(module))
    summary["prefill_saved"] = module.rollouts.episodes.prefill_saved
    trained = save_policy(policy, tokenizer, Path(config.output_dir) / "policy")
    summary["policy_dir"] = str(trained)
    write_summary(summary, config, model_dir, started)
    stages.files(config.output_dir)
    return summary


def _runner_factory(
    config: RunConfig, task: EpisodeTask, tokenizer: PreTrainedTokenizerBase, context: int
) -> Callable[[StreamGenerationService], EpisodeRunner]:
    env = config.env

    def make(service: StreamGenerationService) -> EpisodeRunner:
        return EpisodeRunner(
            service,
            task.make_env,
            tokenizer,
            max_tokens=config.rl.max_tokens,
            context=context,
            max_turns=env.max_turns,
            env_timeout_s=env.timeout_s,
            rebalance_requests=env.rebalance_requests,
            system_prompt=config.data.system_prompt,
            stop_strings=config.data.stop_strings,
            on_fault=env.on_fault,
        )

    return make


def _eval_summary(result: EpisodeEval, when: str) -> dict:
    return {
        f"heldout_success_{when}": result.success,
        f"heldout_reward_{when}": result.reward,
        f"heldout_turns_{when}": result.turns,
        f"heldout_finish_{when}": result.finish_reasons,
    }


def episode_policy(config: RunConfig, task: EpisodeTask, show_progress: bool) -> Path:
    """The policy directory: yours (``model``), or the tiny policy warm-started on one
    demonstrated episode per training row, with a byte-level BPE learned from those episodes
    (cached by the recipe)."""
    if config.model != "tiny":
        return Path(config.model)
    if task.demonstrate is None:
        raise ConfigError(
            f"env.name: {config.env.name!r} has no demonstrations for the tiny policy's warm "
            "start; set env.demonstrations (fn(row) -> [turn, ...]) or pass model: <your dir>."
        )
    sft = config.sft
    parts = {
        "rows": rows_digest(task.train),
        "environment code": code_digest(task.make_env),
        "demonstrations code": code_digest(task.demonstrate),
    }
    recipe = {
        "recipe": EPISODE_RECIPE_VERSION,
        "sft": settings(sft),
        "env": asdict(config.env),
        "seed": config.seed,
        **parts,
    }
    target = recipe_dir(config, f"sft-episodes-{sft.model_size}", recipe)
    if sft.cache and (target / "sft_meta.json").is_file():
        announce_reuse(target, parts)
        return target
    # The vocabulary is learned from rendered demonstrations: what the policy reads and writes.
    tokenizer = episode_tokenizer(task.train, task.make_env, task.demonstrate)
    model = build_tiny_model(tokenizer, size=sft.model_size, max_positions=TINY_CONTEXT)
    started = time.perf_counter()
    losses = sft_on_episodes(
        task.train,
        make_env=task.make_env,
        demonstrate=task.demonstrate,
        tokenizer=tokenizer,
        model=model,
        steps=sft.steps,
        lr=sft.lr,
        tokens_per_batch=sft.tokens_per_batch,
        seed=config.seed,
        show_progress=show_progress,
        progress_file=progress_path(target),
    )
    meta = {"recipe": recipe, "losses": losses, "train_s": time.perf_counter() - started}
    return save_cached_policy(model, tokenizer, target, meta)
