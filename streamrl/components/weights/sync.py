"""Asynchronous weight sync: the trainer pushes new weights and goes on training.

StreamRL §4.1 (one-step asynchronous pipelining): the transfer of weights version k overlaps the
training of step k+1, so it leaves the critical path. ``push`` snapshots the weights (the trainer
keeps updating its own copy in place) and returns; a background thread announces the version to
the generator instances and broadcasts the snapshot. ``wait_sent`` blocks until a version is out
(synchronous mode). The time the trainer is blocked (``exposed_s``) is logged apart from the
whole transfer time (``transfer_s``).

Each generator instance has a group of its own (trainer + instance), so instances come and go
while training runs (elastic generation, §6; replacement of a failed one): ``add_group`` first
sends a newcomer the last version pushed (catch-up), then every later one; a group whose peer
fails is dropped (``failed``) without stopping the others.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping

import torch

from streamrl.components.weights.transport import WeightGroup

Weights = torch.nn.Module | Mapping[str, torch.Tensor]
Announce = Callable[[int], None]


class AsyncWeightSync:
    """Background sender of weight versions to keyed ``WeightGroup``s (rank 0 in each).

    Args:
        timeout_s: the longest ``wait_sent`` blocks before raising ``TimeoutError``.

    Attributes:
        failed: ``(key, error)`` of every group dropped because a transfer to it failed.
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.groups: dict[int, tuple[WeightGroup, Announce]] = {}
        self.failed: list[tuple[int, str]] = []
        self.sent_version = -1
        self.exposed_s = 0.0  # trainer time blocked in push/wait_sent
        self.transfer_s = 0.0  # background time spent broadcasting
        self.bytes_sent = 0
        self._last: tuple[int, dict[str, torch.Tensor]] | None = None  # for catch-up
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
        """Block until ``version`` has been sent to every group; returns the seconds blocked."""
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

    def add_group(
        self,
        key: int,
        group: WeightGroup,
        announce: Announce,
        on_join: Callable[[int | None], None] | None = None,
    ) -> None:
        """Serve one more group from now on; it first receives the last version pushed, if any
        (in order with pushes: a version queued before this call reaches it too).

        ``on_join(last)`` runs first, in order with the pushes, with the last version pushed
        (``None`` if none): a relayed group uses it to tell its sender where to start.
        """
        self._raise_if_failed()
        self._todo.put(("join", key, (group, announce, on_join)))

    def remove_group(self, key: int) -> None:
        """Stop sending to ``key`` (after versions already queued)."""
        self._todo.put(("leave", key, None))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the background thread (a daemon: a transfer stuck on a dead peer never blocks
        the trainer's exit)."""
        self._todo.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while (item := self._todo.get()) is not None:
            kind, key, payload = item
            started = time.perf_counter()
            try:
                if kind == "join":
                    group, announce, on_join = payload
                    if on_join is not None:
                        on_join(self._last[0] if self._last is not None else None)
                    if self._last is not None:
                        self._send(*self._last, {key: (group, announce)})
                    self.groups[key] = (group, announce)
                elif kind == "leave":
                    self.groups.pop(key, None)
                else:
                    self._send(key, payload, dict(self.groups))
                    self._last = (key, payload)
            except BaseException as err:  # a bug, not a peer: surfaced on the next push or wait
                with self._sent:
                    self._error = err
                    self._sent.notify_all()
                return
            if kind == "push":
                self.transfer_s += time.perf_counter() - started
                with self._sent:
                    self.sent_version = key
                    self._sent.notify_all()

    def _send(self, version: int, snapshot: dict, groups: dict[int, tuple]) -> None:
        for key, (group, announce) in groups.items():
            try:
                announce(version)
                self.bytes_sent += group.broadcast(snapshot.values())
            except Exception as err:  # the peer died or timed out: drop it, serve the others
                self.groups.pop(key, None)
                self.failed.append((key, f"{type(err).__name__}: {err}"))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("Background weight sync failed") from self._error
