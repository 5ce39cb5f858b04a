"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from streamrl.algorithms.base import Algorithm, LossInputs, TokenLoss
from streamrl.algorithms.losses import policy_token_loss


class RLOO(Algorithm):
    """REINFORCE Leave-One-Out.

    Each of a prompt's ``k`` samples is baselined by the mean reward of the *other* ``k - 1``:
    ``A_i = r_i - (sum_j r_j - r_i) / (k - 1)``, an unbiased baseline (it does not depend on
    sample ``i``). The loss is the same clipped surrogate as GRPO's (``policy_token_loss``); with
    on-policy samples the ratio is 1 and it reduces to RLOO's REINFORCE gradient.

    Args:
        group_size: samples per prompt (``k >= 2``).
        clip_eps: PPO clip range.
        kl_coef: weight of the k3 KL penalty to the reference policy; 0 disables it.

    Examples:
        >>> RLOO(group_size=3).score_group([1.0, 0.0, 0.5])
        [0.75, -0.75, 0.0]
    """

    min_group_size: ClassVar[int] = 2
    group_size_reason: ClassVar[str] = "for a leave-one-out baseline"

    def __init__(
        self,
        *,
        group_size: int = 8,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
    ) -> None:
        super().__init__(group_size=group_size, clip_eps=clip_eps, kl_coef=kl_coef)

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        r = torch.tensor(rewards, dtype=torch.float64)
        others_mean = (r.sum() - r) / (len(rewards) - 1)
        return (r - others_mean).tolist()

    def token_loss(self, batch: LossInputs) -> TokenLoss:
        return policy_token_loss(batch, self.clip_eps, kl_coef=self.kl_coef)
