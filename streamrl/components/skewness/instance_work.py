"""An instance's predicted remaining work, as the adaptive planner weighs moves (issue 34).

``InstanceWork`` holds, per request an instance holds, the tokens it is expected to generate
still (a running one's ``remaining`` past what it generated; a waiting one's whole expected
length), in admission order, with the tokens each holds (prompt and generated: what its steps
read), and predicts when its last sample ends by replaying continuous batching on the latency
model (``decode_schedule``: batch size and context). ``best_move`` weighs moving each of a few
candidates (the next waiting ones, the longest running ones) to another instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.components.skewness.batching import simulate_instance
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
    contexts: dict[Key, float] = field(default_factory=dict)  # key -> tokens it holds now

    def finish_s(self, latency: LatencyModel) -> tuple[float, float]:
        """Predicted seconds until its last sample ends, and the fluid bound that breaks ties.

        Continuous batching replayed on ``batch`` slots (running first, then waiting in
        admission order), every step priced with its rows' contexts; the fluid bound, its
        tokens spread over the slots, falls with every token moved away, so moves that only
        prepare a better split still count.
        """
        order = [*self.running.items(), *self.waiting]
        if not order:
            return 0.0, 0.0
        lengths = [n for _, n in order]
        contexts = [self.contexts.get(key, 0.0) for key, _ in order]
        batch = min(self.batch, len(lengths))
        last = simulate_instance(lengths, batch, latency, contexts, prefilled=len(self.running))
        return last, max(max(lengths), sum(lengths) / batch) * latency.ptl(batch)

    def without(self, key: Key) -> InstanceWork:
        return InstanceWork(
            self.instance_id,
            self.batch,
            {k: v for k, v in self.running.items() if k != key},
            [(k, v) for k, v in self.waiting if k != key],
            self.contexts,
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
            contexts = {**target.contexts, key: self.contexts.get(key, 0.0)}
            moved = InstanceWork(
                target.instance_id, target.batch, target.running, [(key, left)], contexts
            )
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
        self.contexts[key] = source.contexts.get(key, 0.0)
