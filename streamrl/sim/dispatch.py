"""Generation-only simulation of ``streamrl bench dispatch`` (StreamRL §5.3, Fig. 9).

Every prompt is dispatched at time 0 to the instances by the real dispatcher classes (random, or
``SkewAwareDispatcher``'s Algorithm 2 on predicted or true lengths) and admitted FIFO or LPT;
the makespan is the last finish. Unlike ``simulate_instance`` it charges a prefill pass at every
admission and a ``PTL`` slowdown for shared cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from streamrl.components.skewness.dispatch import RandomDispatcher
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.records import Request
from streamrl.sim.instance import SimInstance

Policy = Literal["random", "skew", "oracle"]


def generation_makespan_s(
    policy: Policy,
    true: Sequence[int],
    predicted: Sequence[float],
    instances: int,
    latency: LatencyModel,
    max_batch_size: int,
    slowdown: float = 1.0,
    prefill_s: float = 0.0,
    seed: int = 0,
    recent: Sequence[int] | None = None,
) -> float:
    """Seconds until every sample has finished, under ``policy`` (as the real bench runs it).

    Args:
        policy: ``random`` (+ FIFO), ``skew`` (Algorithm 2 + LPT on ``predicted``) or
            ``oracle`` (the same on ``true``).
        true: output lengths, one per prompt (one sample each).
        predicted: predicted output lengths, in the same order.
        recent: lengths seen before this batch (an earlier iteration), from which ``skew`` takes
            its P50/P90 thresholds (Algorithm 2's ``D``); without them, the predictions. Only
            ``oracle`` sets them from ``true``: the batch's own lengths are not known before it
            is generated.
    """
    requests = [
        Request(f"p{i}", [0], n, forced_length=n, predicted_length=p)
        for i, (n, p) in enumerate(zip(true, predicted))
    ]
    if policy == "random":
        parts = RandomDispatcher(seed).plan(requests, None, instances)
    else:
        oracle = policy == "oracle"
        scores = [float(n) for n in true] if oracle else list(predicted)
        known = true if oracle else (recent or [round(p) for p in predicted])
        dispatcher = SkewAwareDispatcher(latency, max_batch_size, recent_lengths=known)
        parts = dispatcher.plan(requests, scores, instances)
    makespan = 0.0
    for index, part in enumerate(parts):
        queue = FIFOScheduler() if policy == "random" else LPTScheduler()
        inst = SimInstance(index, latency, max_batch_size, queue, slowdown, prefill_s)
        inst.release(part, 0.0)
        done = inst.advance(float("inf"))
        makespan = max([makespan] + [at for _, at in done])
    return makespan
