"""What a single-turn run brings to the recipe (``streamrl.run.recipe``): prompt sets,
the warm start on them, the held-out evaluation with the run's reward; its sampler is the
generation service itself (one completion per sample, scored by the run's reward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import datasets
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from streamrl.components.generation.service import StreamGenerationService
from streamrl.eval.heldout import EvalResult, evaluate
from streamrl.eval.on_generators import ServiceDecoder
from streamrl.policy.chat import completion_text, render_prompt, stop_token_ids
from streamrl.protocols import Sampler
from streamrl.rewards.deadline import with_deadline
from streamrl.rewards.spec import load_rewards
from streamrl.run.config import RunConfig
from streamrl.run.parts import reward_specs, reward_timeout_s
from streamrl.run.prepare import ensure_policy, prepare_run


class JobKind(Protocol):
    """What single-turn runs (``PromptJob``) and episode runs (``EpisodeJob``) differ in: their
    rows and warm start, their evaluator and their sampler; the rest is the recipe
    (``streamrl.run.recipe``)."""

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


class PromptJob:
    """A single-turn run of ``config``: its inputs are checked here (``prepare_run``).

    Attributes:
        train / heldout: the prompt sets.
        unit: what the held-out set counts (for the stage headings).
    """

    unit = "prompts"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.run = prepare_run(config)  # every input check happens here, before any training
        self.train: datasets.Dataset = self.run.train
        self.heldout: datasets.Dataset = self.run.heldout

    def policy_dir(self, show_progress: bool) -> Path:
        """Yours (``model``), or the tiny policy warm-started on the prompts (cached)."""
        return ensure_policy(self.config, self.run, show_progress=show_progress)

    def context(self, model_config: PretrainedConfig) -> int:
        return self.run.context

    def evaluator(
        self, tokenizer: PreTrainedTokenizerBase, context: int
    ) -> Callable[[StreamGenerationService, int], EvalResult]:
        return heldout_evaluator(self.config, tokenizer, self.heldout, context)

    def sampler(
        self, tokenizer: PreTrainedTokenizerBase, context: int
    ) -> Callable[[StreamGenerationService], Sampler] | None:
        """``None``: the service samples (one completion per sample)."""
        return None

    def eval_summary(self, result: EvalResult, when: str) -> dict:
        """The summary's held-out figures of one evaluation (``before`` or ``after`` RL)."""
        out = {
            f"heldout_acc_{when}": result.accuracy,
            f"heldout_reward_{when}": result.reward,
            f"heldout_pass1_{when}": result.pass_at_1,
            f"heldout_by_task_{when}": result.by_task,
            f"accuracy_by_task_{when}": result.accuracy_by_task,
        }
        if result.pass_at_k is not None:
            out[f"heldout_pass{result.k}_{when}"] = result.pass_at_k
        if when == "before":  # the starting policy's output lengths
            out.update(
                length_median=result.length_median,
                length_p90=result.length_p90,
                length_max=result.length_max,
            )
        return out

    def run_summary(self, sampler: Sampler) -> dict:
        """Nothing besides the ledger: a completion is one request."""
        return {}


def heldout_evaluator(
    config: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    heldout: datasets.Dataset,
    context: int,
) -> Callable[[StreamGenerationService, int], EvalResult]:
    """``(service, version) -> EvalResult`` on the held-out rows, as training sees them: decoded
    on the run's generator instances once they hold ``version`` (``ServiceDecoder``), with the
    same chat rendering, stop tokens and strings, ``rl.eval``'s budget and pass@k, and the run's
    own reward (computed in this process)."""
    data, rl = config.data, config.rl
    rewards = load_rewards(reward_specs(rl))
    # in this process, each batch under the reward timeout: a reward that hangs stops the run
    score = with_deadline(lambda texts, rows: rewards.score(texts, rows)[0], reward_timeout_s(rl))

    def evaluator(service: StreamGenerationService, version: int) -> EvalResult:
        decoder = ServiceDecoder(service, context, min_weight_version=version)
        result = evaluate(
            decoder,
            tokenizer,
            heldout,
            max_new_tokens=rl.eval.budget(rl.arg("rollouts", "max_tokens")),
            score=score,
            encode=lambda row: render_prompt(
                tokenizer, row["prompt"], system_prompt=data.system_prompt, chat=data.chat_template
            ),
            decode=lambda ids: completion_text(tokenizer, ids, stop_strings=data.stop_strings),
            eos_token_ids=stop_token_ids(tokenizer),
            k=rl.eval.k,
            seed=config.seed,
        )
        result.weight_versions = sorted(decoder.versions_seen)
        return result

    return evaluator
