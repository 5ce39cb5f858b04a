"""Dispatchers: which generator instance gets which request.

The skewness-aware dispatcher of StreamRL §5.3 (Algorithm 2) plugs in here; round-robin is the
baseline. A dispatcher keeps every sample of one prompt on one instance, so a group finishes
together and the whole prompt is requeued together if its instance fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrl.components.protocols import Dispatcher
from streamrl.records import Request

__all__ = ["Dispatcher", "RoundRobinDispatcher"]


class RoundRobinDispatcher:
    """Deal prompts to instances in turn, continuing where the last call stopped.

    Example:
        >>> reqs = [Request(f"p{i}", [3], 4, sample_index=s) for i in range(3) for s in range(2)]
        >>> [[r.key for r in part] for part in RoundRobinDispatcher().plan(reqs, None, 2)]
        [[('p0', 0, 0), ('p0', 1, 0), ('p2', 0, 0), ('p2', 1, 0)], [('p1', 0, 0), ('p1', 1, 0)]]
    """

    def __init__(self) -> None:
        self._next = 0

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        parts: list[list[Request]] = [[] for _ in range(instances)]
        where: dict[str, int] = {}
        for request in requests:
            if request.prompt_id not in where:
                where[request.prompt_id] = self._next % instances
                self._next += 1
            parts[where[request.prompt_id]].append(request)
        return parts

    def state_dict(self) -> dict:
        return {"next": self._next}

    def load_state_dict(self, state: dict) -> None:
        self._next = int(state["next"])
