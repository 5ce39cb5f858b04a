"""Per-sample replay of continuous batching on one generator instance (StreamRL §5.1, Eq. 1).

``streamrl.components.skewness.latency.simulate_instance`` returns one instance's makespan;
the simulator and the allocator also need *when each sample finishes* (the stream the trainer
consumes, §4.1). Each decode step advances every running sequence by one token and costs ``PTL``
of the number running; a finished sequence frees its slot for the next waiting one at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrl.components.skewness.latency import LatencyModel


def decode_schedule(
    lengths: Sequence[float],
    max_batch_size: int,
    latency: LatencyModel,
    start_s: float = 0.0,
    slowdown: float = 1.0,
) -> list[tuple[float, float]]:
    """``(admitted_s, finished_s)`` of each sample, admitted in the given order.

    Args:
        lengths: output tokens per sample, in admission order.
        max_batch_size: batch slots of the instance.
        latency: its ``PTL(BS)``.
        start_s: when the instance starts (all samples are waiting then).
        slowdown: multiplies every step's ``PTL`` (e.g. a CPU core shared with a trainer).

    Examples:
        >>> m = LatencyModel([1, 2], [1.0, 1.5])
        >>> decode_schedule([2, 4], 2, m)  # 2 steps at BS 2, then 2 at BS 1
        [(0.0, 3.0), (0.0, 5.0)]
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(lengths)
    waiting = list(range(len(lengths)))[::-1]  # pop() from the end = admission order
    running: dict[int, float] = {}  # sample index -> tokens left
    now = start_s
    while waiting or running:
        while waiting and len(running) < max_batch_size:
            i = waiting.pop()
            running[i] = float(lengths[i])
            out[i] = (now, now)
        step = min(running.values())  # the batch size is constant until the next finish
        now += step * latency.ptl(len(running)) * slowdown
        for i in [i for i, left in running.items() if left - step <= 1e-9]:
            del running[i]
            out[i] = (out[i][0], now)
        for i in running:
            running[i] -= step
    return out
