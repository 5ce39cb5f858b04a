"""What every stream generator does before it decodes: admission (StreamRL §5).

Requests are validated, then wait in an ``AdmissionScheduler`` (FIFO, or longest predicted first
for §5.3) until a batch slot frees; at most ``batch_limit`` sequences run at once (a
skewness-aware dispatcher gives long-tail instances small batches). ``HFStreamGenerator`` and
``VLLMStreamGenerator`` share this and differ only in how they decode.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator

from streamrl.components.skewness.schedulers import AdmissionScheduler, FIFOScheduler
from streamrl.records import Request, Sample


class AdmissionQueue:
    """The admission side of a stream generator; subclasses set ``context_length`` and implement
    ``num_running`` and ``step``.

    Args:
        max_batch_size: batch slots (sequences running at once).
        scheduler: admission order; FIFO if ``None``.
        instance_id: copied into every sample.
        temperature: softmax temperature when sampling.
        greedy: take the argmax instead of sampling.
        weight_version: version tag of the weights held at start.
    """

    context_length: int  # prompt plus generated tokens, set by the subclass

    def __init__(
        self,
        *,
        max_batch_size: int,
        scheduler: AdmissionScheduler | None,
        instance_id: int,
        temperature: float,
        greedy: bool,
        weight_version: int,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}; or pass greedy=True.")
        self.max_batch_size = max_batch_size
        self._batch_limit = max_batch_size
        self.instance_id = instance_id
        self.temperature = 1.0 if greedy else float(temperature)
        self.greedy = greedy
        # Not `scheduler or ...`: an empty scheduler has len() 0 and would be falsy.
        self._scheduler = scheduler if scheduler is not None else FIFOScheduler()
        self._weight_version = weight_version
        self._submitted_s: dict[int, float] = {}  # id(request) -> submission time
        # Next turns of episodes whose prefix this generator kept: admitted before the rest.
        self._resuming: deque[Request] = deque()

    @property
    def weight_version(self) -> int:
        """Version of the weights held now."""
        return self._weight_version

    @property
    def num_running(self) -> int:
        """Sequences occupying a batch slot."""
        raise NotImplementedError

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet admitted."""
        return len(self._scheduler) + len(self._resuming)

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        return not self.num_running and not self.num_waiting

    @property
    def batch_limit(self) -> int:
        """How many sequences may run at once now (at most ``max_batch_size``)."""
        return self._batch_limit

    def set_batch_limit(self, limit: int) -> None:
        """Run at most ``limit`` sequences at once from now on (§5.3); running ones keep their
        slots."""
        if not 1 <= limit <= self.max_batch_size:
            raise ValueError(f"batch limit must be in [1, {self.max_batch_size}], got {limit}.")
        self._batch_limit = int(limit)

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests for admission; all are validated before any is queued.

        Raises:
            ValueError: a prompt is empty, ``max_tokens`` (or ``forced_length``) is below 1, or
                the prompt plus its token budget exceeds the model's context length.
        """
        requests = list(requests)
        for req in requests:
            self._validate(req)
        now = time.time()
        for req in requests:
            self._submitted_s[id(req)] = now
            if self._resumable(req):
                self._resuming.append(req)
            else:
                self._scheduler.push(req)

    def _resumable(self, req: Request) -> bool:
        """Whether ``req`` continues an episode whose prefix this generator kept (admitted
        first, so the kept cache is used before it is evicted); none by default."""
        return False

    def _next_request(self) -> Request:
        """The request a freed slot admits: a resuming turn first, then the scheduler's."""
        return self._resuming.popleft() if self._resuming else self._scheduler.pop()

    def step(self) -> list[Sample]:
        """Admit into free slots, decode, return the samples that finished in this step."""
        raise NotImplementedError

    def stream(self) -> Iterator[Sample]:
        """Step until idle, yielding samples in completion order."""
        while not self.idle:
            yield from self.step()

    def _validate(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError(f"Request {req.prompt_id!r}: empty prompt; pass >= 1 token id.")
        if req.max_tokens < 1:
            raise ValueError(f"Request {req.prompt_id!r}: max_tokens={req.max_tokens}; use >= 1.")
        if req.forced_length is not None and req.forced_length < 1:
            raise ValueError(f"Request {req.prompt_id!r}: forced_length must be >= 1 or None.")
        total = len(req.prompt_ids) + budget(req)
        if total > self.context_length:
            raise ValueError(
                f"Request {req.prompt_id!r}: prompt ({len(req.prompt_ids)}) + tokens to generate "
                f"({budget(req)}) = {total} exceeds the model context of {self.context_length}; "
                "shorten the prompt or lower max_tokens/forced_length."
            )


def budget(req: Request) -> int:
    """Most tokens the request may generate."""
    return req.forced_length if req.forced_length is not None else req.max_tokens
