"""Asynchronous weight sync: the trainer stages new weights and goes on training.

StreamRL §4.1 (one-step asynchronous pipelining): the transfer of weights version k overlaps the
training of step k+1, so it leaves the critical path. A version is staged once, bucket by
bucket, into a host copy in the wire dtype (``StagedWeights``: the trainer keeps updating its
own tensors in place), and a background thread announces it to the generator instances and sends
the staged buffers as they are: no device copy of the model, no clone per version. The next
version is staged only once the previous one is out (``staging``), so one host copy serves
every send and every catch-up. ``wait_sent`` blocks until a version is out (synchronous mode).
The time the trainer is blocked (``exposed_s``) is logged apart from the whole transfer time
(``transfer_s``).

Each group is keyed by an instance, so instances come and go while training runs (elastic
generation, §6; replacement of a failed one): ``add_group`` first sends a newcomer the last
version staged (catch-up), then every later one; a group whose peer fails is dropped
(``failed``) without stopping the others. An instance fed by another one (a chain or a site's
head, ``weight_relay``) is a group that only announces: no bytes leave the trainer for it.
Groups that share a ``hub`` (vLLM's protocol: ``protocol_feed.SharedBroadcast``) are sent each
version by it, in one broadcast, and it says which of them failed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from streamrl.components.weights.checksums import tensor_digest
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES
from streamrl.components.weights.staging import StagedWeights, stage_parameters
from streamrl.components.weights.transport import WeightGroup

Weights = torch.nn.Module | Mapping[str, torch.Tensor] | StagedWeights
#: Versions whose digests are kept for the instances' late reports.
KEPT_DIGESTS = 4
Announce = Callable[[int], None]


class AsyncWeightSync:
    """Background sender of staged weight versions to keyed ``WeightGroup`` s (rank 0 in each).

    Args:
        timeout_s: the longest one group's transfer may take (its group's own timeout: past
            it the group is dropped, ``failed``); ``wait_sent`` (and waiting to stage the next
            version) gives up with ``TimeoutError`` after that per group plus one, so a stuck
            transfer never hangs the trainer.
        bucket_bytes: the largest bucket of the staging (``plan_buckets``).
        dtype: the wire dtype (the generators' engine dtype); ``None``: the weights' own.
        verify_every: which versions the instances check against the trainer's checksums
            (``verifies``): ``None`` the first version sent only, 0 none, N the first and
            every N-th.

    Attributes:
        failed: ``(key, error)`` of every group dropped because a transfer to it failed.
        staged: the host copy of the last version staged (``None`` before the first).
        digests: the trainer's ``tensor_digest`` of every tensor of each version checked (the
            last few), by version.
    """

    def __init__(
        self,
        timeout_s: float = 120.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        verify_every: int | None = None,
    ) -> None:
        self.timeout_s, self.bucket_bytes, self.dtype = timeout_s, bucket_bytes, dtype
        self.verify_every = verify_every
        self.digests: dict[int, dict[str, str]] = {}
        self._first_version: int | None = None
        self.groups: dict[int, tuple[WeightGroup, Announce]] = {}
        self.failed: list[tuple[int, str]] = []
        self.sent_version = -1
        self.exposed_s = 0.0  # trainer time blocked in push/wait_sent
        self.transfer_s = 0.0  # background time spent broadcasting
        self.bytes_sent = 0
        self.staged: StagedWeights | None = None
        self._todo: queue.Queue[tuple | None] = queue.Queue()
        self._sent = threading.Condition()
        self._busy = 0  # items queued or running on the background thread
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="weight-sync")
        self._thread.start()

    def staging(self, named: Iterable[tuple[str, torch.Tensor]]) -> StagedWeights:
        """The host copy to stage the next version into, shaped like ``named`` in the wire
        dtype, once nothing reads it any more (the previous version and catch-ups are out);
        allocated on first use."""
        started = time.perf_counter()
        self._wait(lambda: self._busy == 0, "the previous weight version was not sent")
        self.exposed_s += time.perf_counter() - started
        named = list(named)
        specs = [(n, tuple(t.shape)) for n, t in named]
        if self.staged is None or [(s.name, s.shape) for s in self.staged.specs] != specs:
            self.staged = StagedWeights.like(named, self.dtype, self.bucket_bytes)
        return self.staged

    def push(self, weights: Weights, version: int) -> float:
        """Stage ``weights`` as ``version`` (unless they are the staging, already filled) and
        queue the send; returns the seconds the caller was blocked."""
        self._raise_if_failed()
        started = time.perf_counter()
        if not isinstance(weights, StagedWeights):
            named = list(
                weights.named_parameters()
                if isinstance(weights, torch.nn.Module)
                else weights.items()
            )
            self.staging(named).fill(named, version)
        elif weights is not self.staged or weights.version != version:
            raise ValueError(
                f"push: the staged weights hold version {weights.version}, not {version}; "
                "fill this sync's staging() with the version first."
            )
        self._queue(("push", version, None))
        blocked = time.perf_counter() - started
        self.exposed_s += blocked
        return blocked

    def wait_sent(self, version: int) -> float:
        """Block until ``version`` has been sent to every group; returns the seconds blocked."""
        started = time.perf_counter()
        self._wait(lambda: self.sent_version >= version, f"weight version {version} was not sent")
        blocked = time.perf_counter() - started
        self.exposed_s += blocked
        return blocked

    def verifies(self, version: int) -> bool:
        """Whether the instances check ``version`` against the trainer's checksums."""
        every = self.verify_every
        if every == 0:
            return False
        first = self._first_version is None or version == self._first_version
        return first or (every is not None and version % every == 0)

    def add_group(
        self,
        key: int,
        group: WeightGroup,
        announce: Announce,
        on_join: Callable[[int | None], None] | None = None,
    ) -> None:
        """Serve one more group from now on; it first receives the last version staged, if any
        (in order with pushes: a version queued before this call reaches it too).

        ``on_join(last)`` runs first, in order with the pushes, with the last version staged
        (``None`` if none): a relayed group uses it to tell its sender where to start.
        """
        self._raise_if_failed()
        self._queue(("join", key, (group, announce, on_join)))

    def remove_group(self, key: int) -> None:
        """Stop sending to ``key`` (after versions already queued)."""
        self._queue(("leave", key, None))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the background thread (a daemon: a transfer stuck on a dead peer never blocks
        the trainer's exit)."""
        self._todo.put(None)
        self._thread.join(timeout=timeout_s)

    def _queue(self, item: tuple) -> None:
        with self._sent:
            self._busy += 1
        self._todo.put(item)

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        # Each group's transfer fails on its own past timeout_s (and is dropped, its instance
        # replaced), so the queue moves on within timeout_s per group (and a shared broadcast
        # that fails, within three more: it is sent again group by group); past that, stuck.
        shared = any(getattr(group, "hub", None) is not None for group, _ in self.groups.values())
        limit = self.timeout_s * (len(self.groups) + 1 + 3 * shared)
        with self._sent:
            ok = self._sent.wait_for(lambda: done() or self._error is not None, limit)
        self._raise_if_failed()
        if not ok:
            raise TimeoutError(
                f"{what} within {limit:g} s (the weight timeout, {self.timeout_s:g} s, per "
                "group of the trainer's)."
            )

    def _loop(self) -> None:
        while (item := self._todo.get()) is not None:
            kind, key, payload = item
            started = time.perf_counter()
            try:
                self._run(kind, key, payload)
            except BaseException as err:  # a bug, not a peer: surfaced on the next push or wait
                with self._sent:
                    self._error = err
                    self._sent.notify_all()
                return
            with self._sent:
                if kind == "push":
                    self.transfer_s += time.perf_counter() - started
                    self.sent_version = key
                self._busy -= 1
                self._sent.notify_all()

    def _run(self, kind: str, key: int, payload: tuple | None) -> None:
        last = self.staged.version if self.staged is not None else None
        if kind == "join":
            group, announce, on_join = payload
            if on_join is not None:
                on_join(last)
            if last is not None:
                self._send(last, {key: (group, announce)})
            self.groups[key] = (group, announce)
        elif kind == "leave":
            self.groups.pop(key, None)
        else:
            self._send(key, dict(self.groups))

    def _send(self, version: int, groups: dict[int, tuple]) -> None:
        if self.verifies(version) and version not in self.digests:
            self.digests[version] = {n: tensor_digest(t) for n, t in self.staged.named()}
            for old in sorted(self.digests)[:-KEPT_DIGESTS]:
                del self.digests[old]
        if self._first_version is None:
            self._first_version = version
        # Every receiver is told first: an instance that passes buckets on as they arrive must
        # find the next one of its chain already receiving.
        failed: dict[int, BaseException] = {}
        for key, (_, announce) in groups.items():
            try:
                announce(version)
            except Exception as err:
                failed[key] = err
        sending = {key: group for key, (group, _) in groups.items() if key not in failed}
        # Groups behind one shared broadcast (vLLM's protocol, ``SharedBroadcast``) are sent
        # to by it, once; groups that may send at once (each its own link) go side by side;
        # the others one after the other, as before.
        hubs: dict[int, tuple[Any, dict[int, Any]]] = {}
        for key, group in sending.items():
            if getattr(group, "hub", None) is not None:
                hubs.setdefault(id(group.hub), (group.hub, {}))[1][key] = group
        shared = {key for _, members in hubs.values() for key in members}
        alone = {k: g for k, g in sending.items() if k not in shared}
        together = {k: g for k, g in alone.items() if getattr(g, "concurrent", False)}
        buffers = self.staged.buffers
        with ThreadPoolExecutor(max(1, len(together) + len(hubs))) as pool:
            running = {k: pool.submit(g.broadcast, buffers) for k, g in together.items()}
            reaching = [
                pool.submit(hub.send, version, members, buffers) for hub, members in hubs.values()
            ]
            for key, group in alone.items():
                if key not in together:
                    self._count(key, lambda group=group: group.broadcast(buffers), failed)
            for key, future in running.items():
                self._count(key, future.result, failed)
            for future in reaching:  # each member's bytes, or why it failed
                for key, outcome in future.result().items():
                    self._count(key, lambda outcome=outcome: _raised(outcome), failed)
        for key, err in failed.items():
            self.groups.pop(key, None)
            self.failed.append((key, f"{type(err).__name__}: {err}"))

    def _count(self, key: int, sent: Callable[[], int], failed: dict) -> None:
        """Count the bytes ``sent()`` moved, or record why it failed (the peer died or timed
        out: it is dropped, the others are served)."""
        try:
            self.bytes_sent += sent()
        except Exception as err:
            failed[key] = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("Background weight sync failed") from self._error


def _raised(outcome: int | BaseException) -> int:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def stage(
    named: Sequence[tuple[str, torch.Tensor]],
    sync: AsyncWeightSync | None,
    version: int,
    dtype: torch.dtype | None = None,
    root: int | None = 0,
) -> StagedWeights | None:
    """Stage ``named`` as ``version`` into ``sync``'s host copy, once the previous version is
    out (a collective when the tensors are sharded: every trainer rank calls it; ``root``, the
    rank holding ``sync``, receives every rank's shards into its staging, or ``None``: every
    rank holds a sync of its own; ``stage_parameters``); returns the staging, or ``None`` on a
    rank without ``sync``."""
    staged = sync.staging(named) if sync is not None else None
    if staged is not None and staged.specs:
        dtype = staged.specs[0].dtype
    stage_parameters(named, staged, version, dtype, root)
    return staged
