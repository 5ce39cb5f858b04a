"""Group context: a group's finished samples tell how long its unfinished siblings will run.

Samples of one prompt have correlated lengths (Seer, 2026: "same-prompt responses have similar
lengths"). We model a group's log lengths as ``y_j = m + e_j``: ``m`` the prompt's own level,
known to the ranker up to ``tau`` (``m ~ N(mu, tau)``), ``e_j`` the sampling spread within a group
(``N(0, s)``). A ranker's distribution has ``sigma**2 = tau**2 + s**2``. Once ``k`` siblings have
finished with mean log length ``ybar``, the level's posterior is normal with

    precision = 1 / tau**2 + k / s**2,   mean = (mu / tau**2 + k * ybar / s**2) / precision

and an unfinished sibling's length is log-normal with that mean and ``sqrt(1 / precision + s**2)``.
The spread ``s`` is learned from the run's own finished groups (pooled within-group variance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from streamrl.records import LengthDistribution

#: Within-group spread (log length) assumed until enough groups have finished.
DEFAULT_WITHIN_SIGMA = 0.3


class GroupContext:
    """The within-group spread of log lengths, learned online, and siblings' posteriors.

    Args:
        within_sigma: the spread assumed until ``min_groups`` groups have been observed.
        min_groups: finished groups needed before the learned spread replaces the assumed one.

    Examples:
        >>> context = GroupContext(within_sigma=0.2)
        >>> prior = LengthDistribution(math.log(100), 0.6)  # the ranker's, one sample
        >>> after = context.posterior(prior, [40, 50])  # two siblings ended early
        >>> round(after.median) < 60, after.sigma < prior.sigma
        (True, True)
    """

    def __init__(self, within_sigma: float = DEFAULT_WITHIN_SIGMA, min_groups: int = 8) -> None:
        if within_sigma <= 0:
            raise ValueError(f"within_sigma must be > 0, got {within_sigma}.")
        self.assumed_sigma, self.min_groups = within_sigma, min_groups
        self._squares = 0.0  # sum over groups of squared deviations from the group's mean
        self._dof = 0  # sum over groups of (size - 1)
        self.groups = 0

    @property
    def within_sigma(self) -> float:
        """The spread of log lengths inside a group: learned, or assumed until enough data."""
        if self.groups < self.min_groups or self._dof == 0:
            return self.assumed_sigma
        return max(math.sqrt(self._squares / self._dof), 1e-3)

    def observe_group(self, lengths: Sequence[int]) -> None:
        """A group's finished lengths (two or more say something about the spread)."""
        logs = [math.log(max(n, 1)) for n in lengths]
        if len(logs) < 2:
            return
        mean = sum(logs) / len(logs)
        self._squares += sum((y - mean) ** 2 for y in logs)
        self._dof += len(logs) - 1
        self.groups += 1

    def posterior(self, prior: LengthDistribution, finished: Sequence[int]) -> LengthDistribution:
        """An unfinished sibling's length once the group's ``finished`` lengths are known."""
        if not finished:
            return prior
        s2 = min(self.within_sigma, 0.95 * prior.sigma) ** 2
        tau2 = prior.sigma**2 - s2
        if tau2 <= 1e-9 or s2 <= 1e-9:  # a point prior: nothing to learn
            return prior
        ybar = sum(math.log(max(n, 1)) for n in finished) / len(finished)
        precision = 1 / tau2 + len(finished) / s2
        mean = (prior.mu / tau2 + len(finished) * ybar / s2) / precision
        return LengthDistribution(mean, math.sqrt(1 / precision + s2))

    def state_dict(self) -> dict:
        return {"squares": self._squares, "dof": self._dof, "groups": self.groups}

    def load_state_dict(self, state: dict) -> None:
        self._squares, self._dof = float(state["squares"]), int(state["dof"])
        self.groups = int(state["groups"])
