"""What a multi-turn run (``env.name`` set) brings to the recipe (``streamrl.run.recipe``):
the environment's rows, the tiny policy's warm start on demonstrated episodes (cached), held-out
success (greedy episodes), and its sampler: an ``EpisodeRunner`` on the generation service, whose
environments reward the samples. Its summary adds ``heldout_success_before`` / ``_after``, the
episodes' ledger and how much prefill the kept prefixes saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.envs.demos import episode_tokenizer, sft_on_episodes
from streamrl.envs.runner import EpisodeRunner
from streamrl.errors import ConfigError
from streamrl.eval.episodes import EpisodeEval, evaluate_episodes
from streamrl.policy.models import build_tiny_model
from streamrl.protocols import Sampler
from streamrl.run.config import RunConfig
from streamrl.run.episode_task import ENVIRONMENTS, EpisodeTask, episode_task
from streamrl.run.prepare import TINY_CONTEXT, cached_warm_start
from streamrl.runtime.cache_keys import code_digest, rows_digest
from streamrl.tasks.local_data import check_enough_rows

#: Bump when the warm start on episodes changes, so stale caches are not reused.
EPISODE_RECIPE_VERSION = 1


class EpisodeJob:
    """A multi-turn run of ``config``: its environment is checked here (``episode_task``).

    Attributes:
        train / heldout: the environment's rows.
        unit: what the held-out set counts (for the stage headings).
    """

    unit = "episodes"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.task = episode_task(config)
        check_enough_rows(
            self.task.train, config.rl.prompts_per_iteration, f"env {config.env.name!r}"
        )
        self.train, self.heldout = self.task.train, self.task.heldout

    def policy_dir(self, show_progress: bool) -> Path:
        return episode_policy(self.config, self.task, show_progress)

    def context(self, model_config: PretrainedConfig) -> int:
        return int(model_config.max_position_embeddings)

    def evaluator(
        self, tokenizer: PreTrainedTokenizerBase, context: int
    ) -> Callable[[StreamGenerationService, int], EpisodeEval]:
        """Greedy episodes on the run's generator instances, once they hold the version."""
        env, rl = self.config.env, self.config.rl

        def evaluator(service: StreamGenerationService, version: int) -> EpisodeEval:
            return evaluate_episodes(
                service,
                tokenizer,
                self.task.make_env,
                self.task.heldout,
                max_tokens=rl.eval.budget(rl.arg("rollouts", "max_tokens")),
                context=context,
                max_turns=env.max_turns,
                env_timeout_s=env.timeout_s,
                min_weight_version=version,
            )

        return evaluator

    def sampler(
        self, tokenizer: PreTrainedTokenizerBase, context: int
    ) -> Callable[[StreamGenerationService], Sampler]:
        """Makes the ``EpisodeRunner`` on the started service."""
        config, env = self.config, self.config.env

        def make(service: StreamGenerationService) -> EpisodeRunner:
            return EpisodeRunner(
                service,
                self.task.make_env,
                tokenizer,
                max_tokens=config.rl.arg("rollouts", "max_tokens"),
                context=context,
                max_turns=env.max_turns,
                env_timeout_s=env.timeout_s,
                rebalance_requests=env.rebalance_requests,
                system_prompt=config.data.system_prompt,
                stop_strings=config.data.stop_strings,
                on_fault=env.on_fault,
                env_workers=env_workers(config),
                max_env_restarts=env.max_restarts,
                env_status_path=str(Path(config.output_dir) / "env_workers.json"),
            )

        return make

    def eval_summary(self, result: EpisodeEval, when: str) -> dict:
        return {
            f"heldout_success_{when}": result.success,
            f"heldout_reward_{when}": result.reward,
            f"heldout_turns_{when}": result.turns,
            f"heldout_finish_{when}": result.finish_reasons,
        }

    def run_summary(self, sampler: EpisodeRunner) -> dict:
        """The episodes' ledger: samples are episodes (``samples_generated``, the ledger's),
        each of several requests (``turns``, this start's)."""
        counts = sampler.counts
        return {
            "env": self.config.env.name,
            "turns": counts["turns"],
            "episode_counts": dict(counts),
            "prefill_saved": sampler.prefill_saved,
        }


def env_workers(config: RunConfig) -> int:
    """``env.workers``, or its default: 2 processes for your environment, threads (0) for the
    built-in ones (pure Python, ours)."""
    if config.env.workers is not None:
        return config.env.workers
    return 0 if config.env.name in ENVIRONMENTS else 2


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
    sft, demonstrate = config.sft, task.demonstrate
    parts = {
        "rows": rows_digest(task.train),
        "environment code": code_digest(task.make_env),
        "demonstrations code": code_digest(demonstrate),
    }

    def train(options: dict) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list]:
        # The vocabulary is learned from rendered demonstrations: what the policy reads, writes.
        tokenizer = episode_tokenizer(task.train, task.make_env, demonstrate)
        model = build_tiny_model(tokenizer, size=sft.model_size, max_positions=TINY_CONTEXT)
        losses = sft_on_episodes(
            task.train,
            make_env=task.make_env,
            demonstrate=demonstrate,
            tokenizer=tokenizer,
            model=model,
            **options,
        )
        return model, tokenizer, losses

    recipe = {"recipe": EPISODE_RECIPE_VERSION, "env": asdict(config.env)}
    return cached_warm_start(config, "sft-episodes", recipe, parts, train, show_progress)
