"""One simulated generator instance: continuous batching with ``PTL(BS)`` (StreamRL §5.1, §5.3).

The instance decodes its running samples one token per step; a step costs ``PTL`` of the number
running (Eq. 1), so between two finishes its speed is constant. Requests it was dispatched wait
until their release time (the weight version they need has arrived, as a real instance holds
them), then queue in its admission scheduler (the real ``FIFOScheduler`` / ``LPTScheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.records import Request

_EPS = 1e-9


@dataclass
class Running:
    """A sample being decoded."""

    request: Request
    left: float
    admitted_s: float


class SimInstance:
    """A generator instance advanced by the event loop.

    Args:
        instance_id: its lane number (``generator-<id>`` in the trace).
        latency: ``PTL(BS)``.
        max_batch_size: batch slots.
        lpt: admit the longest predicted first (else FIFO).
        slowdown: multiplies every step's ``PTL``.
        prefill_s: seconds the instance spends on a prefill pass each time it admits samples
            (running samples wait meanwhile; a real instance prefills new rows in one forward).
    """

    def __init__(
        self,
        instance_id: int,
        latency: LatencyModel,
        max_batch_size: int,
        lpt: bool,
        slowdown: float = 1.0,
        prefill_s: float = 0.0,
    ) -> None:
        self.instance_id, self.latency, self.max_batch_size = instance_id, latency, max_batch_size
        self.slowdown, self.prefill_s = slowdown, prefill_s
        self.paused_until = 0.0  # prefilling: no decode step before this
        self.queue: FIFOScheduler | LPTScheduler = LPTScheduler() if lpt else FIFOScheduler()
        self.running: list[Running] = []
        self.now = 0.0

    def step_s(self) -> float:
        """Seconds per decode step at the current batch size."""
        return self.latency.ptl(len(self.running)) * self.slowdown

    def release(self, requests: list[Request], now: float) -> None:
        """Queue ``requests`` (their weight version has arrived) and fill free slots."""
        self.advance(now)
        for request in requests:
            self.queue.push(request)
        self._admit()

    def next_finish_s(self) -> float:
        """When the next running sample finishes (``inf`` when idle)."""
        if not self.running:
            return float("inf")
        start = max(self.now, self.paused_until)
        return start + min(r.left for r in self.running) * self.step_s()

    def advance(self, to_s: float) -> list[tuple[Running, float]]:
        """Decode until ``to_s``; returns the samples finished on the way, with their times."""
        finished: list[tuple[Running, float]] = []
        while self.running and self.next_finish_s() <= to_s + _EPS:
            at = self.next_finish_s()
            self._progress(at)
            done = [r for r in self.running if r.left <= _EPS]
            self.running = [r for r in self.running if r.left > _EPS]
            finished += [(r, at) for r in done]
            self._admit()
        self._progress(max(to_s, self.now))
        return finished

    def _progress(self, to_s: float) -> None:
        start = max(self.now, self.paused_until)
        if self.running and to_s > start:
            tokens = (to_s - start) / self.step_s()
            for r in self.running:
                r.left -= tokens
        self.now = max(self.now, to_s)

    def _admit(self) -> None:
        admitted = False
        while len(self.queue) and len(self.running) < self.max_batch_size:
            request = self.queue.pop()
            self.running.append(Running(request, float(request.forced_length), self.now))
            admitted = True
        if admitted and self.prefill_s > 0:
            self.paused_until = max(self.now, self.paused_until) + self.prefill_s
