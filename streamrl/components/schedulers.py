"""Admission schedulers: which waiting request a generator admits into a freed batch slot.

A stream generator (StreamRL §3) keeps a fixed number of batch slots busy (§5, continuous
batching in an SGS instance); whenever a slot frees, it asks its scheduler for the next request.
FIFO is the baseline; a longest-first (LPT) scheduler on ``Request.predicted_length`` plugs into
the same protocol to start long-tail samples early.
"""

from __future__ import annotations

from collections import deque

from streamrl.components.protocols import AdmissionScheduler
from streamrl.records import Request

__all__ = ["AdmissionScheduler", "FIFOScheduler"]


class FIFOScheduler:
    """Admit requests in submission order.

    Example:
        >>> from streamrl.records import Request
        >>> s = FIFOScheduler()
        >>> s.push(Request("a", [3], 4)); s.push(Request("b", [3], 4))
        >>> s.pop().prompt_id, len(s)
        ('a', 1)
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        """Append ``request`` at the back of the queue."""
        self._queue.append(request)

    def pop(self) -> Request:
        """Remove and return the oldest waiting request."""
        if not self._queue:
            raise IndexError("FIFOScheduler.pop: no waiting request; check len() first.")
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)
