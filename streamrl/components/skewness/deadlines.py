"""Deadlines of iterations in flight: a launch order that respects the staleness bound.

With ``rl.module.staleness_bound: k`` async mode dispatches up to ``k`` iterations ahead (StreamRL
§4.1, ``AheadWindow``): iteration ``j`` may start at weights ``j - k`` and must be done when step
``j`` trains, so the requests an instance queues belong to several iterations with different
deadlines. Longest-first (LPT) alone ignores them: a long sample of a later iteration may start
late in its window and hold it open. Ordering by **least slack** (deadline minus duration)
starts the long samples of each window early and the later iteration's short ones after the
earlier iteration's. As an admission cost (higher first, what LPT pops):

    cost = predicted tokens - (iteration - oldest open iteration) x tokens per iteration

``IterationClock`` measures the two rates from the run's own finished samples: seconds per token
(a sample's decode time over its length) and seconds per iteration (the gap between two
iterations' completions), so the lead is in tokens a slot decodes meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamrl.records import Sample


class IterationClock:
    """How long an iteration and a token take, learned online (module docstring).

    Args:
        smoothing: weight of the newest measurement in each moving average.

    Examples:
        >>> clock = IterationClock()
        >>> clock.opened(0, [("a", 0, 0)]); clock.opened(1, [("b", 0, 1)])
        >>> clock.lead(1) is None  # nothing measured yet: plain LPT
        True
    """

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing = smoothing
        self._open: dict[int, set[tuple]] = {}
        self._last_done_s: float | None = None
        self.seconds_per_token: float | None = None
        self.seconds_per_iteration: float | None = None

    def opened(self, iteration: int, keys: Iterable[tuple]) -> None:
        """Requests of ``iteration`` went out (keys already known are not counted twice)."""
        self._open.setdefault(iteration, set()).update(keys)

    def finished(self, sample: Sample) -> None:
        """A sample finished: its decode rate, and its iteration's completion if it was last."""
        if sample.length > 0 and sample.finished_s > sample.started_s > 0:
            rate = (sample.finished_s - sample.started_s) / sample.length
            self.seconds_per_token = self._average(self.seconds_per_token, rate)
        keys = self._open.get(sample.iteration)
        if keys is None or sample.key not in keys:
            return
        keys.discard(sample.key)
        if keys:
            return
        del self._open[sample.iteration]
        if self._last_done_s is not None and sample.finished_s > self._last_done_s:
            gap = sample.finished_s - self._last_done_s
            self.seconds_per_iteration = self._average(self.seconds_per_iteration, gap)
        self._last_done_s = max(sample.finished_s, self._last_done_s or 0.0)

    def lead(self, iteration: int) -> float | None:
        """Tokens of slack ``iteration`` has over the oldest open one; ``None`` while unknown
        (no two completions, no rate yet, or a single iteration open)."""
        if not self.seconds_per_token or not self.seconds_per_iteration or not self._open:
            return None
        oldest = min(self._open)
        return max(0, iteration - oldest) * self.seconds_per_iteration / self.seconds_per_token

    def _average(self, current: float | None, value: float) -> float:
        return value if current is None else current + self.smoothing * (value - current)
