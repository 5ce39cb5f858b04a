"""GRPO: group-relative advantages and a clipped policy-gradient loss (DeepSeekMath, 2024)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamrl.algorithms.base import Algorithm, LossInputs
from streamrl.tasks.rewards import RewardFn


class GRPO(Algorithm):
    """Group Relative Policy Optimization.

    Each prompt is sampled ``group_size`` times; a sample's advantage is its reward minus the
    group mean, over the group standard deviation. The loss is PPO's clipped surrogate with the
    generator's behaviour log-probs as the old policy, averaged over each sample's tokens, plus an
    optional KL penalty to a reference policy (the k3 estimator).

    Args:
        reward_fn: rule-based reward.
        group_size: samples per prompt.
        clip_eps: PPO clip range.
        kl_coef: weight of the KL penalty; 0 disables it (and the reference model).

    Example:
        >>> from streamrl.tasks import partial_credit
        >>> GRPO(partial_credit, group_size=2).score_group([1.0, 0.0])
        [0.7071..., -0.7071...]  # doctest: +SKIP
    """

    def __init__(
        self, reward_fn: RewardFn, group_size: int = 8, clip_eps: float = 0.2, kl_coef: float = 0.0
    ) -> None:
        super().__init__(reward_fn)
        if group_size < 2:
            raise ValueError(f"GRPO needs group_size >= 2 to compare samples, got {group_size}.")
        self.group_size, self.clip_eps, self.kl_coef = group_size, clip_eps, kl_coef

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        r = torch.tensor(rewards, dtype=torch.float64)
        std = r.std(unbiased=False)
        if std < 1e-8:  # every sample equally good: nothing to learn from this group
            return [0.0] * len(rewards)
        return ((r - r.mean()) / (std + 1e-6)).tolist()

    def loss(self, batch: LossInputs) -> torch.Tensor:
        ratio = torch.exp(batch.logprobs - batch.old_logprobs)  # [batch, seq]
        adv = batch.advantages.unsqueeze(1)  # [batch, 1]
        clipped = torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps)
        per_token = -torch.minimum(ratio * adv, clipped * adv)  # [batch, seq]
        if self.kl_coef > 0 and batch.ref_logprobs is not None:
            log_ratio = batch.ref_logprobs - batch.logprobs
            per_token = per_token + self.kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
        mask = batch.mask.to(per_token.dtype)
        return (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # [batch]
