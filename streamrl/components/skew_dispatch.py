"""Skewness-aware dispatching: StreamRL §5.3, Algorithm 2.

Long outputs want small batches (low per-token latency), regular ones want large batches (high
throughput). The dispatcher sorts prompts by predicted length, calls the top ``alpha`` share the
long tail, and chooses how many of the N instances serve the tail so that the predicted latency
of the two pools (Eq. 2, with the tail's length estimated by the P90 and the regular length by
the P50 of recent outputs) is smallest. The paper adds the two pools' latencies (``"sum"``); the
pools run in parallel, so the default here is their makespan (``"max"``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from streamrl.components.latency import LatencyModel
from streamrl.records import Request

Objective = Literal["max", "sum"]


class SkewAwareDispatcher:
    """Algorithm 2 plus the assignment of prompts to the chosen pools.

    Args:
        latency: the instances' ``PTL(BS)``.
        max_batch_size: batch slots per instance.
        alpha: share of prompts treated as the long tail.
        objective: ``"max"`` (makespan of the two pools) or ``"sum"`` (the paper's Algorithm 2).
        recent_lengths: the output-length distribution ``D`` (e.g. last iterations' lengths);
            refreshed by ``observe``. Until it has data, the scores stand in for it.
        window: how many recent lengths ``D`` keeps.

    Example:
        >>> model = LatencyModel.from_table_ms({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2, 16: 1.5, 32: 2.0})
        >>> d = SkewAwareDispatcher(model, max_batch_size=32, recent_lengths=[10] * 9 + [100])
        >>> d.split(samples=40, instances=4)  # 8 tail samples on 3 instances, 32 on 1
        (3, 1)
    """

    def __init__(
        self,
        latency: LatencyModel,
        max_batch_size: int = 64,
        alpha: float = 0.2,
        objective: Objective = "max",
        recent_lengths: Iterable[int] = (),
        window: int = 4096,
    ) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}.")
        if objective not in ("max", "sum"):
            raise ValueError(f"objective must be 'max' or 'sum', got {objective!r}.")
        self.latency, self.max_batch_size = latency, max_batch_size
        self.alpha, self.objective = alpha, objective
        self.recent: deque[int] = deque(recent_lengths, maxlen=window)
        self.last_split: tuple[int, int] | None = None

    def observe(self, lengths: Iterable[int]) -> None:
        """Add finished samples' output lengths to the distribution ``D``."""
        self.recent.extend(int(n) for n in lengths)

    def split(
        self, samples: int, instances: int, fallback: Sequence[float] = ()
    ) -> tuple[int, int]:
        """Algorithm 2: ``(N_l, N_r)``, instances for the long tail and for regular samples."""
        if instances < 2:
            return (0, instances)
        lengths = np.asarray(self.recent if self.recent else fallback, dtype=float)
        if lengths.size == 0:
            raise ValueError("SkewAwareDispatcher: no recent lengths and no scores to size pools.")
        tail_len, regular_len = np.percentile(lengths, 90), np.percentile(lengths, 50)
        tail = round(self.alpha * samples)
        best, best_cost = (1, instances - 1), float("inf")
        for n_long in range(1, instances):
            n_regular = instances - n_long
            costs = (self._pool(tail, tail_len, n_long), self._pool(samples - tail, regular_len,
                                                                      n_regular))  # fmt: skip
            cost = max(costs) if self.objective == "max" else sum(costs)
            if cost < best_cost:
                best, best_cost = (n_long, n_regular), cost
        return best

    def _pool(self, samples: int, length: float, instances: int) -> float:
        # Eq. 2 on the most loaded instance of the pool.
        per_instance = -(-samples // instances)
        return self.latency.instance_latency(per_instance, length, self.max_batch_size)

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        """Assign requests: the predicted tail to ``N_l`` instances, the rest to ``N_r``.

        ``scores`` (predicted lengths, one per request) also become each request's
        ``predicted_length`` for LPT admission. A prompt's samples stay on one instance.
        """
        if scores is None:  # no ranker yet: balance prompt counts, as round-robin would
            scores = [0.0] * len(requests)
        if len(scores) != len(requests):
            raise ValueError("SkewAwareDispatcher.plan needs one predicted length per request.")
        by_prompt: dict[str, list[Request]] = {}
        score_of: dict[str, float] = {}
        for request, score in zip(requests, scores):
            request.predicted_length = float(score)
            by_prompt.setdefault(request.prompt_id, []).append(request)
            score_of[request.prompt_id] = max(score_of.get(request.prompt_id, 0.0), float(score))
        order = sorted(by_prompt, key=lambda p: -score_of[p])  # longest predicted first
        if not any(scores):  # nothing to isolate: one pool over every instance
            n_long, n_regular = 0, instances
        else:
            n_long, n_regular = self.split(len(requests), instances, fallback=list(scores))
        self.last_split = (n_long, n_regular)
        n_tail = round(self.alpha * len(order)) if n_long else 0
        parts: list[list[Request]] = [[] for _ in range(instances)]
        pools = [(order[:n_tail], range(n_long)), (order[n_tail:], range(n_long, instances))]
        for prompts, pool in pools:
            # LPT over instances: the longest prompt goes to the least loaded instance (by
            # predicted tokens, then by request count when predictions tie or are missing).
            loads = {i: (0.0, 0) for i in pool}
            for pid in prompts:
                target = min(loads, key=loads.__getitem__)
                parts[target].extend(by_prompt[pid])
                tokens, count = loads[target]
                n = len(by_prompt[pid])
                loads[target] = (tokens + score_of[pid] * n, count + n)
        return parts
