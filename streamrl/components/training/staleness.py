"""The staleness bound: how many weight versions behind the trainer a trained token may be
(StreamRL §4.1, which keeps it at one; ``rl.module.staleness_bound`` lets async mode run k ahead).

``staleness_bound_of`` says which bound a mode trains under; ``AheadWindow`` is how async mode
keeps it: iteration ``j`` is dispatched while iteration ``j - k`` trains and is admitted at
weights >= ``j - k`` (``Request.min_weight_version``), so however long a sample runs, and
however many weight updates it spans (partial rollout), no token of it is more than k versions
old when step ``j`` trains it. Nothing is dropped for staleness.
"""

from __future__ import annotations

from collections.abc import Callable

#: The staleness bound each mode trains under by default, in weight versions (§4.1): sync and
#: colocated train only on samples of the current weights; async (one-step, as in the paper) on
#: tokens at most one version behind; ``staleness_bound=k`` lets async run k iterations ahead.
STALENESS_BOUND: dict[str, int] = {"sync": 0, "colocated": 0, "async": 1}


def staleness_bound_of(mode: str, bound: int | None) -> int:
    """The bound a run of ``mode`` trains under: ``bound``, or the mode's default if ``None``;
    a ``ValueError`` if the mode cannot keep it."""
    if mode not in STALENESS_BOUND:
        raise ValueError(f"mode must be one of {sorted(STALENESS_BOUND)}, got {mode!r}.")
    if bound is None:
        return STALENESS_BOUND[mode]
    if mode == "async" and bound < 1:
        raise ValueError(
            f"staleness_bound={bound}: async mode runs at least one iteration ahead (>= 1); "
            "use mode sync for on-policy training."
        )
    if mode != "async" and bound != 0:
        raise ValueError(
            f"staleness_bound={bound} with mode {mode!r}: only async mode trains on samples "
            "of older weights; set mode async, or leave staleness_bound unset."
        )
    return int(bound)


class AheadWindow:
    """The iterations async mode has dispatched ahead of the one training (at most ``bound``).

    Args:
        bound: k, the staleness bound (>= 1).
        iterations: the run's last iteration is ``iterations - 1``; nothing past it is sent.

    Examples:
        >>> window, floors = AheadWindow(2, iterations=4), []
        >>> send = lambda floor: floors.append(floor) or len(floors) - 1
        >>> [window.next(step, send) for step in range(4)], floors
        ([0, 1, 2, 3], [0, 0, 0, 1])
    """

    def __init__(self, bound: int, iterations: int) -> None:
        self.bound, self.iterations = bound, iterations
        self.ahead: list[int] = []  # dispatched, not yet trained (empty after a resume)

    def next(self, iteration: int, dispatch: Callable[[int], int]) -> int:
        """Fill the window up to ``iteration + bound`` with ``dispatch(min_weight_version)``
        (which returns the iteration sent) and return ``iteration``'s number, to train now."""
        last = min(iteration + self.bound, self.iterations - 1)
        while iteration + len(self.ahead) <= last:
            floor = max(0, iteration + len(self.ahead) - self.bound)
            self.ahead.append(dispatch(floor))
        return self.ahead.pop(0)
