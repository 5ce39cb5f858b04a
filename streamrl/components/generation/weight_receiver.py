"""A generator instance's weights arriving in the background (StreamRL §3, §6): each version is
received bucket by bucket into the instance's host staging on a thread of its own, so decoding
goes on meanwhile, and passed on to the instances this one feeds (``WeightRelay``). The
instance's loop (``worker``) takes what arrived (``ready``) and loads it when its partial-rollout
policy allows."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from streamrl.components.weights.relay import WeightRelay
from streamrl.components.weights.staging import StagedWeights

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Receives broadcast weights into the staging on a background thread, so decoding goes on
    meanwhile, and passes each bucket on to the instances this one feeds (``WeightRelay``).

    Its group is that of its current feed (``feeding``): versions announced for an older feed
    are skipped (the new feeder sends the last one first), and a version that fails to arrive
    is reported, not raised: the service fails this instance or its dead feeder.
    """

    def __init__(
        self, connect: Callable[[int], Any], staged: StagedWeights, relay: WeightRelay
    ) -> None:
        self.connect, self.staged, self._relay = connect, staged, relay
        self.generation = 1
        self.newest = 1  # the newest feed announced: set at once, ahead of the queue
        self.broken: int | None = None  # the feed whose group failed (its versions fail fast)
        self.group: Any = None  # connected at the first transfer of each feed, as the sender
        self._todo: queue.Queue[tuple] = queue.Queue()
        self._done: queue.Queue[tuple] = queue.Queue()
        self._pending = 0
        threading.Thread(target=self._loop, daemon=True, name="weight-receiver").start()

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def receive(self, version: int, generation: int) -> None:
        self._pending += 1
        self._todo.put(("receive", (version, generation)))

    def refeed(self, generation: int) -> None:
        self.newest = max(self.newest, generation)
        self._todo.put(("refeed", (generation,)))

    def fed_anew(self, generation: int) -> str | None:
        """Why a connect of feed ``generation`` still under way should give up (a newer feed
        was announced: its feeder died, maybe holding that connect), or ``None``. Asked by
        the group's rendezvous, so the new feed is not queued behind the old one's connect."""
        if self.newest > generation:
            return f"fed anew (feed {self.newest})"
        return None

    def relay(self, kind: str, args: tuple) -> None:
        self._todo.put((kind, args))

    def ready(self) -> list[tuple]:
        """``(version, staging)`` of each version received, or ``((version, generation),
        reason)`` of one that did not arrive."""
        out = []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out
            if item[0] == "fatal":
                raise RuntimeError("The weight-receiving thread failed") from item[1]
            self._pending -= 1
            if item[1] is not None:
                out.append(item)

    def _loop(self) -> None:
        while True:
            kind, payload = self._todo.get()
            try:
                if kind == "relay":
                    self._relay.add(*payload)
                elif kind == "unrelay":
                    self._relay.remove(*payload)
                elif kind == "refeed":
                    self.generation, self.group = payload[0], None
                else:
                    self._done.put(self._receive(*payload))
            except Exception as err:
                if kind == "receive":  # handed to the main loop, which reports it
                    self._done.put((payload, f"{type(err).__name__}: {err}"[:500]))
                elif kind == "relay":  # a member we cannot reach: the service replaces it
                    self._relay.remove(payload[0])
                else:  # a bug: the main loop raises it, the service replaces us
                    self._done.put(("fatal", err))

    def _receive(self, version: int, generation: int) -> tuple:
        if generation != self.generation:  # announced for a feed we no longer have
            return version, None
        if generation == self.broken:  # its sender gave it up too: no retry can meet it
            raise ConnectionAbortedError(f"the weight group of feed {generation} failed before")
        try:
            if self.group is None:
                self.group = self.connect(self.generation)
            with self.staged.lock:  # the engine never loads a half-received version
                self.staged.version = None
                for index, buffer in enumerate(self.staged.buffers):
                    self.group.broadcast([buffer])
                    self._relay.forward(version, index, buffer)
                self.staged.version = version
        except Exception:
            self.group, self.broken = None, generation
            raise
        return version, self.staged
