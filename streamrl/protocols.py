"""The interfaces components are composed by, in one place (``typing.Protocol``s).

Anything with these methods plugs in; no base class is needed. ``StreamGenerator`` is one generator
instance (StreamRL §3, §5); ``AdmissionScheduler`` picks the request for a freed batch slot;
``Dispatcher`` splits an iteration's requests over instances (§5.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from streamrl.records import Request, Sample


@runtime_checkable
class StreamGenerator(Protocol):
    """One generator instance: continuous batching that emits each sample as it finishes."""

    @property
    def weight_version(self) -> int:
        """Version of the weights it holds."""
        ...

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        ...

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests (validated before any is queued)."""
        ...

    def step(self) -> list[Sample]:
        """Admit into free slots, decode one token for every running sequence, return the
        samples that finished at this step."""
        ...

    def stream(self) -> Iterator[Sample]:
        """Step until idle, yielding samples in completion order."""
        ...

    def load_weights(
        self, state_dict: Mapping[str, torch.Tensor | np.ndarray], version: int
    ) -> None:
        """Copy new weights in place and tag later samples with ``version``."""
        ...


@runtime_checkable
class AdmissionScheduler(Protocol):
    """Queue of waiting requests, consulted each time a batch slot frees."""

    def push(self, request: Request) -> None:
        """Add a waiting request."""
        ...

    def pop(self) -> Request:
        """Remove and return the request to admit next; raises ``IndexError`` when empty."""
        ...

    def __len__(self) -> int:
        """Number of waiting requests."""
        ...


class Dispatcher(Protocol):
    """Splits requests over instances."""

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        """Return one list of requests per instance (every request exactly once).

        Args:
            requests: the iteration's requests.
            scores: predicted output length per request (same order), or ``None``.
            instances: number of generator instances.
        """
        ...
