"""Per-sample replay of continuous batching on one generator instance (StreamRL §5.1, Eq. 1).

The simulator and the allocator need *when each sample finishes* (the stream the trainer
consumes, §4.1), the dispatchers an instance's makespan. Each decode step advances every running
sequence by one token and costs what the latency model prices a step over their contexts
(``LatencyModel.decode_s``: ``PTL`` of the number running, plus the context term); a finished
sequence frees its slot for the next waiting one at once, and each admission pays its prefill.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from streamrl.components.skewness.latency import LatencyModel


def decode_schedule(
    lengths: Sequence[float],
    max_batch_size: int,
    latency: LatencyModel,
    start_s: float = 0.0,
    slowdown: float = 1.0,
    *,
    contexts: Sequence[float] | None = None,
    prefilled: int = 0,
) -> list[tuple[float, float]]:
    """``(admitted_s, finished_s)`` of each sample, admitted in the given order.

    Args:
        lengths: output tokens per sample, in admission order.
        max_batch_size: batch slots of the instance.
        latency: its step costs.
        start_s: when the instance starts (all samples are waiting then).
        slowdown: multiplies every step's cost (e.g. a CPU core shared with a trainer).
        contexts: the tokens each sample holds when it is admitted (its prompt, and what it
            generated elsewhere); default 0.
        prefilled: the first ``prefilled`` samples are running already: no prefill is paid for
            them.

    Examples:
        >>> m = LatencyModel([1, 2], [1.0, 1.5])
        >>> decode_schedule([2, 4], 2, m)  # 2 steps at BS 2, then 2 at BS 1
        [(0.0, 3.0), (0.0, 5.0)]
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
    if not all(math.isfinite(n) for n in lengths):  # a NaN never finishes: refuse, never hang
        raise ValueError(f"decode_schedule: every length must be finite, got {list(lengths)}.")
    held = [0.0] * len(lengths) if contexts is None else [float(c) for c in contexts]
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(lengths)
    # A token clock ``steps``: a row admitted at ``steps = a`` holding ``h`` tokens holds
    # ``h - a + steps`` later, so each keeps ``h - a`` (its base) and the loads follow from the
    # sum of the bases and the largest (a heap, finished rows dropped when they surface).
    ends: list[tuple[float, int]] = []  # (steps at its finish, sample)
    widest: list[tuple[float, int]] = []  # (-base, sample)
    bases: dict[int, float] = {}  # running sample -> base
    base_sum, steps, now, admit = 0.0, 0.0, start_s, 0
    while admit < len(lengths) or bases:
        admitted = []  # what the next prefill reads
        while admit < len(lengths) and len(bases) < max_batch_size:
            i, admit = admit, admit + 1
            bases[i] = held[i] - steps
            base_sum += bases[i]
            heapq.heappush(ends, (steps + float(lengths[i]), i))
            heapq.heappush(widest, (-bases[i], i))
            if i >= prefilled:
                admitted.append(held[i])
            out[i] = (now, now)
        now += latency.prefill_s(admitted) * slowdown
        while widest[0][1] not in bases:
            heapq.heappop(widest)
        rows = len(bases)
        if latency.load == "widest":
            load = rows * (steps - widest[0][0])
        else:
            load = base_sum + rows * steps
        span = ends[0][0] - steps  # the batch size is constant until the next finish
        now += latency.decode_load_s(rows, load, span) * slowdown
        steps = ends[0][0]
        while ends and ends[0][0] - steps <= 1e-9:
            _, i = heapq.heappop(ends)
            base_sum -= bases.pop(i)
            out[i] = (out[i][0], now)
    return out


def simulate_instance(
    lengths: Sequence[float],
    max_batch_size: int,
    latency: LatencyModel,
    contexts: Sequence[float] | None = None,
    prefilled: int = 0,
) -> float:
    """Seconds for one continuously batched instance to finish ``lengths``, admitted in order
    (``decode_schedule``'s last finish)."""
    schedule = decode_schedule(
        lengths, max_batch_size, latency, contexts=contexts, prefilled=prefilled
    )
    return max((end for _, end in schedule), default=0.0)
