"""Dispatchers: which generator instance gets which request.

The skewness-aware dispatcher of StreamRL §5.3 (Algorithm 2) plugs in here; round-robin and
random are the baselines. Every dispatcher has the whole ``Dispatcher`` protocol (``plan``,
``observe``, ``batch_limits``, ``state_dict``): the baselines learn nothing and size no pools.
A dispatcher keeps every sample of one prompt on one instance, so a group finishes together
and the whole prompt is requeued together if its instance fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from streamrl.protocols import Dispatcher
from streamrl.records import Request

if TYPE_CHECKING:
    from streamrl.components.run_context import RunContext

__all__ = ["Dispatcher", "RandomDispatcher", "RoundRobinDispatcher", "split_by_prompt"]


def split_by_prompt(
    requests: Sequence[Request], instances: int, choose: Callable[[], int]
) -> list[list[Request]]:
    """One list per instance; ``choose()`` picks the instance of each new prompt, and every
    later sample of that prompt follows it."""
    parts: list[list[Request]] = [[] for _ in range(instances)]
    where: dict[str, int] = {}
    for request in requests:
        if request.prompt_id not in where:
            where[request.prompt_id] = choose()
        parts[where[request.prompt_id]].append(request)
    return parts


class RoundRobinDispatcher:
    """Deal prompts to instances in turn, continuing where the last call stopped.

    Examples:
        >>> reqs = [Request(f"p{i}", [3], 4, sample_index=s) for i in range(3) for s in range(2)]
        >>> [[r.key for r in part] for part in RoundRobinDispatcher().plan(reqs, None, 2)]
        [[('p0', 0, 0), ('p0', 1, 0), ('p2', 0, 0), ('p2', 1, 0)], [('p1', 0, 0), ('p1', 1, 0)]]
    """

    def __init__(self) -> None:
        self._next = 0

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        def next_instance() -> int:
            self._next += 1
            return (self._next - 1) % instances

        return split_by_prompt(requests, instances, next_instance)

    def observe(self, lengths: Iterable[int]) -> None:
        """Lengths do not change round-robin's deal."""
        del lengths

    def batch_limits(self, instances: int) -> None:
        """Every instance keeps its batch size."""
        del instances

    def state_dict(self) -> dict:
        return {"next": self._next}

    def load_state_dict(self, state: dict) -> None:
        self._next = int(state["next"])


class RandomDispatcher:
    """Random dispatch (the paper's baseline, §7): each prompt to a uniformly random instance."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> RandomDispatcher:
        """Built for a run: drawn from the run's seed unless ``seed`` is given."""
        return cls(**{"seed": run.seed, **options})

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        return split_by_prompt(requests, instances, lambda: self._rng.randrange(instances))

    def observe(self, lengths: Iterable[int]) -> None:
        """Lengths do not change a random deal."""
        del lengths

    def batch_limits(self, instances: int) -> None:
        """Every instance keeps its batch size."""
        del instances

    def state_dict(self) -> dict:
        return {"rng": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self._rng.setstate(state["rng"])
