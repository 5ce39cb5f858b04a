"""The adaptive planner: plans on length distributions, learns from each group's finished
samples, and moves work between instances mid-flight (beyond StreamRL §5.3).

The paper's Algorithm 2 + LPT plan once, from point estimates, and let the plan run. Work since
acts on what the run learns while it generates (Seer: group context and divided rollout; TIE:
scheduling on a tail-inflated expectation; RollPacker: the tail handled apart). This planner does
four things a ``Dispatcher`` plus a ``Rebalancer`` may (``streamrl.protocols``):

1. **Plan on distributions.** Each request's length is a ``LengthDistribution`` (a distributional
   predictor's, or the point prediction widened by the predictor's error measured on finished
   samples). A group of ``G`` samples costs, for LPT admission, the *expected longest* of its
   ``G`` samples (what it holds its slots for); requests are balanced one by one over the
   instances by expected tokens, so a long group may be split. The paper's placement of the
   predicted tail (Algorithm 2's pools) is replayed beside that plan, and where every decode
   step pays for its widest row (the HF engine) it is kept unless the other wins clearly.
2. **Group context, online** (``GroupContext``): when a sample finishes, its unfinished siblings'
   distributions are updated from it, and their new costs go to the instances that queue them.
3. **Moves.** When an instance has free slots while another is busy, the pool asks each
   instance what it runs (tokens generated so far) and ``rebalance`` moves waiting requests,
   or running ones (which continue from their tokens, ``moving``), from the instance predicted
   to finish last to the one predicted to finish first, while that shortens the predicted
   makespan by more than the move costs. A running sample's remaining work is its
   distribution's ``remaining(generated)``: the longer it has run, the longer it is expected to
   run on (heavy tails); an instance's finish is predicted by ``InstanceWork``.
4. **Deadlines** (``IterationClock``): with several iterations in flight (async mode, a
   staleness bound above 1), a later iteration's requests cost less by the tokens a slot decodes
   per iteration, so admission is by least slack: each window's long samples start early.

Examples:
    >>> from streamrl.records import Request
    >>> planner = AdaptiveDispatcher(max_batch_size=2, recent_lengths=[10, 20, 40, 80])
    >>> reqs = [Request("a", [1], 64, i) for i in range(2)] + [Request("b", [1], 64)]
    >>> [[r.prompt_id for r in part] for part in planner.plan(reqs, [50.0, 50.0, 5.0], 2)]
    [['a', 'b'], ['a']]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.components.skewness.deadlines import IterationClock
from streamrl.components.skewness.group_context import GroupContext
from streamrl.components.skewness.instance_work import InstanceWork
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.refine import refine_plan
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.records import InstanceLoad, LengthDistribution, Move, Request, Sample

if TYPE_CHECKING:
    from streamrl.components.run_context import RunContext

Key = tuple[str, int, int]
#: Spread of log lengths assumed before any length is known.
DEFAULT_SIGMA = 0.8
#: Finished samples against their predictions before their spread replaces ``D``'s.
MIN_RESIDUALS = 32


@dataclass
class _Group:
    """One prompt's samples in one iteration, as the planner follows them."""

    prior: LengthDistribution
    budget: float  # its requests' max_tokens
    open: set[Key] = field(default_factory=set)
    finished: list[int] = field(default_factory=list)


class AdaptiveDispatcher:
    """Distributional planning, group context and mid-flight moves (module docstring).

    Args:
        latency: the instances' ``PTL(BS)``; ``None``: every decode step costs the same (time
            in steps).
        max_batch_size: batch slots per instance.
        tail_aware: order admission by the expected longest of a group's samples; ``False``:
            by one sample's median (the paper's point estimate).
        split_groups: ``True``: balance requests one by one (a group may span instances);
            ``False``: a prompt's samples stay together; ``None`` (default): a priced
            decision, each plan's continuous batching replayed on the latency model (batch
            size and context) and the sooner kept.
        moves: move work mid-flight (``rebalance``); ``False``: plan once.
        move_overhead_s: what moving a running request costs (its re-prefill and the round
            trip); default two decode steps at batch 1.
        min_gain: a move must shorten the predicted makespan by this share at least, and a
            plan that spreads the predicted tail must beat the plan that isolates it by as much.
        tail_share: the share of prompts (``SkewAwareDispatcher``'s ``alpha``) that the paper's
            placement puts on instances of their own (Algorithm 2's pools, §5.1). That plan,
            made of the same predictions, is replayed beside the others and kept if it
            finishes first; on an engine whose every step pays for its widest row (the HF slot
            cache), also unless another is predicted to finish sooner by ``min_gain``: a tail
            spread over every instance widens every batch, which a replay on expected lengths
            underrates. ``None``, or ``split_groups=True``: never isolate the tail.
        max_moves: moves per ``rebalance``.
        recent_lengths: the distribution ``D`` of recent output lengths (refreshed by
            ``observe``); its spread widens point predictions until the predictor's own error
            is known.
        prediction_sigma: the spread of log lengths around a point prediction (the
            predictor's error); ``None``: learned from finished samples against their
            predictions (once ``MIN_RESIDUALS`` are known; ``D``'s spread before, an upper
            bound: a predictor that knew nothing). ``D``'s spread mixes every mode of the
            lengths, and widening a short prediction by it inflates its expected tokens far
            more than a long one's, which its budget caps.
        window: how many recent lengths ``D`` keeps.
        group_context: the within-group spread it learns (a fresh ``GroupContext`` if ``None``).
        staleness_aware: with several iterations in flight (async mode), admit by least slack:
            a later iteration's cost is lowered by the tokens a slot decodes per iteration
            (``IterationClock``, measured), so each window's long samples start early and no
            later iteration crowds out an earlier one.
    """

    def __init__(
        self,
        latency: LatencyModel | None = None,
        max_batch_size: int = 64,
        *,
        tail_aware: bool = True,
        split_groups: bool | None = None,
        moves: bool = True,
        move_overhead_s: float | None = None,
        min_gain: float = 0.03,
        tail_share: float | None = 0.2,
        max_moves: int = 8,
        recent_lengths: Iterable[int] = (),
        prediction_sigma: float | None = None,
        window: int = 4096,
        group_context: GroupContext | None = None,
        staleness_aware: bool = True,
    ) -> None:
        self.latency = latency if latency is not None else LatencyModel([1], [1.0])
        self.max_batch_size = max_batch_size
        self.tail_aware, self.split_groups, self.moves = tail_aware, split_groups, moves
        self._move_overhead_s = move_overhead_s
        if tail_share is not None and not 0 < tail_share < 1:
            raise ValueError(f"tail_share must be in (0, 1) or None, got {tail_share}.")
        self.min_gain, self.max_moves, self.tail_share = min_gain, max_moves, tail_share
        self.recent: deque[int] = deque(recent_lengths, maxlen=window)
        if prediction_sigma is not None and prediction_sigma < 0:
            raise ValueError(f"prediction_sigma must be >= 0 or None, got {prediction_sigma}.")
        self.prediction_sigma = prediction_sigma
        #: log(length / prediction) of recent finished samples (the predictor's error).
        self.residuals: deque[float] = deque(maxlen=window)
        self._scores: dict[Key, float] = {}  # open requests' point predictions
        self._log_stats: tuple[float, float] | None = None  # of ``recent``, while it stands
        self.context = group_context if group_context is not None else GroupContext()
        self._dist: dict[Key, LengthDistribution] = {}  # open requests' current estimates
        self._groups: dict[tuple[str, int], _Group] = {}
        self.moved = 0  # requests moved by its plans
        self.clock = IterationClock() if staleness_aware else None

    @property
    def move_overhead_s(self) -> float:
        """What a move of a running request costs: as given, else two decode steps at batch 1
        of the latency model as it is now (a run's model is measured after the planner is
        built: ``LatencyModel.update_from``)."""
        if self._move_overhead_s is not None:
            return self._move_overhead_s
        return 2 * self.latency.ptl(1)

    @classmethod
    def from_run(cls, run: RunContext, **options: Any) -> AdaptiveDispatcher:
        """Built for a run: its batch size, and the instances' ``PTL(BS)`` when there are
        several (asked of the run only then, which makes it measure it)."""
        latency = run.latency() if run.several_instances else None
        return cls(latency, run.max_batch_size, **options)

    # -- the Dispatcher protocol -------------------------------------------------------------
    def observe(self, lengths: Iterable[int]) -> None:
        """Recent finished samples' output lengths (``D``)."""
        self.recent.extend(int(n) for n in lengths)
        self._log_stats = None

    def batch_limits(self, instances: int) -> None:
        """Every instance keeps its batch size."""
        return None

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        """Assign requests to instances, each costliest first to the least loaded (by expected
        tokens), one by one or a group at a time (``split_groups``), unless the paper's
        placement of the predicted tail (``tail_share``) is predicted to finish about as soon;
        and set each request's ``predicted_length`` to its admission cost."""
        if scores is not None and len(scores) != len(requests):
            raise ValueError("AdaptiveDispatcher.plan needs one predicted length per request.")
        by_group: dict[tuple[str, int], list[Request]] = {}
        for r in requests:
            by_group.setdefault((r.prompt_id, r.iteration), []).append(r)
        for i, request in enumerate(requests):
            dist = self._register(request, None if scores is None else scores[i])
            group = len(by_group[request.prompt_id, request.iteration])
            cost = self._cost(dist, group, request.max_tokens)
            request.predicted_length = cost - self._lead(request.iteration)
        # Each request's expected tokens, once: a plan replays its instances dozens of times
        # and its time delays every instance's start (the bench measures it).
        left = {r.key: self._left(r) for r in requests}
        groups = list(by_group.values())
        spread = self._priced(self._balance([[r] for r in requests], instances, left), False, left)
        if self.split_groups is not True and len(groups) < len(requests):
            whole = self._priced(self._balance(groups, instances, left), True, left)
            # Split unless whole groups finish sooner (beyond rounding: a tie keeps the split).
            sooner = self._makespan(whole, left) < self._makespan(spread, left) * (1 - 1e-9)
            spread = whole if self.split_groups is False or sooner else spread
        paper = None if self.split_groups is True else self._paper_plan(requests, scores, instances)
        if paper is None:
            return spread
        gain = 1 - self._makespan(spread, left) / max(self._makespan(paper, left), 1e-12)
        if self.latency.prices_context and self.latency.load == "widest":
            return spread if gain > self.min_gain else paper
        return spread if gain >= 0 else paper

    def _paper_plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]] | None:
        """The plan ``SkewAwareDispatcher`` makes of the same predictions (Algorithm 2's pools,
        the predicted tail on instances of its own, §5.1), the requests' admission costs kept;
        ``None`` when there is nothing to isolate."""
        if self.tail_share is None or scores is None or instances < 2 or not any(scores):
            return None
        prompts = len({r.prompt_id for r in requests})
        if not 0 < round(self.tail_share * prompts) < prompts:  # no tail to set apart
            return None
        costs = [r.predicted_length for r in requests]
        paper = SkewAwareDispatcher(
            self.latency, self.max_batch_size, self.tail_share, recent_lengths=self.recent
        ).plan(requests, scores, instances)
        for request, cost in zip(requests, costs):
            request.predicted_length = cost
        return paper

    def _priced(
        self, parts: list[list[Request]], together: bool, left: Mapping[Key, float]
    ) -> list[list[Request]]:
        """``parts`` balanced in seconds rather than expected tokens when the latency model
        prices context (``refine_plan``); as they are otherwise."""
        if not self.latency.prices_context:  # equal tokens are equal time
            return parts
        replay = lambda _, part: self._instance_s(part, left)  # noqa: E731
        return refine_plan(parts, replay, together=together)

    def _balance(
        self, units: list[list[Request]], instances: int, left: Mapping[Key, float]
    ) -> list[list[Request]]:
        """Each unit (a request, or a whole group), costliest first, to the instance with the
        fewest expected tokens (``left``: each request's)."""
        units = sorted(units, key=lambda unit: -(unit[0].predicted_length or 0.0))
        parts: list[list[Request]] = [[] for _ in range(instances)]
        loads = [(0.0, 0)] * instances
        for unit in units:
            target = min(range(instances), key=loads.__getitem__)
            parts[target].extend(unit)
            tokens, count = loads[target]
            loads[target] = (tokens + sum(left[r.key] for r in unit), count + len(unit))
        return parts

    def _makespan(self, parts: list[list[Request]], left: Mapping[Key, float]) -> float:
        """The predicted makespan of a plan (``_instance_s`` of each instance)."""
        return max(self._instance_s(part, left) for part in parts)

    def _instance_s(self, part: list[Request], left: Mapping[Key, float]) -> float:
        """Predicted seconds of one instance: its continuous batching replayed on expected
        lengths (``left``: each request's), admitted costliest first, every step priced with
        its contexts (on the HF engine a step pays for its widest row, so a long group spread
        over every instance widens every batch; with paged attention it pays for the tokens
        held)."""
        order = sorted(part, key=lambda r: -(r.predicted_length or 0.0))
        work = InstanceWork(
            0,
            self.max_batch_size,
            {},
            [(r.key, left[r.key]) for r in order],
            {r.key: float(_held(r)) for r in order},
        )
        return work.finish_s(self.latency)[0]

    def state_dict(self) -> dict:
        """``D`` and the learned within-group spread (open requests are the iteration's)."""
        return {
            "recent": list(self.recent),
            "residuals": list(self.residuals),
            "context": self.context.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(int(n) for n in state["recent"])
        self.residuals.clear()
        self.residuals.extend(float(r) for r in state.get("residuals", ()))
        self._log_stats = None
        self.context.load_state_dict(state["context"])

    # -- the Rebalancer protocol -------------------------------------------------------------
    def finished(self, sample: Sample) -> dict[Key, float]:
        """Learn from a finished sample: its open siblings' distributions follow the group's
        finished lengths (``GroupContext``); returns their new admission costs."""
        self._dist.pop(sample.key, None)
        score = self._scores.pop(sample.key, None)
        if score is not None:
            self.residuals.append(math.log(max(sample.length, 1) / score))
        if self.clock is not None:
            self.clock.finished(sample)
        group = self._groups.get((sample.prompt_id, sample.iteration))
        if group is None or sample.key not in group.open:
            return {}
        group.open.discard(sample.key)
        group.finished.append(sample.length)
        if not group.open:
            self.context.observe_group(group.finished)
            del self._groups[sample.prompt_id, sample.iteration]
            return {}
        after = self.context.posterior(group.prior, group.finished)
        costs = {}
        lead = self._lead(sample.iteration)
        for key in group.open:
            self._dist[key] = after
            costs[key] = self._cost(after, len(group.open), group.budget) - lead
        return costs

    def rebalance(self, loads: Sequence[InstanceLoad]) -> list[Move]:
        """Moves, one request at a time, from the instance predicted to finish last to the one
        predicted to finish first, while each shortens the predicted makespan enough."""
        if not self.moves or len(loads) < 2:
            return []
        work = [self._work(load) for load in loads]
        moves: dict[tuple[int, int], list[Key]] = {}
        for _ in range(self.max_moves):
            finish = [w.finish_s(self.latency) for w in work]
            source = max(range(len(work)), key=finish.__getitem__)
            target = min(range(len(work)), key=finish.__getitem__)
            (last, fluid), first = finish[source], finish[target][0]
            needed = max(self.min_gain * last, self.latency.ptl(1))
            if last - first <= needed:
                break
            best = work[source].best_move(work[target], self.latency, self.move_overhead_s)
            if best is None:
                break
            (after, after_fluid), key = best
            # Sooner, or as soon and a better split (the next move can then shorten it).
            if not (after < last - needed or (after <= last and after_fluid < fluid - needed)):
                break
            work[target].take(work[source], key, self.move_overhead_s, self.latency)
            pair = (work[source].instance_id, work[target].instance_id)
            moves.setdefault(pair, []).append(key)
        self.moved += sum(map(len, moves.values()))
        return [Move(tuple(keys), s, t) for (s, t), keys in moves.items()]

    # -- estimates ---------------------------------------------------------------------------
    def distribution(self, request: Request) -> LengthDistribution:
        """The current estimate of ``request``'s length (registered at ``plan``)."""
        dist = self._dist.get(request.key)
        return dist if dist is not None else self._prior(request.length_dist, None)

    def _register(self, request: Request, score: float | None) -> LengthDistribution:
        known = self._dist.get(request.key)
        if known is not None:  # requeued (its instance failed): its estimate stands
            return known
        if score is not None:  # no sample outlasts its budget
            score = min(float(score), float(request.max_tokens))
            if score > 0 and request.length_dist is None:
                self._scores[request.key] = max(score, 1.0)
        dist = self._prior(request.length_dist, score)
        if self.clock is not None:
            self.clock.opened(request.iteration, [request.key])
        self._dist[request.key] = dist
        group = self._groups.setdefault(
            (request.prompt_id, request.iteration), _Group(dist, float(request.max_tokens))
        )
        group.open.add(request.key)
        return dist

    def _prior(self, given: LengthDistribution | None, score: float | None) -> LengthDistribution:
        """A predictor's distribution; else the point score (or the median of ``D``) widened by
        the spread of ``D`` (what is not known is as wide as the lengths themselves)."""
        if given is not None:
            return given
        mu, sigma = self._recent_log_stats()
        if score is not None and score > 0:
            return LengthDistribution(math.log(max(float(score), 1.0)), self._error_sigma(sigma))
        return LengthDistribution(mu, sigma)

    def _error_sigma(self, fallback: float) -> float:
        """The spread of log lengths around a point prediction: as given, else the root mean
        square of the recent residuals (``fallback``, ``D``'s spread, until there are
        ``MIN_RESIDUALS``)."""
        if self.prediction_sigma is not None:
            return self.prediction_sigma
        if len(self.residuals) < MIN_RESIDUALS:
            return fallback
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals))

    def _recent_log_stats(self) -> tuple[float, float]:
        """The median and spread of ``D``'s log lengths, computed once per change of ``D``
        (a plan asks for them once per request)."""
        if self._log_stats is None:
            logs = np.log(np.maximum(np.asarray(self.recent, dtype=float), 1.0))
            sigma = float(logs.std()) if logs.size > 1 else DEFAULT_SIGMA
            self._log_stats = (float(np.median(logs)) if logs.size else math.log(32), sigma)
        return self._log_stats

    def _lead(self, iteration: int) -> float:
        """Tokens of slack a request of ``iteration`` has over the oldest iteration in flight."""
        lead = self.clock.lead(iteration) if self.clock is not None else None
        return lead or 0.0

    def _cost(self, dist: LengthDistribution, group: int, budget: float) -> float:
        """The admission cost: the expected longest of the group's samples (or one sample's
        median, the paper's point), none longer than the budget."""
        return dist.expected_max(group, budget) if self.tail_aware else min(dist.median, budget)

    def _left(self, request: Request, generated: int | None = None) -> float:
        """Expected tokens still to generate after ``generated`` (default: what it brought
        when it moved here), at most what its budget leaves."""
        if generated is None:
            generated = len(request.progress.token_ids) if request.progress is not None else 0
        return self.distribution(request).remaining(generated, cap=request.max_tokens)

    def _work(self, load: InstanceLoad) -> InstanceWork:
        """What ``load``'s instance is expected to generate still, in admission order."""
        running = {r.key: self._left(r, generated) for r, generated in load.running}
        order = sorted(load.waiting, key=lambda r: -(r.predicted_length or 0.0))
        waiting = [(r.key, self._left(r)) for r in order]
        contexts = {r.key: float(len(r.prompt_ids) + generated) for r, generated in load.running}
        contexts.update((r.key, float(_held(r))) for r in order)
        return InstanceWork(load.instance_id, max(1, load.batch_limit), running, waiting, contexts)


def _held(request: Request) -> int:
    """Tokens a request brings to the instance that admits it: its prompt, and what it
    generated on another instance before it moved."""
    moved = len(request.progress.token_ids) if request.progress is not None else 0
    return len(request.prompt_ids) + moved
