"""An instance's predicted remaining work, as the adaptive planner weighs moves (issue 34).

``InstanceWork`` holds, per request an instance holds, the tokens it is expected to generate
still (a running one's ``remaining`` past what it generated; a waiting one's whole expected
length), in admission order, and predicts when its last sample ends: continuous batching with
equal decode steps is list scheduling on its slots. ``best_move`` weighs moving each of a few
candidates (the next waiting ones, the longest running ones) to another instance.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from streamrl.components.skewness.latency import LatencyModel

Key = tuple[str, int, int]
#: Candidates weighed per move (the next waiting ones, the longest running ones).
CANDIDATES = 6


@dataclass
class InstanceWork:
    """An instance's predicted remaining work: running and waiting requests' expected tokens."""

    instance_id: int
    batch: int
    running: dict[Key, float]  # key -> expected tokens left
    waiting: list[tuple[Key, float]]  # in admission order

    def finish_s(self, latency: LatencyModel) -> tuple[float, float]:
        """Predicted seconds until its last sample ends, and the fluid bound that breaks ties.

        Continuous batching with equal decode steps is list scheduling on ``batch`` slots
        (running first, then waiting in admission order: each to the slot that frees first);
        the fluid bound, its tokens spread over the slots, falls with every token moved away,
        so moves that only prepare a better split still count.
        """
        lengths = [*self.running.values(), *(n for _, n in self.waiting)]
        if not lengths:
            return 0.0, 0.0
        batch = min(self.batch, len(lengths))
        slots = [0.0] * batch
        for n in lengths:
            heapq.heapreplace(slots, slots[0] + n)
        ptl = latency.ptl(batch)
        return max(slots) * ptl, max(max(lengths), sum(lengths) / batch) * ptl

    def without(self, key: Key) -> InstanceWork:
        return InstanceWork(
            self.instance_id,
            self.batch,
            {k: v for k, v in self.running.items() if k != key},
            [(k, v) for k, v in self.waiting if k != key],
        )

    def best_move(
        self, target: InstanceWork, latency: LatencyModel, overhead_s: float
    ) -> tuple[tuple[float, float], Key] | None:
        """The candidate whose move gives the smallest later finish of the two (then the
        smallest fluid bound), with those finishes."""
        longest = sorted(self.running.items(), key=lambda kv: -kv[1])[:CANDIDATES]
        candidates = [(k, v, True) for k, v in longest] + [
            (k, v, False) for k, v in self.waiting[:CANDIDATES]
        ]
        best = None
        for key, left, running in candidates:
            if running:  # its prompt and tokens are prefilled again there
                left += overhead_s / latency.ptl(1)
            moved = InstanceWork(target.instance_id, target.batch, target.running, [(key, left)])
            moved.waiting += target.waiting
            here, there = self.without(key).finish_s(latency), moved.finish_s(latency)
            after = (max(here[0], there[0]), max(here[1], there[1]))
            if best is None or after < best[0]:
                best = (after, key)
        return best

    def take(
        self, source: InstanceWork, key: Key, overhead_s: float, latency: LatencyModel
    ) -> None:
        """Move ``key`` from ``source`` to here (admitted first here: it is the costliest)."""
        left = source.running.get(key)
        if left is None:
            left = dict(source.waiting)[key]
        else:
            left += overhead_s / latency.ptl(1)
        source.running.pop(key, None)
        source.waiting = [(k, v) for k, v in source.waiting if k != key]
        self.waiting.insert(0, (key, left))
