"""Algorithm hooks that follow RL timing.

A sample is scored the moment it arrives (``score_sample``), a prompt's group once all its samples
are in (``score_group``: advantages; ``keep_group``: train on it or not), and a micro-batch when
the trainer reaches it (``loss``, with per-token values from ``token_values`` for algorithms with
a critic). A new algorithm overrides only the hooks it changes, in tens of lines; see
docs/algorithms.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from streamrl.records import Sample
from streamrl.tasks.rewards import RewardFn


class RewardError(ValueError):
    """A reward function raised or returned a non-finite value; names the prompt."""


@dataclass
class LossInputs:
    """Tensors of one micro-batch, all ``[batch, completion_len]`` unless noted.

    Attributes:
        logprobs: log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: behaviour log-probs recorded by the generator.
        advantages: one per sample, ``[batch]``: what ``score_group`` returned (for PPO, the
            sequence reward, which GAE turns into token advantages inside ``loss``).
        mask: 1 for real completion tokens, 0 for padding.
        ref_logprobs: log-probs under the frozen reference policy, or ``None`` without KL.
        values: the critic's value of the state before each completion token (with grad), from
            ``Algorithm.token_values``; ``None`` for algorithms without a critic.
        token_weights: truncated importance weights of stale samples' tokens in async mode
            (``streamrl.components.training.off_policy``); ``None`` when every sample is fresh.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None


class Algorithm:
    """Base class: reward from a rule, no advantage, no loss. Subclasses fill in the hooks.

    Args:
        reward_fn: scores a decoded completion against the reference answer.
    """

    #: How many samples each prompt needs before ``score_group`` can run.
    group_size: int = 1

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    def score_sample(self, sample: Sample, completion: str, answer: str) -> float:
        """Reward of one finished sample, computed on arrival.

        Raises:
            RewardError: the reward function raised or returned a non-finite number.
        """
        try:
            reward = float(self.reward_fn(completion, answer))
        except Exception as err:
            raise RewardError(
                f"Reward function failed on prompt {sample.prompt_id!r} (sample "
                f"{sample.sample_index}, instance {sample.instance_id}): {err!r}"
            ) from err
        if not math.isfinite(reward):
            raise RewardError(
                f"Reward function returned {reward} for prompt {sample.prompt_id!r} (sample "
                f"{sample.sample_index}); rewards must be finite numbers."
            )
        return reward

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        """Advantages of one prompt's samples, given their rewards (same order)."""
        raise NotImplementedError

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Whether a complete group is trained on; ``False`` filters it out (the rollout then
        asks the stream for another prompt). Default: keep every group."""
        del rewards
        return True

    def loss(self, batch: LossInputs) -> torch.Tensor:
        """Per-sample loss, ``[batch]``; the trainer sums it and divides by the iteration's
        samples (``RolloutStream.samples_per_iteration``)."""
        raise NotImplementedError

    def token_values(
        self,
        policy: torch.nn.Module,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        starts: torch.Tensor,
        width: int,
    ) -> torch.Tensor | None:
        """Critic values of each completion position, ``[batch, width]``, or ``None`` (default).

        Called by the trainer on every micro-batch, with the padded rows it feeds the policy.

        Args:
            policy: the policy being trained.
            input_ids: ``[batch, seq]``, each row ``prompt + completion + padding``.
            attention: ``[batch, seq]``, the attention mask of ``input_ids``.
            starts: ``[batch]``, where each row's completion starts.
            width: completion positions wanted.
        """
        del policy, input_ids, attention, starts, width
        return None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the algorithm owns (a value head) that the optimizer must update with the
        policy's. Default: none."""
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state
