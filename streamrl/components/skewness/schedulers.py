"""Admission schedulers: which waiting request a generator admits into a freed batch slot.

A stream generator (StreamRL §3) keeps a fixed number of batch slots busy (§5, continuous
batching in an SGS instance); whenever a slot frees, it asks its scheduler for the next request.
FIFO is the baseline; a longest-first (LPT) scheduler on ``Request.predicted_length`` plugs into
the same protocol to start long-tail samples early.
"""

from __future__ import annotations

import heapq
from collections import deque

from streamrl.protocols import AdmissionScheduler
from streamrl.records import Request

__all__ = ["AdmissionScheduler", "FIFOScheduler", "LPTScheduler"]


class FIFOScheduler:
    """Admit requests in submission order.

    Examples:
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


class LPTScheduler:
    """Admit the longest predicted request first (Longest Processing Time, StreamRL §5.3).

    An instance with more requests than batch slots runs several "rounds"; starting the long
    ones first keeps a long sample from being admitted last and running alone at the end
    (Graham's LPT: makespan within 4/3 of optimal). Requests without a prediction count as
    length 0; equal predictions keep submission order.

    Examples:
        >>> from streamrl.records import Request
        >>> s = LPTScheduler()
        >>> for pid, n in [("a", 3), ("b", 9), ("c", 5)]:
        ...     s.push(Request(pid, [3], 16, predicted_length=n))
        >>> [s.pop().prompt_id for _ in range(3)]
        ['b', 'c', 'a']
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._pushed = 0

    def push(self, request: Request) -> None:
        """Queue ``request`` by its ``predicted_length``."""
        length = request.predicted_length if request.predicted_length is not None else 0.0
        heapq.heappush(self._heap, (-float(length), self._pushed, request))
        self._pushed += 1

    def pop(self) -> Request:
        """Remove and return the waiting request with the longest predicted length."""
        if not self._heap:
            raise IndexError("LPTScheduler.pop: no waiting request; check len() first.")
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)
