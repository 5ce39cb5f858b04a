"""Admission: which waiting requests a stream generator lets into its batch slots (StreamRL §5).

Requests are validated, then wait in an ``AdmissionScheduler`` (FIFO, or longest predicted first
for §5.3) until a batch slot frees; at most ``batch_limit`` sequences run at once (a
skewness-aware dispatcher gives long-tail instances small batches). ``HFStreamGenerator`` and
``VLLMStreamGenerator`` each hold an ``AdmissionQueue`` and differ only in how they decode.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from streamrl.components.skewness.schedulers import AdmissionScheduler, FIFOScheduler
from streamrl.records import Request, Sample


class AdmissionQueue:
    """The requests waiting for one stream generator's batch slots, and how many may run at once.

    StreamRL §5 (continuous batching in an SGS instance) and §5.3 (a batch limit per instance).
    A generator holds one: its ``submit`` hands requests over with the model's context length,
    and each step it takes ``admit(running, now)``: the requests that fill its free slots.

    Args:
        max_batch_size: batch slots (sequences running at once).
        scheduler: admission order; FIFO if ``None``.
        resumable: whether a request continues an episode whose prefix the generator kept
            (its KV cache); such requests are admitted before the scheduler's, so the kept cache
            is used before it is evicted. ``None``: no request is.

    Raises:
        ValueError: ``max_batch_size`` is below 1.

    Examples:
        >>> queue = AdmissionQueue(max_batch_size=2)
        >>> queue.submit([Request(f"p{i}", [5, 6], 4) for i in range(3)], context_length=16)
        >>> [req.prompt_id for req, _ in queue.admit(running=0, now=0.0)], queue.num_waiting
        (['p0', 'p1'], 1)
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        scheduler: AdmissionScheduler | None = None,
        resumable: Callable[[Request], bool] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        self.max_batch_size = max_batch_size
        self._batch_limit = max_batch_size
        # Not `scheduler or ...`: an empty scheduler has len() 0 and would be falsy.
        self._scheduler = scheduler if scheduler is not None else FIFOScheduler()
        self._resumable = resumable
        self._submitted_s: dict[int, float] = {}  # id(request) -> submission time
        # Next turns of episodes whose prefix the generator kept: admitted before the rest.
        self._resuming: deque[Request] = deque()

    @property
    def scheduler(self) -> AdmissionScheduler:
        """The admission order of the requests that resume no kept prefix."""
        return self._scheduler

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet admitted."""
        return len(self._scheduler) + len(self._resuming)

    @property
    def batch_limit(self) -> int:
        """How many sequences may run at once now (at most ``max_batch_size``)."""
        return self._batch_limit

    def set_batch_limit(self, limit: int) -> None:
        """Run at most ``limit`` sequences at once from now on (§5.3); running ones keep their
        slots.

        Raises:
            ValueError: ``limit`` is not in ``[1, max_batch_size]``.
        """
        if not 1 <= limit <= self.max_batch_size:
            raise ValueError(f"batch limit must be in [1, {self.max_batch_size}], got {limit}.")
        self._batch_limit = int(limit)

    def submit(self, requests: Iterable[Request], context_length: int) -> None:
        """Queue requests for admission; all are validated before any is queued.

        Args:
            requests: the requests, in submission order.
            context_length: the model's context (prompt plus generated tokens).

        Raises:
            ValueError: a prompt is empty, ``max_tokens`` (or ``forced_length``) is below 1, or
                the prompt plus its token budget exceeds ``context_length``.
        """
        requests = list(requests)
        for req in requests:
            _validate(req, context_length)
        now = time.time()
        for req in requests:
            self._submitted_s[id(req)] = now
            if self._resumable is not None and self._resumable(req):
                self._resuming.append(req)
            else:
                self._scheduler.push(req)

    def admit(self, running: int, now: float) -> Iterator[tuple[Request, float]]:
        """The requests that take the free slots, one at a time, while fewer than
        ``batch_limit`` would run: resuming turns first, then in the scheduler's order.

        Args:
            running: sequences occupying a slot before this admission.
            now: the time of this admission; the submission time of a request that has none.

        Yields:
            ``(request, submitted_s)``: each request with the time it was submitted.
        """
        admitted = 0
        while running + admitted < self._batch_limit and self.num_waiting:
            req = self._resuming.popleft() if self._resuming else self._scheduler.pop()
            admitted += 1
            yield req, self._submitted_s.pop(id(req), now)

    def withdraw(self, keys: Collection[tuple]) -> list[Request]:
        """Take the waiting requests whose ``key`` is in ``keys`` out of the queue (they move
        to another instance); the others keep their order."""
        return self._take(lambda req: req.key in keys)

    def reprioritize(self, costs: Mapping[tuple, float]) -> int:
        """Set the ``predicted_length`` of the waiting requests whose key is in ``costs`` (the
        planner's estimates, updated from their finished siblings) and queue them again under
        it; returns how many were waiting."""
        waiting = [self._scheduler.pop() for _ in range(len(self._scheduler))]
        changed = 0
        for req in waiting:
            if req.key in costs:
                req.predicted_length, changed = float(costs[req.key]), changed + 1
            self._scheduler.push(req)
        return changed

    def _take(self, chosen: Callable[[Request], bool]) -> list[Request]:
        """Pop every waiting request, return those ``chosen`` picks and push the rest back in
        the order they came out (FIFO order, or LPT order with ties as they were)."""
        waiting = [self._scheduler.pop() for _ in range(len(self._scheduler))]
        taken = [req for req in waiting if chosen(req)]
        for req in waiting:
            if not chosen(req):
                self._scheduler.push(req)
        taken += [req for req in self._resuming if chosen(req)]
        self._resuming = deque(req for req in self._resuming if not chosen(req))
        for req in taken:
            self._submitted_s.pop(id(req), None)
        return taken


def budget(req: Request) -> int:
    """Most tokens the request may generate (a moved request's tokens so far included)."""
    return req.forced_length if req.forced_length is not None else req.max_tokens


class AdmittingGenerator:
    """What a stream generator hands to its ``AdmissionQueue`` (``self.admission``): the requests
    waiting, the batch limit (§5.3) and validated submission against ``self.context_length``.
    A subclass counts its own running sequences (``num_running``) and steps its engine
    (``step``)."""

    admission: AdmissionQueue
    context_length: int

    @property
    def num_running(self) -> int:
        """Sequences holding a batch slot (inside the engine)."""
        raise NotImplementedError

    def step(self) -> list[Sample]:
        """Admit, run one step of the engine, return the samples finished in it."""
        raise NotImplementedError

    def stream(self) -> Iterator[Sample]:
        """Step until idle, yielding samples in completion order."""
        while not self.idle:
            yield from self.step()

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet admitted."""
        return self.admission.num_waiting

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        return not self.num_running and not self.num_waiting

    @property
    def batch_limit(self) -> int:
        """How many sequences may run at once now (at most ``max_batch_size``)."""
        return self.admission.batch_limit

    def set_batch_limit(self, limit: int) -> None:
        """Run at most ``limit`` sequences at once from now on (§5.3); running ones keep their
        slots."""
        self.admission.set_batch_limit(limit)

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests for admission; all are validated before any is queued.

        Raises:
            ValueError: a prompt is empty, ``max_tokens`` (or ``forced_length``) is below 1, or
                the prompt plus its token budget exceeds the model's context length.
        """
        self.admission.submit(requests, self.context_length)


def _validate(req: Request, context_length: int) -> None:
    if not req.prompt_ids:
        raise ValueError(f"Request {req.prompt_id!r}: empty prompt; pass >= 1 token id.")
    if req.max_tokens < 1:
        raise ValueError(f"Request {req.prompt_id!r}: max_tokens={req.max_tokens}; use >= 1.")
    if req.forced_length is not None and req.forced_length < 1:
        raise ValueError(f"Request {req.prompt_id!r}: forced_length must be >= 1 or None.")
    total = len(req.prompt_ids) + budget(req)
    if total > context_length:
        raise ValueError(
            f"Request {req.prompt_id!r}: prompt ({len(req.prompt_ids)}) + tokens to generate "
            f"({budget(req)}) = {total} exceeds the model context of {context_length}; "
            "shorten the prompt or lower max_tokens/forced_length."
        )
