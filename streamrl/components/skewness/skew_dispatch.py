"""Skewness-aware dispatching: StreamRL §5.3, Algorithm 2.

Long outputs want small batches (low per-token latency), regular ones want large batches (high
throughput). The dispatcher sorts prompts by predicted length, calls the top ``alpha`` share the
long tail, and chooses how many of the N instances serve the tail so that the predicted latency
of the two pools (Eq. 2, with the tail's length estimated by the P90 and the regular length by
the P50 of recent outputs) is smallest. The tail pool may run a smaller batch than the regular
one (per-pool batch sizes).

Objectives:

- ``"sum"``: the paper's Algorithm 2 as published: the two pools' Eq. 2 latencies added, the tail
  always isolated on 1..N-1 instances.
- ``"max"`` (default): the pools run in parallel, so their makespan counts. Algorithm 2's best
  split by ``max`` competes with a plan that isolates nothing (every prompt balanced over all
  instances by predicted tokens, longest first); the plan whose replayed continuous batching
  (``simulate_instance`` on the predicted lengths) finishes first wins. Isolation pays when the
  tail is long against a batch's worth of regular work; with few samples per instance, balancing
  alone is as good and less exposed to ranker error. When the latency model prices context (a
  step that pays for its widest row, a prefill padded to the widest prompt), equal tokens are not
  equal time: the plan is then refined in seconds (``refine.refine_plan``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from streamrl.components.skewness.batching import simulate_instance
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.refine import refine_plan
from streamrl.records import Request

if TYPE_CHECKING:
    from streamrl.components.run_context import RunContext

Objective = Literal["max", "sum"]


class SkewAwareDispatcher:
    """Algorithm 2 plus the assignment of prompts to the chosen pools.

    Args:
        latency: the instances' ``PTL(BS)``; ``None`` only for a single instance (there are
            no pools to size: it then admits longest first, and ``plan`` over two or more
            instances raises).
        max_batch_size: batch slots per instance (the regular pool's batch size).
        alpha: share of prompts treated as the long tail.
        objective: ``"max"`` (makespan, default) or ``"sum"`` (the paper's Algorithm 2).
        recent_lengths: the output-length distribution ``D`` (e.g. last iterations' lengths);
            refreshed by ``observe``. Until it has data, the scores stand in for it.
        window: how many recent lengths ``D`` keeps.
        tail_batch_size: batch size of the tail pool's instances (default: ``max_batch_size``);
            ``batch_limits`` tells the service which instance runs which.

    Examples:
        >>> model = LatencyModel.from_table_ms({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2, 16: 1.5, 32: 2.0})
        >>> d = SkewAwareDispatcher(model, max_batch_size=32, recent_lengths=[10] * 9 + [100])
        >>> d.split(samples=40, instances=4)  # 8 tail samples on 3 instances, 32 on 1
        (3, 1)
    """

    def __init__(
        self,
        latency: LatencyModel | None,
        max_batch_size: int = 64,
        alpha: float = 0.2,
        objective: Objective = "max",
        recent_lengths: Iterable[int] = (),
        window: int = 4096,
        tail_batch_size: int | None = None,
    ) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}.")
        if objective not in ("max", "sum"):
            raise ValueError(f"objective must be 'max' or 'sum', got {objective!r}.")
        tail_batch_size = max_batch_size if tail_batch_size is None else tail_batch_size
        if not 1 <= tail_batch_size <= max_batch_size:
            raise ValueError(
                f"tail_batch_size must be in [1, max_batch_size={max_batch_size}], "
                f"got {tail_batch_size}."
            )
        self.latency, self.max_batch_size = latency, max_batch_size
        self.tail_batch_size = tail_batch_size
        self.alpha, self.objective = alpha, objective
        self.recent: deque[int] = deque(recent_lengths, maxlen=window)
        self.last_split: tuple[int, int] | None = None
        self.prompt_tokens = 0.0  # the mean prompt of the last plan: every context starts there

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
            costs = (
                self._pool(tail, tail_len, n_long, self.tail_batch_size),
                self._pool(samples - tail, regular_len, n_regular, self.max_batch_size),
            )
            cost = max(costs) if self.objective == "max" else sum(costs)
            if cost < best_cost:
                best, best_cost = (n_long, n_regular), cost
        return best

    def _pool(self, samples: int, length: float, instances: int, batch: int) -> float:
        # Eq. 2 on the most loaded instance of the pool.
        if self.latency is None:
            raise ValueError(
                "SkewAwareDispatcher: sizing pools over several instances needs the latency "
                "model PTL(BS) (streamrl.training.builders.measure_latency); it was built "
                "without one."
            )
        per_instance = -(-samples // instances)
        return self.latency.instance_latency(per_instance, length, batch, self.prompt_tokens)

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> SkewAwareDispatcher:
        """Built for a run: its batch size, and the instances' ``PTL(BS)`` to size the two pools
        when requests may be split over several instances (asked of the run only then, which
        is what makes it measure it)."""
        latency = run.latency() if run.several_instances else None
        return cls(latency, run.max_batch_size, **options)

    def batch_limits(self, instances: int) -> list[int]:
        """Each instance's batch size under the last plan: the tail pool's come first."""
        n_long = self.last_split[0] if self.last_split else 0
        return [self.tail_batch_size] * n_long + [self.max_batch_size] * (instances - n_long)

    def state_dict(self) -> dict:
        """The distribution ``D`` and the last split (``batch_limits`` of requeued requests)."""
        return {"recent": list(self.recent), "last_split": self.last_split}

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(int(n) for n in state["recent"])
        split = state["last_split"]
        self.last_split = tuple(split) if split is not None else None

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        """Assign requests: the predicted tail to ``N_l`` instances, the rest to ``N_r``.

        ``scores`` (predicted lengths, one per request, capped at the request's
        ``max_tokens``) also become each request's ``predicted_length`` for LPT admission. A
        prompt's samples stay on one instance.
        """
        if scores is None:  # no ranker yet: balance prompt counts, as round-robin would
            scores = [0.0] * len(requests)
        if len(scores) != len(requests):
            raise ValueError("SkewAwareDispatcher.plan needs one predicted length per request.")
        if requests:
            self.prompt_tokens = sum(len(r.prompt_ids) for r in requests) / len(requests)
        groups: dict[str, list[Request]] = {}
        score_of: dict[str, float] = {}
        for request, score in zip(requests, scores):
            # No sample outlasts its budget: a prediction past it (a ranker extrapolating on
            # text unlike its training set) is capped there.
            score = min(float(score), float(request.max_tokens))
            request.predicted_length = score
            groups.setdefault(request.prompt_id, []).append(request)
            score_of[request.prompt_id] = max(score_of.get(request.prompt_id, 0.0), float(score))
        order = sorted(groups, key=lambda p: -score_of[p])  # longest predicted first
        if not any(scores) or instances < 2:  # nothing to isolate: one pool over every instance
            self.last_split = (0, instances)
            return _balance(order, groups, score_of, instances)
        split = self.split(len(requests), instances, fallback=list(scores))
        n_tail = round(self.alpha * len(order))
        isolated = _balance(order[:n_tail], groups, score_of, split[0]) + _balance(
            order[n_tail:], groups, score_of, split[1]
        )
        self.last_split = split
        if self.objective == "sum":
            return isolated
        chosen = isolated
        balanced = _balance(order, groups, score_of, instances)
        if self._replay(balanced, [self.max_batch_size] * instances) < self._replay(
            isolated, self.batch_limits(instances)
        ):
            self.last_split = (0, instances)
            chosen = balanced
        if not self.latency.prices_context:  # equal tokens are equal time
            return chosen
        limits = self.batch_limits(instances)
        return refine_plan(chosen, lambda i, part: self._instance_s(part, limits[i]))

    def _replay(self, parts: list[list[Request]], batches: list[int]) -> float:
        """Predicted makespan of ``parts`` (``_instance_s`` of each)."""
        return max((self._instance_s(p, b) for p, b in zip(parts, batches)), default=0.0)

    def _instance_s(self, part: list[Request], batch: int) -> float:
        """Predicted seconds of one instance: continuous batching replayed on predicted
        lengths, admitting longest first, every step priced with its rows' contexts."""
        order = sorted(part, key=lambda r: -(r.predicted_length or 1))
        lengths = [max(1, round(r.predicted_length or 1)) for r in order]
        contexts = [len(r.prompt_ids) for r in order]
        return simulate_instance(lengths, batch, self.latency, contexts)


def _balance(
    order: Sequence[str], groups: dict[str, list[Request]], score_of: dict[str, float], n: int
) -> list[list[Request]]:
    """LPT over instances: each prompt, longest predicted first, goes to the least loaded of
    ``n`` instances (by predicted tokens, then by request count when predictions tie)."""
    parts: list[list[Request]] = [[] for _ in range(n)]
    loads = [(0.0, 0)] * n
    for pid in order:
        target = min(range(n), key=loads.__getitem__)
        parts[target].extend(groups[pid])
        tokens, count = loads[target]
        size = len(groups[pid])
        loads[target] = (tokens + score_of[pid] * size, count + size)
    return parts
