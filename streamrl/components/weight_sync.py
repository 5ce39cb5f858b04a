"""Asynchronous weight sync: the trainer pushes new weights and goes on training.

StreamRL §4.1 (one-step asynchronous pipelining): the transfer of weights version k overlaps the
training of step k+1, so it leaves the critical path. ``push`` snapshots the weights (the trainer
keeps updating its own copy in place) and returns; a background thread announces the version to
every generator instance and broadcasts the snapshot. ``wait_sent`` blocks until a version is out
(synchronous mode). The time the trainer is blocked (``exposed_s``) is logged apart from the
whole transfer time (``transfer_s``).

Instances added while training runs (elastic generation, §6) form a group of their own:
``add_group`` first sends them the last version pushed (catch-up), then every later one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping

import torch

from streamrl.components.weight_transport import WeightGroup

Weights = torch.nn.Module | Mapping[str, torch.Tensor]


Announce = Callable[[int], None]


class AsyncWeightSync:
    """Background broadcaster of weight versions over ``WeightGroup``s (rank 0 in each).

    Args:
        group: the trainer's member of the weight group.
        announce: tells the group's instances that ``version`` is about to be broadcast (they
            must join it).
        timeout_s: the longest ``wait_sent`` blocks before raising ``TimeoutError``.
    """

    def __init__(self, group: WeightGroup, announce: Announce, timeout_s: float = 120.0) -> None:
        self.groups: list[tuple[WeightGroup, Announce]] = [(group, announce)]
        self.timeout_s = timeout_s
        self.sent_version = -1
        self._last: tuple[int, dict[str, torch.Tensor]] | None = None  # for catch-up
        self.exposed_s = 0.0  # trainer time blocked in push/wait_sent
        self.transfer_s = 0.0  # background time spent broadcasting
        self.bytes_sent = 0
        self._todo: queue.Queue[tuple | None] = queue.Queue()
        self._sent = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="weight-sync")
        self._thread.start()

    def push(self, weights: Weights, version: int) -> float:
        """Queue ``weights`` as ``version`` and return at once; returns the seconds it blocked."""
        self._raise_if_failed()
        started = time.perf_counter()
        named = (
            weights.named_parameters() if isinstance(weights, torch.nn.Module) else weights.items()
        )
        with torch.no_grad():  # a snapshot: training goes on changing the live tensors
            snapshot = {name: t.detach().clone() for name, t in named}
        self._todo.put(("push", version, snapshot))
        blocked = time.perf_counter() - started
        self.exposed_s += blocked
        return blocked

    def wait_sent(self, version: int) -> float:
        """Block until ``version`` has been broadcast; returns the seconds it blocked."""
        started = time.perf_counter()
        with self._sent:
            done = self._sent.wait_for(
                lambda: self.sent_version >= version or self._error is not None, self.timeout_s
            )
        self._raise_if_failed()
        if not done:
            raise TimeoutError(f"Weight version {version} was not sent within {self.timeout_s} s.")
        blocked = time.perf_counter() - started
        self.exposed_s += blocked
        return blocked

    def add_group(self, group: WeightGroup, announce: Announce) -> None:
        """Serve one more group from now on; it first receives the last version pushed, if any
        (in order with pushes: a version queued before this call reaches it too)."""
        self._raise_if_failed()
        self._todo.put(("join", group, announce))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the background thread (a daemon: a transfer stuck on a dead peer never blocks
        the trainer's exit)."""
        self._todo.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while (item := self._todo.get()) is not None:
            started = time.perf_counter()
            try:
                if item[0] == "join":
                    self._join(item[1], item[2])
                else:
                    self._send(item[1], item[2], self.groups)
            except BaseException as err:  # surfaced on the trainer's next push or wait
                with self._sent:
                    self._error = err
                    self._sent.notify_all()
                return
            self.transfer_s += time.perf_counter() - started
            if item[0] == "push":
                with self._sent:
                    self.sent_version = item[1]
                    self._sent.notify_all()

    def _join(self, group: WeightGroup, announce: Announce) -> None:
        if self._last is not None:
            self._send(*self._last, [(group, announce)])
        self.groups.append((group, announce))

    def _send(self, version: int, snapshot: dict, groups: list[tuple[WeightGroup, Announce]]):
        for group, announce in groups:
            announce(version)
            self.bytes_sent += group.broadcast(snapshot.values())
        self._last = (version, snapshot)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("Background weight sync failed") from self._error
