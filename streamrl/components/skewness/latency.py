"""The generation latency model of StreamRL §5.1 (Eq. 1 and 2) and a batching simulator.

``PTL(BS)`` is the per-token decode latency at batch size ``BS``, measured on the real backend
(``streamrl.components.skewness.profiler``) or taken from the paper's table. With it:

- Eq. 1: sample latency = ``PTL(BS) x L``;
- Eq. 2: instance latency = ``PTL(BS) x L_avg x ceil(M / BS)`` for ``M`` samples on one instance.

``simulate_instance`` replays continuous batching step by step with ``PTL`` of the live batch,
which Eq. 2 only approximates; the dispatch benchmark uses it for large instance counts.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

#: PTL of a 7B model on one H800 with vLLM, read off the paper's Fig. 6 (ms per token).
PAPER_7B_H800_MS = {
    1: 8.3,
    2: 8.6,
    4: 8.9,
    8: 9.0,
    16: 9.4,
    32: 10.2,
    64: 11.7,
    128: 15.2,
    256: 21.2,
    512: 37.0,
}


@dataclass
class LatencyModel:
    """Per-token decode latency as a function of batch size, from measured points.

    Between measured batch sizes ``ptl`` interpolates linearly; above the largest it extends the
    last segment; below the smallest it holds the first value.

    Attributes:
        batch_sizes: measured batch sizes, ascending.
        ptl_s: seconds per decode step at each of them.

    Examples:
        >>> model = LatencyModel([1, 4], [0.010, 0.016])
        >>> round(model.ptl(2), 4), round(model.instance_latency(8, 100, 4), 2)
        (0.012, 3.2)
    """

    batch_sizes: list[int]
    ptl_s: list[float]

    def __post_init__(self) -> None:
        if not self.batch_sizes or len(self.batch_sizes) != len(self.ptl_s):
            raise ValueError("LatencyModel: need one PTL per batch size, at least one point.")
        if sorted(self.batch_sizes) != list(self.batch_sizes) or min(self.batch_sizes) < 1:
            raise ValueError("LatencyModel: batch sizes must be ascending and >= 1.")

    @classmethod
    def from_table_ms(cls, table: dict[int, float]) -> LatencyModel:
        """From ``{batch_size: milliseconds per token}``."""
        sizes = sorted(table)
        return cls(sizes, [table[b] / 1000 for b in sizes])

    def update_from(self, other: LatencyModel) -> None:
        """Take ``other``'s points, in place: whoever holds this model (the dispatcher, the
        elastic controller) plans with them from now on."""
        self.batch_sizes, self.ptl_s = list(other.batch_sizes), list(other.ptl_s)

    def ptl(self, batch_size: float) -> float:
        """Seconds per decode step with ``batch_size`` running sequences."""
        sizes, values = self.batch_sizes, self.ptl_s
        if batch_size <= sizes[0] or len(sizes) == 1:
            return values[0]
        i = min(bisect.bisect_left(sizes, batch_size), len(sizes) - 1)
        (b0, v0), (b1, v1) = (sizes[i - 1], values[i - 1]), (sizes[i], values[i])
        return v0 + (v1 - v0) * (batch_size - b0) / (b1 - b0)

    def sample_latency(self, length: float, batch_size: float) -> float:
        """Eq. 1: ``PTL(BS) x L``."""
        return self.ptl(batch_size) * length

    def instance_latency(self, samples: int, avg_length: float, max_batch_size: int) -> float:
        """Eq. 2: ``PTL(BS) x L_avg x ceil(M / BS)`` with ``BS = min(M, max_batch_size)``."""
        if samples <= 0:
            return 0.0
        batch = min(samples, max_batch_size)
        return self.ptl(batch) * avg_length * math.ceil(samples / batch)

    def makespan_floor(
        self, lengths: Sequence[int], instances: int, max_batch_size: int
    ) -> tuple[float, float]:
        """Two times no plan of ``lengths`` beats on ``instances`` of at most ``max_batch_size``
        slots, whatever it dispatches, admits or moves (a move only adds a re-prefill):

        - the longest sample: it decodes one token a step, each step at least the fastest
          ``PTL(b)``;
        - the work: every token decoded, each instance at its best tokens per second
          (``b / PTL(b)``, at the ``b`` that maximises it).

        A target below the larger of the two cannot be met by any dispatcher on this latency
        model; only faster steps (speculative decoding) move it.

        Returns:
            ``(longest_s, work_s)``.

        Examples:
            >>> model = LatencyModel.from_table_ms({1: 10.0, 4: 20.0})
            >>> [round(s, 3) for s in model.makespan_floor([100, 10, 10, 10], 1, 4)]
            [1.0, 0.65]
        """
        sizes = range(1, max_batch_size + 1)
        fastest_step = min(self.ptl(b) for b in sizes)
        best_rate = max(b / self.ptl(b) for b in sizes)  # tokens per second of one instance
        return max(lengths) * fastest_step, sum(lengths) / (instances * best_rate)

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> LatencyModel:
        data = json.loads(Path(path).read_text())
        return cls([int(b) for b in data["batch_sizes"]], [float(v) for v in data["ptl_s"]])


def simulate_instance(lengths: Sequence[int], max_batch_size: int, model: LatencyModel) -> float:
    """Seconds for one continuously batched instance to finish ``lengths``, admitted in order.

    Each decode step advances every running sequence by one token and costs ``PTL`` of the
    number running; a finished sequence frees its slot for the next waiting one at once.
    """
    waiting = list(lengths)[::-1]  # pop() from the end = admission order
    running: list[int] = []
    elapsed = 0.0
    while waiting or running:
        while waiting and len(running) < max_batch_size:
            running.append(waiting.pop())
        # Jump to the next finish: the batch size is constant until then.
        step = min(running)
        elapsed += step * model.ptl(len(running))
        running = [r - step for r in running if r > step]
    return elapsed
