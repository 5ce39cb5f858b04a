"""The pool of a stream generation service: its instances, their weight groups and messages.

``InstancePool`` is held by ``StreamGenerationService`` and owns what changes while instances
come and go: their handles, the weight sync, the samples read but not yet taken, the ledger. It
starts instances (with the ``launch`` it is given: what runs in them is the service's business)
and connects their weight groups: the trainer feeds one instance per site, which passes each
bucket on along a chain (or a tree of ``fanout``) of the others (§6, ``weight_relay``); replaces
those that die or hang and requeues what they held; deals requests to the active ones; and reads
every instance's messages without starving any.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from multiprocessing import connection
from pathlib import Path

import torch

from streamrl.components.generation.feeding import WeightFeeds
from streamrl.components.generation.instance import InstanceHandle, InstanceInfo
from streamrl.components.generation.messages import (
    Crashed,
    Digests,
    Fingerprinted,
    Finished,
    InstanceMessage,
    Limit,
    Ready,
    Released,
    Running,
    Stop,
    Submit,
    Updated,
    WeightsLost,
)
from streamrl.components.generation.rebalancing import Rebalancing
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.weights.checksums import WeightMismatchError, verify_applied
from streamrl.components.weights.path import WeightPath
from streamrl.components.weights.sync import AsyncWeightSync, Weights
from streamrl.protocols import Dispatcher, WeightTransport
from streamrl.records import Request, Sample
from streamrl.runtime.atomic_files import write_text_atomic

log = logging.getLogger(__name__)


class GeneratorError(RuntimeError):
    """A generator instance failed; the message names the instance and the cause."""


#: Starts one instance: ``(instance_id, site) -> handle`` (a local process or a Ray actor).
Launch = Callable[[int, str], InstanceHandle]


class InstancePool:
    """The generator instances of a service and the messages they send (module docstring).

    Args:
        launch: starts instance ``instance_id`` at ``site`` and returns its handle at once (it
            says ``ready`` on its pipe once its generator is built).
        dispatcher: which active instance gets which request.
        trainer_site: the trainer's site; instances elsewhere get weights from their site's
            head.
        weights: the road of a version: its buckets (``StagedWeights``), the fan-out of the
            chain (the trainer feeds one instance per site whatever the number), vLLM's
            protocol (``protocol_feed``, fed by the trainer) and the versions the instances
            verify (``AsyncWeightSync.verifies``; a mismatch raises ``GeneratorError``).
        weight_transport: its transport, made and checked (``WeightGroup``).
        timeouts: an instance's start and group connection (``start_s``), the longest wait
            for the next message (``sample_s``), an active instance's silence, while the pool
            is read, before it is killed and replaced (``heartbeat_s``), a weight transfer (or
            a wait for one) before the instance is failed or the trainer's wait raises
            (``weight_s``).
        max_restarts: failed instances replaced over the pool's life; one more failure raises
            ``GeneratorError``.
        status_path: a JSON file rewritten on every change (instance id -> pid, state, weight
            version), for operators.
        max_batch_size: each instance's batch slots (until the dispatcher sets a limit).
        trainer_device: the trainer's device the weights leave from (``WeightFeeds``).
        protocol_ranks: each instance's worker processes under vLLM's protocol (members of
            its group).

    Attributes:
        handles: every instance started, in id order (failed and stopped ones included).
        weight_sync: pushes weights to the instances' groups (``None`` while not running).
        backlog: samples read from the instances, not yet taken.
        counts: the ledger: requests submitted and requeued, samples returned and discarded
            (late copies from failed instances), instances restarted.
        pushed_version: the newest weight version handed to the weight sync.
    """

    def __init__(
        self,
        launch: Launch,
        *,
        dispatcher: Dispatcher,
        trainer_site: str = "local",
        weights: WeightPath,
        weight_transport: WeightTransport,
        timeouts: Timeouts,
        max_restarts: int = 3,
        status_path: str | Path | None = None,
        max_batch_size: int = 32,
        trainer_device: str = "cuda",
        protocol_ranks: int = 1,
    ) -> None:
        self.launch, self.trainer_device = launch, trainer_device
        self.weights, self.timeouts = weights, timeouts
        self.protocol_ranks = protocol_ranks
        self.max_batch_size = max_batch_size
        self.dispatcher = dispatcher
        self.trainer_site = trainer_site
        self.weight_transport = weight_transport
        self.max_restarts = max_restarts
        self.status_path = Path(status_path) if status_path is not None else None
        self.handles: list[InstanceHandle] = []
        self.weight_sync: AsyncWeightSync | None = None
        self.backlog: deque[Sample] = deque()
        self.counts: Counter[str] = Counter()
        #: Why each replaced instance was replaced, in order (also logged as a warning).
        self.failures: list[str] = []
        self.pushed_version = 0
        self.running = False
        self._received: deque[tuple] = deque()  # read from the pipes, not yet handled
        self._orphans: list[Request] = []  # requeued while no instance was active
        self._first_ready: list[InstanceHandle] | None = None  # at start: joined in id order
        self._reading_since = time.monotonic()
        self._last_read = 0.0
        self._checked = 0.0  # when instance health was last checked
        #: Moves between instances, when the dispatcher plans them (``rebalancing``).
        self.rebalancing = Rebalancing(self)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, sites: Sequence[str]) -> None:
        """Start one instance per site and wait until each is active; everything is stopped
        again if one fails."""
        self.running, self.handles, self._first_ready = True, [], []
        weights, weight_s = self.weights, self.timeouts.weight_s
        self.weight_sync = AsyncWeightSync(
            weight_s, weights.bucket_bytes, verify_every=weights.verify_every
        )
        self.feeds = WeightFeeds(
            self.weight_sync,
            self.handles,
            self.weight_transport,
            weight_s,
            weights.fanout,
            self.trainer_device,
            protocol=weights.protocol,
            protocol_ranks=self.protocol_ranks,
        )
        try:
            for site in sites:
                self.spawn(site)
            self.wait_active(self.timeouts.start_s)
        except BaseException:
            self.close()
            raise

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every instance: ask politely, then terminate, then kill. Safe to call twice."""
        for handle in self.handles:
            if handle.proc.is_alive():
                handle.inbox.put(Stop())
        deadline = time.monotonic() + timeout_s
        for handle in self.handles:
            handle.stop(max(0.0, deadline - time.monotonic()))
            handle.state = "stopped" if handle.state != "failed" else "failed"
        for handle in self.handles:
            handle.inbox.cancel_join_thread()  # never block our exit on undelivered messages
            handle.inbox.close()
            handle.close_link()
        if self.weight_sync is not None:
            self.weight_sync.close()
        self.write_status()
        self.running, self.weight_sync = False, None  # infos() still tells their fate
        self._received.clear()
        self.backlog.clear()

    def require_running(self) -> None:
        if not self.running:
            raise RuntimeError(
                "StreamGenerationService is not started; call start() or use `with`."
            )

    # -- the instances -----------------------------------------------------------------------
    def spawn(self, site: str) -> InstanceHandle:
        """Start one more instance at ``site``; it takes requests once it is active."""
        handle = self.launch(len(self.handles), site)
        handle.site = site
        self.handles.append(handle)
        self.write_status()
        return handle

    def retire(self, instance_id: int | None = None) -> int:
        """Drain one active instance (by default the newest), then stop it; returns its id. The
        instances it fed weights to are fed by its own feeder from then on."""
        active = self.active()
        if len(active) < 2:
            raise ValueError("remove_instance: the service needs at least one active instance.")
        handle = active[-1] if instance_id is None else self.handles[instance_id]
        if handle.state != "active":
            raise ValueError(f"remove_instance: instance {handle.instance_id} is {handle.state}.")
        self._set_state(handle, "draining")
        self._retire_drained()
        return handle.instance_id

    def wait_active(self, timeout_s: float) -> None:
        """Read messages until no instance is still starting or joining."""
        self.wait_until(
            lambda: not any(h.state in ("starting", "joining") for h in self.handles),
            "did not become active",
            timeout_s,
        )

    def active(self) -> list[InstanceHandle]:
        return [h for h in self.handles if h.state == "active"]

    def infos(self) -> list[InstanceInfo]:
        return [h.info() for h in self.handles]

    def dispatch(
        self, requests: list[Request], scores: Sequence[float] | None, plan: bool = True
    ) -> None:
        """Deal ``requests`` to the active instances (held until one is active if none is): a
        request's ``prefer_instance`` if it is active, the dispatcher's plan for the others
        (``plan=False``: each to the instance with the fewest open requests, the dispatcher
        left out: an evaluation's)."""
        if not requests:
            return
        active = self.active()
        if not active:  # every instance is (re)starting: held until one is active
            self._orphans.extend(requests)
            return
        # An episode's next turn goes to the instance holding its prefix, if still active.
        held = {h.instance_id: h for h in active}
        placed = [r.prefer_instance in held for r in requests]
        for request in (r for r, p in zip(requests, placed) if p):
            self.send(held[request.prefer_instance], [request])
        rest = [r for r, p in zip(requests, placed) if not p]
        if not rest:
            return
        if not plan:
            load = {h.instance_id: len(h.open) for h in active}
            batches: dict[int, list[Request]] = {h.instance_id: [] for h in active}
            for request in rest:
                least = min(load, key=load.__getitem__)
                batches[least].append(request)
                load[least] += 1
            for handle in active:
                if batches[handle.instance_id]:
                    self.send(handle, batches[handle.instance_id])
            return
        if scores is not None:
            scores = [x for x, p in zip(scores, placed) if not p]
        parts = self.dispatcher.plan(rest, scores, len(active))
        limits = self.dispatcher.batch_limits(len(active))  # per-pool batch sizes (§5.3)
        for i, (handle, batch) in enumerate(zip(active, parts)):
            if limits is not None:
                handle.inbox.put(Limit(limits[i]))
                handle.batch_limit = limits[i]
            if batch:
                self.send(handle, batch)
        self.rebalancing.maybe_ask()  # a planner that moves work may improve on its plan now

    @staticmethod
    def send(handle: InstanceHandle, batch: list[Request]) -> None:
        """Hand ``batch`` to one instance: it holds them from now on."""
        handle.open.update((r.key, r) for r in batch)
        handle.inbox.put(Submit(list(batch)))

    def batch_limit(self, handle: InstanceHandle) -> int:
        """How many sequences ``handle`` runs at once."""
        return handle.batch_limit if handle.batch_limit is not None else self.max_batch_size

    # -- weights -----------------------------------------------------------------------------
    def push_weights(self, weights: Weights, version: int) -> float:
        """Start sending ``version`` in the background; returns the seconds blocked."""
        self.pushed_version = max(self.pushed_version, version)
        return self.weight_sync.push(weights, version)

    def wait_loaded(self, version: int, timeout_s: float) -> None:
        """Block until ``version`` is sent and every active instance has loaded it."""
        self.weight_sync.wait_sent(version)
        self.wait_until(
            lambda: all(h.version >= version for h in self.active()),
            f"did not load weights {version}",
            timeout_s,
        )

    def _ready(self, handle: InstanceHandle) -> None:
        """An instance has loaded the model. The first ones join once all have, in id order,
        so each site's chain is the same from run to run; later ones join at once."""
        if self._first_ready is None:
            self._join(handle)
            return
        self._first_ready.append(handle)
        if not any(h.state == "starting" and h not in self._first_ready for h in self.handles):
            ready, self._first_ready = sorted(self._first_ready, key=lambda h: h.instance_id), None
            for first in ready:
                self._join(first)

    def _join(self, handle: InstanceHandle) -> None:
        """Connect its weight feed (``WeightFeeds.join``); it is active once it holds the last
        version pushed (at once if none was: the model directory is the current version)."""
        self.feeds.join(handle)
        self._set_state(handle, "joining" if self.pushed_version > 0 else "active")

    def _set_wire_dtype(self, handle: InstanceHandle, name: str) -> None:
        """The dtype the weights travel in: the instances' engine dtype, the same for all."""
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise GeneratorError(f"Instance {handle.instance_id} reported no dtype ({name!r}).")
        sync = self.weight_sync
        if sync.dtype is not None and sync.dtype != dtype:
            raise GeneratorError(
                f"Instance {handle.instance_id} runs its engine in {name}, the others in "
                f"{sync.dtype}: every generator instance must run the same dtype."
            )
        sync.dtype = dtype

    # -- state changes -----------------------------------------------------------------------
    def _set_state(self, handle: InstanceHandle, state: str) -> None:
        handle.state = state
        if state == "active" and self._orphans:
            orphans, self._orphans = self._orphans, []
            self.dispatch(orphans, [r.predicted_length or 0.0 for r in orphans])
        self.write_status()

    def _retire_drained(self) -> None:
        for handle in self.handles:
            if handle.state == "draining" and not handle.open:
                handle.inbox.put(Stop())
                self.feeds.leave(handle)
                self._set_state(handle, "stopped")

    def _fail(self, handle: InstanceHandle, reason: str) -> None:
        """Replace a dead or hung instance and requeue what it held, or raise past the limit.
        The instances it fed weights to are fed by its own feeder (``WeightFeeds.leave``)."""
        if handle.state in ("failed", "stopped"):
            return
        restarts = self.counts["instances_restarted"]
        if restarts >= self.max_restarts:
            raise GeneratorError(
                f"Generator instance {handle.instance_id} (pid {handle.proc.pid}) {reason}; "
                f"{restarts} of max_restarts={self.max_restarts} replacements already used."
            )
        handle.stop(0.0)
        self.backlog.extend(handle.salvage())  # finished before it went: kept, not redone
        self.rebalancing.forget(handle)
        self.feeds.leave(handle)
        requests = list(handle.open.values())
        handle.open.clear()
        self._set_state(handle, "failed")
        self.counts["instances_restarted"] += 1
        self.counts["requests_requeued"] += len(requests)
        replacement = self.spawn(handle.site)
        lines = reason.strip().splitlines()  # a crash's: "failed:", its traceback's last line
        short = " ".join(lines[:1] + lines[1:][-1:])
        why = f"instance {handle.instance_id} (pid {handle.proc.pid}) {short}"
        self.failures.append(why)
        log.warning(
            "generator %s; replaced by instance %d (%d of max_restarts=%d), %d requests requeued",
            why,
            replacement.instance_id,
            restarts + 1,
            self.max_restarts,
            len(requests),
        )
        self.dispatch(requests, [r.predicted_length or 0.0 for r in requests])

    def write_status(self) -> None:
        """Rewrite the status file (if any) with every instance's ``InstanceInfo``."""
        if self.status_path is None:
            return
        status = {str(i.instance_id): asdict(i) for i in self.infos()}
        write_text_atomic(self.status_path, json.dumps(status, indent=1))  # never half a file

    # -- messages ----------------------------------------------------------------------------
    def wait_until(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Read messages (samples go to ``backlog``) until ``done()``; raise ``GeneratorError``
        naming the instances after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise GeneratorError(
                    f"Generator instances {what} within {timeout_s:.0f} s: {self.infos()}."
                )
            self.next_message(deadline)

    def next_message(
        self, deadline: float | None = None, quiet: bool = False
    ) -> InstanceMessage | None:
        """Next message from any instance (failures handled on the way; a sample also goes to
        ``backlog``), or ``None`` for one only for bookkeeping (let the caller re-check).
        Raises ``GeneratorError`` on timeout, or returns ``None`` if ``quiet``."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeouts.sample_s
        try:
            while True:
                # Away for over a second (the caller, or this pool's own bookkeeping: replacing
                # an instance waited on a store a dying connect held, 30 s): silence meant
                # nothing meanwhile, an instance is judged on what it sent since.
                now = time.monotonic()
                if now - self._last_read > 1.0:
                    self._reading_since = now
                self._last_read = now
                message = self._receive(min(0.25, max(0.0, deadline - time.monotonic())))
                if message is None or time.monotonic() - self._checked > 1.0:
                    self._check_health()
                if message is None:
                    self.rebalancing.maybe_ask()  # a round skipped for being too soon
                    if time.monotonic() >= deadline and quiet:
                        return None
                    if time.monotonic() > deadline:
                        raise GeneratorError(
                            "No message from any generator instance within the timeout; "
                            f"instances: {self.infos()}."
                        )
                    continue
                if not self._accept(message):  # bookkeeping only: let the caller re-check
                    return None
                if isinstance(message, Finished):
                    self.backlog.append(message.sample)
                return message
        finally:
            self._last_read = time.monotonic()

    def _receive(self, timeout_s: float) -> InstanceMessage | None:
        """One message from any instance's pipe (taking one from each ready pipe in turn, so
        none starves), or ``None`` after ``timeout_s``."""
        if not self._received:
            links = {h.link: h for h in self.handles if h.link is not None}
            for link in connection.wait(list(links), timeout_s):
                message = links[link].read()  # None: it died, maybe mid-write
                if message is not None:
                    self._received.append(message)
        return self._received.popleft() if self._received else None

    def _accept(self, message: InstanceMessage) -> bool:
        """Bookkeeping of one message; False for messages no caller needs to see."""
        if not isinstance(message, InstanceMessage):
            raise GeneratorError(f"A generator instance sent an unknown message: {message!r:.200}")
        handle = self.handles[message.instance_id]
        handle.last_seen = time.monotonic()
        if isinstance(message, Crashed):
            reason = f"failed:\n{message.traceback}"
            if handle.state == "starting":  # it never ran: a setup problem, not a transient one
                raise GeneratorError(f"Generator instance {handle.instance_id} {reason}")
            self._fail(handle, reason)
            return False
        if handle.state == "failed":  # a late message of a replaced instance
            self.counts["samples_discarded"] += isinstance(message, Finished)
            return False
        match message:
            case Ready(wire_dtype=wire, latency=latency):
                handle.latency = latency
                self._set_wire_dtype(handle, wire)
                self._ready(handle)
            case WeightsLost(version=version, generation=generation, reason=why):
                culprit = self.feeds.lost(handle, generation)  # its own fault, or its feeder's
                if culprit is not None:
                    self._fail(culprit, f"did not pass on weights {version} ({why})")
            case Digests(version=version, digests=digests):  # a silent no-op stops the run
                self._verify(handle, version, digests)
            case Updated(version=version):
                handle.version = max(handle.version, version)
                if handle.state == "joining" and handle.version >= self.pushed_version:
                    self._set_state(handle, "active")
                self.write_status()
            case Finished(sample=sample):
                if handle.open.pop(sample.key, None) is None:
                    raise GeneratorError(
                        f"Instance {handle.instance_id} sent an unexpected or "
                        f"duplicate sample {sample.key}."
                    )
                if handle.state == "draining":
                    self._retire_drained()
                self.rebalancing.sample_arrived(handle, sample)
            case Running(query_id=query, running=running):
                self.rebalancing.status(handle, query, running)
            case Released(move_id=move_id, requests=requests):
                self.rebalancing.released(handle, move_id, requests)
        return isinstance(message, Finished | Updated | WeightsLost | Fingerprinted)

    def _verify(self, handle: InstanceHandle, version: int, digests: dict[str, str]) -> None:
        """Compare an instance's checksums of ``version`` with the trainer's.

        Raises:
            GeneratorError: they differ (the error names the instance and the first tensor).
        """
        sent = self.weight_sync.digests.get(version)
        if sent is None:  # long gone from the trainer's few: nothing to compare with
            return
        try:
            verify_applied(sent, digests, f"{handle.instance_id} (pid {handle.proc.pid})")
        except WeightMismatchError as err:
            raise GeneratorError(f"{err} (weight version {version})") from err
        self.counts["weight_versions_verified"] += 1

    def _check_health(self) -> None:
        """Replace instances that died, or that stayed silent while we were reading."""
        now = self._checked = time.monotonic()
        for key, error in self.weight_sync.failed:
            self._fail(self.handles[key], f"failed to receive weights ({error})")
        self.weight_sync.failed.clear()
        for handle in list(self.handles):
            if handle.state in ("failed", "stopped"):
                continue
            if not handle.proc.is_alive():
                self._fail(handle, f"died with exit code {handle.proc.exitcode}")
            elif (
                handle.state == "active"
                and now - self._reading_since > self.timeouts.heartbeat_s
                and now - handle.last_seen > self.timeouts.heartbeat_s
            ):
                self._fail(handle, f"sent nothing for {now - handle.last_seen:.0f} s (hung)")
