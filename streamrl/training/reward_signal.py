"""A run whose rewards never vary learns nothing: say so once, after its first iterations.

GRPO and its kin score each sample against its group (Shao et al. 2024, §4.1.2): when every
reward of an iteration is the same, every advantage is 0 and the optimizer step changes
nothing, while the run goes on quietly. ``RewardSpreadCheck`` watches the first few iterations
and warns (``NoLearningSignalWarning``, on stderr) when each of them had a single reward value.

Examples:
    >>> import warnings
    >>> check = RewardSpreadCheck(iterations=2)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     check.observe([0.0, 0.0, 0.0])
    ...     check.observe([0.0, 0.0])
    >>> [w.category.__name__ for w in caught]
    ['NoLearningSignalWarning']
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

#: Iterations looked at before a run with equal rewards is warned about.
CHECKED_ITERATIONS = 3


class NoLearningSignalWarning(UserWarning):
    """Every reward of each of a run's first iterations was equal: the policy learns nothing."""


def show_plainly() -> None:
    """Print ``NoLearningSignalWarning`` as a line of its own on stderr (``streamrl: warning:
    ...``), without Python's file, line and source: the console script's form."""
    default = warnings.showwarning

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, NoLearningSignalWarning):
            print(f"\n{message}\n", file=sys.stderr, flush=True)  # off a progress bar's line
        else:
            default(message, category, *args, **kwargs)

    warnings.showwarning = show


class RewardSpreadCheck:
    """Warns once when every reward of each of the first ``iterations`` iterations is equal.

    Args:
        iterations: how many iterations with equal rewards make the warning.
        tolerance: rewards closer than this count as equal.
    """

    def __init__(self, iterations: int = CHECKED_ITERATIONS, tolerance: float = 1e-8) -> None:
        self.iterations, self.tolerance = iterations, tolerance
        self.flat: list[float] = []  # the one reward value of each flat iteration so far
        self.done = False

    def observe(self, rewards: Sequence[float]) -> None:
        """One iteration's rewards (after ``score_sample``), in any order."""
        if self.done or not rewards:
            return
        if max(rewards) - min(rewards) > self.tolerance:
            self.done = True  # the run has a signal: nothing to say, now or later
            return
        self.flat.append(float(rewards[0]))
        if len(self.flat) >= self.iterations:
            self.done = True
            warnings.warn(self.message(), NoLearningSignalWarning, stacklevel=2)

    def message(self) -> str:
        values = ", ".join(f"{v:g}" for v in self.flat)
        return (
            f"streamrl: warning: within each of the first {len(self.flat)} iterations every "
            f"reward was equal (to {values}): every advantage is 0, so the policy learns "
            "nothing. Likely causes: the reward never matches the completions' format (look "
            "at a few: rl.save_rollouts: true writes them); rl.rollouts.max_tokens too small, "
            "so answers are cut off; the reward function returns a constant; or the starting "
            "policy too weak to ever answer right (a longer warm start, sft.steps, or a "
            "stronger model)."
        )
