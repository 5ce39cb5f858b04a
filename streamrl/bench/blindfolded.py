"""What a dispatcher under test may know in ``streamrl bench dispatch``: prompts, predictions and
``D``, never the forced (true) lengths the bench generates to.

``Blindfolded`` hands the dispatcher copies of the requests stripped of ``forced_length`` and maps
its plan back onto the originals; ``BlindfoldedRebalancer`` does the same for a planner that also
moves work mid-flight (its loads are stripped too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from streamrl.components.skewness.dispatch import Dispatcher
from streamrl.records import InstanceLoad, LengthDistribution, Move, Request, Sample


class Blindfolded:
    """A dispatcher that plans on copies of the requests stripped of their forced (true)
    lengths; the plan is mapped back onto the originals, with the predicted lengths it set.

    Args:
        inner: the dispatcher to blindfold.
        max_batch_size: every instance's batch size when ``inner`` has no per-pool sizes.
        distributions: each prompt's predicted length distribution, by prompt id, handed to
            ``inner`` on its requests (``Request.length_dist``) as ``RolloutStream`` hands a
            distributional predictor's.
    """

    def __init__(
        self,
        inner: Dispatcher,
        max_batch_size: int,
        distributions: Mapping[str, LengthDistribution] | None = None,
    ) -> None:
        self.inner, self.max_batch_size = inner, max_batch_size
        self.distributions = dict(distributions or {})

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        blind = [
            replace(
                r,
                forced_length=None,
                length_dist=self.distributions.get(r.prompt_id, r.length_dist),
            )
            for r in requests
        ]
        original = {id(b): r for b, r in zip(blind, requests)}
        parts = self.inner.plan(blind, scores, instances)
        for part in parts:
            for b in part:
                original[id(b)].predicted_length = b.predicted_length
        return [[original[id(b)] for b in part] for part in parts]

    def batch_limits(self, instances: int) -> list[int]:
        """The inner plan's per-instance batch sizes (full batches for random dispatch)."""
        limits = self.inner.batch_limits(instances)
        return limits if limits is not None else [self.max_batch_size] * instances

    def observe(self, lengths: Iterable[int]) -> None:
        self.inner.observe(lengths)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class BlindfoldedRebalancer(Blindfolded):
    """``Blindfolded`` around a dispatcher that also rebalances mid-flight (``Rebalancer``):
    what it learns comes from finished samples and the instances' progress, never from the
    forced lengths."""

    def finished(self, sample: Sample) -> Mapping[tuple, float]:
        return self.inner.finished(sample)

    def rebalance(self, loads: Sequence[InstanceLoad]) -> list[Move]:
        def blind(request: Request) -> Request:
            return replace(request, forced_length=None)

        return self.inner.rebalance(
            [
                InstanceLoad(
                    load.instance_id,
                    load.batch_limit,
                    [(blind(r), n) for r, n in load.running],
                    [blind(r) for r in load.waiting],
                )
                for load in loads
            ]
        )
