"""Generation on simulated instances with a planner that acts while it runs (issue 34).

``simulate_generation`` dispatches one batch of requests at time 0 with a real ``Dispatcher``
(``SkewAwareDispatcher``, ``AdaptiveDispatcher``, yours) onto ``SimInstance`` s (continuous
batching at ``PTL(BS)``, LPT or FIFO admission) and advances them event by event. When the
dispatcher is also a ``Rebalancer`` it is driven as the real pool drives it
(``streamrl.components.generation.rebalancing``): each finished sample goes to its ``finished``
(new admission costs for the siblings still queued), and whenever an instance has free slots
while another holds two requests or more, its ``rebalance`` sees every instance's running
requests (with their tokens so far) and queues, and its moves are applied at once: a moved
running request is admitted on its target like any request, after a re-prefill of its prompt and
tokens (``prefill_s`` + ``prefill_s_per_token`` per token). Speculative decoding in the tail
(``TailSpeculation``) speeds up instances running few samples, for every policy alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from streamrl.components.generation.speculative import TailSpeculation
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import LPTScheduler
from streamrl.protocols import AdmissionScheduler, Dispatcher, Rebalancer
from streamrl.records import InstanceLoad, Progress, Request, Sample
from streamrl.sim.instance import SimInstance


@dataclass
class GenerationResult:
    """What one simulated batch did.

    Attributes:
        makespan_s: when its last sample finished.
        requests_moved: requests moved between instances (``running_moved`` of them running,
            with ``tokens_moved`` tokens prefilled again on their target).
        rebalances: times the planner was asked.
    """

    makespan_s: float
    requests_moved: int = 0
    running_moved: int = 0
    tokens_moved: int = 0
    rebalances: int = 0


def simulate_generation(
    dispatcher: Dispatcher,
    requests: Sequence[Request],
    scores: Sequence[float] | None,
    instances: int,
    latency: LatencyModel,
    max_batch_size: int,
    *,
    scheduler: Callable[[], AdmissionScheduler] = LPTScheduler,
    prefill_s: float = 0.0,
    prefill_s_per_token: float = 0.0,
    prompt_tokens: int = 0,
    speculation: TailSpeculation | None = None,
) -> GenerationResult:
    """Simulate one batch (module docstring); every request needs its ``forced_length``.

    Args:
        dispatcher: plans the batch (and moves work, if it is a ``Rebalancer``).
        requests: the batch, one request per sample (true lengths in ``forced_length``).
        scores: predicted lengths for the dispatcher, one per request, or ``None``.
        instances: simulated instances.
        latency: their ``PTL(BS)``.
        max_batch_size: slots per instance (unless the dispatcher sets per-pool limits).
        scheduler: each instance's admission queue.
        prefill_s: seconds of a prefill pass at each admission.
        prefill_s_per_token: seconds per token a moved running request prefills again.
        prompt_tokens: prompt length (part of what a moved request prefills again).
        speculation: speculative decoding in the tail (``None``: off).
    """
    parts = dispatcher.plan(list(requests), scores, instances)
    limits = dispatcher.batch_limits(instances) or [max_batch_size] * instances
    sims = [
        SimInstance(
            i,
            latency,
            limits[i],
            scheduler(),
            prefill_s=prefill_s,
            prefill_s_per_token=prefill_s_per_token,
            prompt_tokens=prompt_tokens,
            speculation=speculation,
        )
        for i in range(instances)
    ]
    for sim, part in zip(sims, parts):
        sim.release(part, 0.0)
    planner = dispatcher if isinstance(dispatcher, Rebalancer) else None
    result = GenerationResult(0.0)
    if planner is not None and _due(sims):  # as the pool asks right after a dispatch
        _rebalance(planner, sims, 0.0, result)
    while True:
        now = min(sim.next_finish_s() for sim in sims)
        if now == float("inf"):
            break
        for sim in sims:
            for running, at in sim.advance(now):
                result.makespan_s = max(result.makespan_s, at)
                if planner is not None:
                    _finished(planner, sims, running.request, sim.instance_id)
        if planner is not None and _due(sims):
            _rebalance(planner, sims, now, result)
    if any(sim.waiting() for sim in sims):
        raise RuntimeError("simulate_generation: requests left waiting with nothing running.")
    return result


def _finished(planner: Rebalancer, sims: list[SimInstance], request: Request, where: int) -> None:
    length = int(request.forced_length)
    sample = Sample(
        request.prompt_id,
        request.sample_index,
        request.prompt_ids,
        [0] * length,
        [0.0] * length,
        0,
        where,
        iteration=request.iteration,
    )
    costs = planner.finished(sample)
    if costs:
        for sim in sims:
            sim.reprioritize(costs)


def _due(sims: list[SimInstance]) -> bool:
    """One instance has free slots while another holds two requests or more (as the pool's)."""
    held = [len(sim.running) + len(sim.waiting()) for sim in sims]
    return any(n < sim.max_batch_size for n, sim in zip(held, sims)) and max(held) >= 2


def _rebalance(
    planner: Rebalancer, sims: list[SimInstance], now: float, result: GenerationResult
) -> None:
    loads = [
        InstanceLoad(
            sim.instance_id,
            sim.max_batch_size,
            [(r.request, int(r.generated + 1e-6)) for r in sim.running],
            sim.waiting(),
        )
        for sim in sims
    ]
    result.rebalances += 1
    for move in planner.rebalance(loads):
        taken = sims[move.source].withdraw(set(move.keys), now)
        moved = []
        for request, done in taken:
            if done:
                progress = Progress([0] * done, [0.0] * done, [0] * done, 0, now)
                request = replace(request, progress=progress)
                result.running_moved += 1
                result.tokens_moved += done
            moved.append(request)
        result.requests_moved += len(moved)
        sims[move.target].release(moved, now)
