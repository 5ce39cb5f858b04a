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
from typing import Any, ClassVar

from streamrl.algorithms.base import Algorithm, LossInputs, RunFacts, TokenLoss
from streamrl.algorithms.losses import policy_token_loss


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
    """REINFORCE++ with stream-normalised advantages (config name ``"reinforce++"``).

    ``A = (x - mean) / std`` where ``x`` is the sample's reward (here) or its reward minus its
    group's mean (``ReinforcePlusPlusBaseline``), and mean / std are running statistics of the
    stream (see the module docstring). The loss is the shared clipped surrogate. REINFORCE++
    folds a k1 KL penalty into each token's return; here the KL stays a k3 loss term as in GRPO,
    because reference log-probs exist only at loss time, after advantages are fixed.

    Args:
        group_size: samples per prompt (1 is fine here; ``ReinforcePlusPlusBaseline`` needs 2).
        clip_eps: PPO clip range.
        kl_coef: weight of the k3 KL penalty; 0 disables it.
        norm_window: about how many recent values the statistics cover; one iteration's samples
            is a good choice and what ``from_run`` passes (the paper's global batch, 1024, by
            default); ``None``: all.

    Examples:
        >>> algo = ReinforcePlusPlus(group_size=2, norm_window=None)
        >>> algo.score_group([1.0, 0.0]), algo.score_group([1.0, 1.0])  # doctest: +SKIP
        ([1.0, -1.0], [0.577, 0.577])
    """

    display_name: ClassVar[str] = "REINFORCE++"
    #: Subtract each group's mean reward before normalising (REINFORCE++-baseline).
    baseline: ClassVar[bool] = False

    def __init__(
        self,
        *,
        group_size: int = 1,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        norm_window: int | None = 1024,
    ) -> None:
        super().__init__(group_size=group_size, clip_eps=clip_eps, kl_coef=kl_coef)
        self.moments = RunningMoments(norm_window)

    @classmethod
    def from_run(cls, run: RunFacts, **options: Any) -> Algorithm:
        """Normalises over about one iteration's samples (``run.samples_per_iteration``)."""
        options.setdefault("norm_window", run.samples_per_iteration)
        return super().from_run(run, **options)

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        x = [r - sum(rewards) / len(rewards) for r in rewards] if self.baseline else list(rewards)
        self.moments.update(x)
        mean, std = self.moments.mean, self.moments.std
        if std < 1e-8:  # every value seen so far is equal: no signal yet
            return [0.0] * len(x)
        return [(v - mean) / (std + 1e-6) for v in x]

    def token_loss(self, batch: LossInputs) -> TokenLoss:
        return policy_token_loss(batch, self.clip_eps, kl_coef=self.kl_coef)

    def state_dict(self) -> dict:
        return {"moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.moments.load_state_dict(state["moments"])


class ReinforcePlusPlusBaseline(ReinforcePlusPlus):
    """REINFORCE++-baseline: each group's mean reward subtracted, then stream-normalised (config
    name ``"reinforce++-baseline"``). Same arguments as ``ReinforcePlusPlus``, with
    ``group_size`` >= 2 (8 by default).

    Examples:
        >>> algo = ReinforcePlusPlusBaseline(group_size=2, norm_window=None)
        >>> [round(a, 4) for a in algo.score_group([1.0, 0.0])]  # x = [0.5, -0.5]
        [1.0, -1.0]
        >>> algo.score_group([1.0, 1.0])  # x = [0, 0]: the stream's mean, whatever its std
        [0.0, 0.0]
    """

    display_name: ClassVar[str] = "REINFORCE++-baseline"
    min_group_size: ClassVar[int] = 2
    group_size_reason: ClassVar[str] = "to subtract a group mean (plain reinforce++ takes 1)"
    baseline: ClassVar[bool] = True

    def __init__(
        self,
        *,
        group_size: int = 8,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        norm_window: int | None = 1024,
    ) -> None:
        super().__init__(
            group_size=group_size,
            clip_eps=clip_eps,
            kl_coef=kl_coef,
            norm_window=norm_window,
        )
