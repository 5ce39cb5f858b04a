"""REINFORCE++ (Hu 2025, arXiv 2501.03262): advantages normalised over the batch, not the group.

REINFORCE++ whitens advantages over the whole global batch. A streaming trainer has no whole
batch: groups are scored and trained on one at a time as they arrive (StreamRL §4.1, dynamic-batch
pipelining), and whole-batch statistics are exactly the batch barrier it removes; the paper does
not say how such "whole-batch steps" (advantage whitening) fit its pipeline. We normalise with
running statistics of the stream instead: an exponentially weighted mean and variance over about
the last ``norm_window`` values, including the group being scored. What that costs:

- a group is normalised by statistics of groups that arrived before it (and itself), not by the
  batch it is trained in, so the advantages of one iteration are not exactly zero-mean, unit-std;
- the very first groups of a run are normalised by few samples (the first by itself alone);
- with ``norm_window`` about one iteration's samples the statistics lag the batch's by roughly
  half an iteration, which tracks the policy as its rewards drift.

For the "with baseline" variant each group's mean is subtracted first, so every group's values sum
to 0 and the running mean is exactly 0: only the standard deviation comes from the stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from streamrl.algorithms.base import Algorithm, LossInputs
from streamrl.algorithms.losses import policy_loss
from streamrl.tasks.rewards import RewardFn


class RunningMoments:
    """Exponentially weighted mean and standard deviation of a stream of numbers.

    Each new value has weight 1 and every older one is discounted by ``1 - 1 / window`` per new
    value, so about the last ``window`` values count; ``window=None`` weighs all values equally.

    Examples:
        >>> m = RunningMoments(window=None)
        >>> m.update([1.0, 0.0, 1.0, 1.0]); (m.mean, round(m.std, 4))
        (0.75, 0.433)
    """

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"RunningMoments: window must be >= 1 or None, got {window}.")
        self.decay = 1.0 if window is None else 1.0 - 1.0 / window
        self.weight, self.total, self.total_sq = 0.0, 0.0, 0.0

    def update(self, values: Sequence[float]) -> None:
        """Add ``values`` (treated as arriving together, with equal weight)."""
        keep = self.decay ** len(values)
        self.weight = self.weight * keep + len(values)
        self.total = self.total * keep + sum(values)
        self.total_sq = self.total_sq * keep + sum(v * v for v in values)

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight else 0.0

    @property
    def std(self) -> float:
        if not self.weight:
            return 0.0
        return math.sqrt(max(0.0, self.total_sq / self.weight - self.mean**2))

    def state_dict(self) -> dict:
        return {"weight": self.weight, "total": self.total, "total_sq": self.total_sq}

    def load_state_dict(self, state: dict) -> None:
        self.weight, self.total = float(state["weight"]), float(state["total"])
        self.total_sq = float(state["total_sq"])


class ReinforcePlusPlus(Algorithm):
    """REINFORCE++ and REINFORCE++-baseline with stream-normalised advantages.

    ``A = (x - mean) / std`` where ``x`` is the sample's reward (``baseline=False``) or its reward
    minus its group's mean (``baseline=True``), and mean / std are running statistics of the
    stream (see the module docstring). The loss is the shared clipped surrogate. REINFORCE++
    folds a k1 KL penalty into each token's return; here the KL stays a k3 loss term as in GRPO,
    because reference log-probs exist only at loss time, after advantages are fixed.

    Args:
        reward_fn: rule-based reward.
        group_size: samples per prompt (1 is fine without baseline; >= 2 with it).
        clip_eps: PPO clip range.
        kl_coef: weight of the k3 KL penalty; 0 disables it.
        baseline: subtract each group's mean reward first (REINFORCE++-baseline).
        norm_window: about how many recent values the statistics cover; one iteration's samples
            is a good choice (the paper's global batch, 1024, by default); ``None``: all.

    Examples:
        >>> from streamrl.tasks import partial_credit
        >>> algo = ReinforcePlusPlus(partial_credit, group_size=2, norm_window=None)
        >>> algo.score_group([1.0, 0.0]), algo.score_group([1.0, 1.0])  # doctest: +SKIP
        ([1.0, -1.0], [0.577, 0.577])
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        group_size: int = 1,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        *,
        baseline: bool = False,
        norm_window: int | None = 1024,
    ) -> None:
        super().__init__(reward_fn)
        need = 2 if baseline else 1
        if group_size < need:
            name = "REINFORCE++-baseline" if baseline else "REINFORCE++"
            raise ValueError(f"{name} needs group_size >= {need}, got {group_size}.")
        self.group_size, self.clip_eps, self.kl_coef = group_size, clip_eps, kl_coef
        self.baseline = baseline
        self.moments = RunningMoments(norm_window)

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        x = [r - sum(rewards) / len(rewards) for r in rewards] if self.baseline else list(rewards)
        self.moments.update(x)
        mean, std = self.moments.mean, self.moments.std
        if std < 1e-8:  # every value seen so far is equal: no signal yet
            return [0.0] * len(x)
        return [(v - mean) / (std + 1e-6) for v in x]

    def loss(self, batch: LossInputs) -> torch.Tensor:
        return policy_loss(batch, self.clip_eps, kl_coef=self.kl_coef)

    def state_dict(self) -> dict:
        return {"moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.moments.load_state_dict(state["moments"])


def reinforce_pp_baseline(
    reward_fn: RewardFn,
    group_size: int = 8,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    *,
    norm_window: int | None = 1024,
) -> ReinforcePlusPlus:
    """REINFORCE++-baseline: group mean subtracted, then stream-normalised (config name
    ``"reinforce++-baseline"``)."""
    return ReinforcePlusPlus(
        reward_fn, group_size, clip_eps, kl_coef, baseline=True, norm_window=norm_window
    )
