"""One simulated generator instance: continuous batching with ``PTL(BS)`` (StreamRL §5.1, §5.3).

The instance decodes its running samples one token per step; a step costs ``PTL`` of the number
running (Eq. 1), so between two finishes its speed is constant. Requests it was dispatched are
held until it has loaded the weight version they need (``Request.min_weight_version``, as a
real instance holds them), then queue in its admission scheduler (the real ``FIFOScheduler`` /
``LPTScheduler``).

Weight versions arrive with ``offer``; when the instance loads one follows the partial-rollout
policy of the real ``WeightLoader`` (``streamrl.components.generation.partial``):

- ``"finish"``: only once idle (nothing running, nothing queued), then the newest received;
- ``"keep"``: at once; running samples go on under the new weights;
- ``"recompute"``: at once, then one prefill pass of the running samples' current lengths
  (``recompute_cost_s``) before the next decode step.

Each running sample counts the tokens each version drew (``Running.tokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from streamrl.components.generation.speculative import TailSpeculation
from streamrl.components.skewness.latency import LatencyModel
from streamrl.protocols import AdmissionScheduler
from streamrl.records import Request

_EPS = 1e-9


@dataclass
class Running:
    """A sample being decoded.

    Attributes:
        request: what it decodes.
        left: tokens still to decode (fractional between two events).
        admitted_s: when it took its slot.
        version: the weights loaded at admission (the real ``Sample.weight_version``).
        tokens: tokens drawn by each weight version, the last entry still growing (``close``
            completes it); the real ``Sample.token_versions``, counted.
    """

    request: Request
    left: float
    admitted_s: float
    version: int = 0
    tokens: dict[int, int] = field(default_factory=dict)
    _current: int = 0  # the version drawing now
    _mark: int = 0  # tokens drawn before ``_current`` loaded

    def __post_init__(self) -> None:
        self._current = self.version

    @property
    def generated(self) -> float:
        return float(self.request.forced_length) - self.left

    def switch(self, version: int) -> None:
        """New weights load between two decode steps: the step in progress still belongs to the
        old ones (so the count rounds up)."""
        done = min(self.request.forced_length, math.ceil(self.generated - 1e-6))
        if done > self._mark:
            self.tokens[self._current] = self.tokens.get(self._current, 0) + done - self._mark
        self._current, self._mark = version, max(done, self._mark)

    def close(self) -> dict[int, int]:
        """The finished sample's tokens per version."""
        rest = self.request.forced_length - self._mark
        if rest > 0:
            self.tokens[self._current] = self.tokens.get(self._current, 0) + rest
            self._mark = self.request.forced_length
        return self.tokens


class SimInstance:
    """A generator instance advanced by the event loop.

    Args:
        instance_id: its lane number (``generator-<id>`` in the trace).
        latency: ``PTL(BS)``.
        max_batch_size: batch slots.
        queue: its admission queue (``LPTScheduler``: the longest predicted first; any
            ``AdmissionScheduler``).
        slowdown: multiplies every step's ``PTL`` (and the per-token part of a re-prefill).
        prefill_s: seconds the instance spends on a prefill pass each time it admits samples
            (running samples wait meanwhile; a real instance prefills new rows in one forward),
            and the fixed part of a re-prefill.
        partial_rollout: ``"finish"``, ``"keep"`` or ``"recompute"`` (module docstring).
        prefill_s_per_token: seconds per padded token of a re-prefill (``"recompute"``).
        prompt_tokens: prompt length, part of a running sample's length when re-prefilled.
        version: the weight version loaded at the start.
        speculation: speculative decoding in the tail (``TailSpeculation``); ``None``: off.
    """

    def __init__(
        self,
        instance_id: int,
        latency: LatencyModel,
        max_batch_size: int,
        queue: AdmissionScheduler,
        slowdown: float = 1.0,
        prefill_s: float = 0.0,
        *,
        partial_rollout: str = "finish",
        prefill_s_per_token: float = 0.0,
        prompt_tokens: int = 0,
        version: int = 0,
        speculation: TailSpeculation | None = None,
    ) -> None:
        self.instance_id, self.latency, self.max_batch_size = instance_id, latency, max_batch_size
        self.slowdown, self.prefill_s = slowdown, prefill_s
        self.policy, self.prefill_s_per_token = partial_rollout, prefill_s_per_token
        self.prompt_tokens, self.version = prompt_tokens, version
        self.speculation = speculation
        self.paused_until = 0.0  # prefilling: no decode step before this
        self.queue = queue
        self.running: list[Running] = []
        self.held: list[Request] = []  # released, but needing weights not loaded yet
        self.pending: list[int] = []  # received versions not loaded yet
        self.loads: list[tuple[float, int]] = []  # (when, version) of each load
        self.recomputes: list[tuple[float, float, int]] = []  # re-prefills: start, end, version
        self.now = 0.0

    @property
    def recompute_s(self) -> float:
        """Seconds spent re-prefilling running samples so far."""
        return sum(end - start for start, end, _ in self.recomputes)

    @property
    def idle(self) -> bool:
        """Nothing running and nothing admissible waiting (as the real generator's ``idle``)."""
        return not self.running and not len(self.queue)

    def _contexts(self) -> list[float]:
        """The tokens each running sample holds: its prompt (its own, or ``prompt_tokens`` if
        longer: the simulator's requests carry a placeholder) and what it generated."""
        return [
            max(self.prompt_tokens, len(r.request.prompt_ids)) + r.generated for r in self.running
        ]

    def _scale(self) -> float:
        """What multiplies the latency model's decode seconds: the shared-core slowdown, and in
        the tail with speculation a verify step over the tokens it yields on average."""
        spec = self.speculation
        if spec is not None and len(self.running) <= spec.max_running:
            return self.slowdown * spec.verify_cost / spec.tokens_per_step
        return self.slowdown

    def waiting(self) -> list[Request]:
        """Its requests not running: queued (in admission order) and held for their weights."""
        queued = [self.queue.pop() for _ in range(len(self.queue))]
        for request in queued:
            self.queue.push(request)
        return queued + self.held

    def withdraw(self, keys: set[tuple], now: float) -> list[tuple[Request, int]]:
        """Take these requests off (they move): each with the tokens it generated (0 if it
        was waiting)."""
        self.advance(now)
        queued = [self.queue.pop() for _ in range(len(self.queue))]
        for request in queued:
            if request.key not in keys:
                self.queue.push(request)
        taken = [(r, 0) for r in queued + self.held if r.key in keys]
        self.held = [r for r in self.held if r.key not in keys]
        for r in [r for r in self.running if r.request.key in keys]:
            self.running.remove(r)
            taken.append((r.request, math.floor(r.generated + 1e-6)))
        self._settle()
        return taken

    def reprioritize(self, costs: dict[tuple, float]) -> None:
        """New admission costs of queued requests (as ``AdmissionQueue.reprioritize``)."""
        queued = [self.queue.pop() for _ in range(len(self.queue))]
        for request in queued:
            request.predicted_length = costs.get(request.key, request.predicted_length)
            self.queue.push(request)

    def release(self, requests: list[Request], now: float) -> None:
        """Hand ``requests`` over; those the loaded weights may serve queue at once, the others
        are held for their version. Fills free slots."""
        self.advance(now)
        self.held.extend(requests)
        self._settle()

    def offer(self, version: int, now: float) -> None:
        """Weights of ``version`` have arrived; load them if the policy allows it now."""
        self.advance(now)
        self.pending.append(version)
        self._settle()

    def recompute_cost_s(self) -> float:
        """One batched prefill of every running sample, prompt and tokens so far (right-padded
        to the longest, as ``HFStreamGenerator.recompute_running`` does)."""
        if not self.running:
            return 0.0
        width = self.prompt_tokens + max(math.ceil(r.generated - 1e-6) for r in self.running)
        padded = len(self.running) * width
        return self.prefill_s + self.prefill_s_per_token * padded * self.slowdown

    def next_finish_s(self) -> float:
        """When the next running sample finishes (``inf`` when idle)."""
        if not self.running:
            return float("inf")
        start = max(self.now, self.paused_until)
        steps = min(r.left for r in self.running)
        return start + self.latency.decode_s(self._contexts(), steps) * self._scale()

    def advance(self, to_s: float) -> list[tuple[Running, float]]:
        """Decode until ``to_s``; returns the samples finished on the way, with their times."""
        finished: list[tuple[Running, float]] = []
        while self.running and self.next_finish_s() <= to_s + _EPS:
            at = self.next_finish_s()
            self._progress(at)
            done = [r for r in self.running if r.left <= _EPS]
            self.running = [r for r in self.running if r.left > _EPS]
            for r in done:
                r.close()
            finished += [(r, at) for r in done]
            self._settle()
        self._progress(max(to_s, self.now))
        return finished

    def _progress(self, to_s: float) -> None:
        start = max(self.now, self.paused_until)
        if self.running and to_s > start:
            most = min(r.left for r in self.running)
            seconds = (to_s - start) / self._scale()
            tokens = self.latency.steps_within(self._contexts(), seconds, most)
            for r in self.running:
                r.left -= tokens
        self.now = max(self.now, to_s)

    def _settle(self) -> None:
        """Queue what the loaded weights admit, fill slots, load pending weights if allowed."""
        if self.pending and self.policy != "finish":  # between two decode steps
            self._load()
        self._unhold()
        self._admit()
        if self.pending and self.idle:  # "finish": once nothing it may still serve is left
            self._load()
            self._unhold()
            self._admit()

    def _load(self) -> None:
        newest = max(self.pending)
        self.pending = []
        if newest <= self.version:
            return
        self.version = newest
        self.loads.append((self.now, newest))
        for r in self.running:
            r.switch(newest)
        if self.policy == "recompute" and self.running:
            cost = self.recompute_cost_s()
            start = max(self.now, self.paused_until)
            self.paused_until = start + cost
            self.recomputes.append((start, start + cost, newest))

    def _unhold(self) -> None:
        ready = [r for r in self.held if r.min_weight_version <= self.version]
        if ready:
            self.held = [r for r in self.held if r.min_weight_version > self.version]
            for request in ready:
                self.queue.push(request)

    def _admit(self) -> None:
        admitted = False
        moved_tokens = 0  # a moved running request's prompt and tokens are prefilled again
        prompts = []  # the fresh requests' prompts: one batched prefill, as the model prices it
        while len(self.queue) and len(self.running) < self.max_batch_size:
            request = self.queue.pop()
            done = len(request.progress.token_ids) if request.progress is not None else 0
            if done:
                moved_tokens = max(moved_tokens, self.prompt_tokens + done)
            else:
                prompts.append(max(self.prompt_tokens, len(request.prompt_ids)))
            self.running.append(
                Running(request, float(request.forced_length - done), self.now, self.version)
            )
            admitted = True
        cost = self.prefill_s + self.prefill_s_per_token * moved_tokens * self.slowdown
        cost += self.latency.prefill_s(prompts) * self.slowdown
        if admitted and cost > 0:
            self.paused_until = max(self.now, self.paused_until) + cost
