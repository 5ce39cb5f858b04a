"""The machinery of the stream generation service: its pool of instances and their messages.

``InstancePool`` is the base of ``StreamGenerationService`` (which holds the state it works on:
the instances, the weight sync, the backlog of samples, the ledger). It starts instances and
connects their weight groups, at the trainer's site or through a remote site's head (§6,
``weight_relay``); replaces those that die or hang and requeues what they held; deals requests
to the active ones; and reads every instance's messages without starving any.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from multiprocessing import connection
from typing import Any

from streamrl.components.generation.engines import instance_device
from streamrl.components.generation.instance import InstanceHandle
from streamrl.components.generation.ray_instance import RayInstanceHandle
from streamrl.components.weights.relay import RelayedGroup
from streamrl.components.weights.transport import WeightGroup
from streamrl.records import Request


class GeneratorError(RuntimeError):
    """A generator instance failed; the message names the instance and the cause."""


class InstancePool:
    """Pool and message internals of ``StreamGenerationService`` (see the module docstring)."""

    def _retire_drained(self) -> None:
        for handle in self._instances:
            if handle.state == "draining" and not handle.open:
                handle.inbox.put(("stop",))
                self.weight_sync.remove_group(handle.instance_id)
                self._leave_head(handle)
                self._set_state(handle, "stopped")

    # -- the pool ----------------------------------------------------------------------------
    def _spawn(self, site: str) -> InstanceHandle:
        instance_id = len(self._instances)
        kwargs = {**self._generator_kwargs, "seed": self._seed + instance_id}
        what = dict(
            model_dir=self.model_dir,
            generator_kwargs=kwargs,
            backend=self.backend,
            device=instance_device(
                instance_id,
                self.gpus_per_instance,
                self.cluster,
                spare_first=self.weight_transport == "nccl",
            ),
            transport=self.weight_transport,
            relays=site != self.trainer_site,
        )
        if self.cluster == "ray":
            handle: InstanceHandle = RayInstanceHandle.spawn_actor(
                self._ray, instance_id, what, self.start_timeout_s
            )
        else:
            handle = InstanceHandle.spawn(self._ctx, instance_id, what, self.start_timeout_s)
        handle.site = site
        self._instances.append(handle)
        self._write_status()
        return handle

    def _join(self, handle: InstanceHandle) -> None:
        """An instance has loaded the model: connect its weight group (or have its site's head
        connect to it), queue its catch-up."""

        def announce(version: int) -> None:
            handle.inbox.put(("update", version))

        head = self._site_head(handle)
        if head is None:  # the trainer sends it every version
            group = WeightGroup(
                handle.store.port,
                0,
                2,
                store=handle.store,
                timeout_s=self.start_timeout_s,
                transport=self.weight_transport,
            )
            self.weight_sync.add_group(handle.instance_id, group, announce)
        else:  # its site's head forwards every version; the trainer only announces them

            def start_relay(last: int | None) -> None:
                first = last if last is not None else 0
                head.inbox.put(("relay", handle.instance_id, handle.store.port, first))

            handle.head = head.instance_id
            head.members.add(handle.instance_id)
            self.weight_sync.add_group(handle.instance_id, RelayedGroup(), announce, start_relay)
        # Nothing pushed yet: the model directory is the current version.
        self._set_state(handle, "joining" if self._pushed_version > 0 else "active")

    def _site_head(self, handle: InstanceHandle) -> InstanceHandle | None:
        """The instance that forwards weights to ``handle``: the first one of its remote site
        fed by the trainer; ``None`` if ``handle`` is at the trainer's site, or is that one."""
        if handle.site == self.trainer_site:
            return None
        for other in self._instances:
            if (
                other is not handle
                and other.site == handle.site
                and other.head is None
                and other.state in ("joining", "active")
            ):
                return other
        return None

    def _leave_head(self, handle: InstanceHandle) -> None:
        """``handle`` stops or fails: its head forwards nothing more to it."""
        if handle.head is None:
            return
        head = self._instances[handle.head]
        head.members.discard(handle.instance_id)
        if head.state not in ("failed", "stopped"):
            head.inbox.put(("unrelay", handle.instance_id))

    def _set_state(self, handle: InstanceHandle, state: str) -> None:
        handle.state = state
        if state == "active" and self._orphans:
            orphans, self._orphans = self._orphans, []
            self._dispatch(orphans, [r.predicted_length or 0.0 for r in orphans])
        self._write_status()

    def _fail(self, handle: InstanceHandle, reason: str, own_fault: bool = True) -> None:
        """Replace a dead or hung instance and requeue what it held, or raise past the limit.

        ``own_fault=False``: a healthy instance replaced because its site's head failed
        (counted as ``instances_replaced_with_head``, not against ``max_restarts``).
        """
        if handle.state in ("failed", "stopped"):
            return
        restarts = self.counts["instances_restarted"]
        if own_fault and restarts >= self.max_restarts:
            raise GeneratorError(
                f"Generator instance {handle.instance_id} (pid {handle.proc.pid}) {reason}; "
                f"{restarts} of max_restarts={self.max_restarts} replacements already used."
            )
        handle.stop(0.0)
        self._backlog.extend(handle.salvage())  # finished before it went: kept, not redone
        self.weight_sync.remove_group(handle.instance_id)
        self._leave_head(handle)
        requests = list(handle.open.values())
        handle.open.clear()
        self._set_state(handle, "failed")
        self.counts["instances_restarted" if own_fault else "instances_replaced_with_head"] += 1
        self.counts["requests_requeued"] += len(requests)
        self._spawn(handle.site)
        self._dispatch(requests, [r.predicted_length or 0.0 for r in requests])
        for member in sorted(handle.members):  # nothing would reach them any more
            head_lost = f"lost instance {handle.instance_id}, its head"
            self._fail(self._instances[member], head_lost, own_fault=False)
        handle.members.clear()

    def _dispatch(self, requests: list[Request], scores: Sequence[float] | None) -> None:
        if not requests:
            return
        active = self._active()
        if not active:  # every instance is (re)starting: held until one is active
            self._orphans.extend(requests)
            return
        parts = self.dispatcher.plan(requests, scores, len(active))
        limits = getattr(self.dispatcher, "batch_limits", None)  # per-pool batch sizes (§5.3)
        for i, (handle, batch) in enumerate(zip(active, parts)):
            if limits is not None:
                handle.inbox.put(("limit", limits(len(active))[i]))
            if batch:
                handle.open.update((r.key, r) for r in batch)
                handle.inbox.put(("submit", list(batch)))

    def _write_status(self) -> None:
        if self.status_path is None:
            return
        status = {str(i.instance_id): asdict(i) for i in self.instances()}
        tmp = self.status_path.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(status, indent=1))
        os.replace(tmp, self.status_path)  # readers never see half a file

    # -- messages ----------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._running:
            raise RuntimeError(
                "StreamGenerationService is not started; call start() or use `with`."
            )

    def _active(self) -> list[InstanceHandle]:
        return [h for h in self._instances if h.state == "active"]

    def _wait_for(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Read messages (keeping samples for ``next_sample``) until ``done()``; raise
        ``GeneratorError`` naming the instances after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise GeneratorError(
                    f"Generator instances {what} within {timeout_s:.0f} s: {self.instances()}."
                )
            kind, payload = self._next_message(deadline)
            if kind == "sample":
                self._backlog.append(payload)

    def _next_message(self, deadline: float | None = None) -> tuple[str, Any]:
        """Next message from any instance (failures handled on the way); raises on timeout."""
        deadline = deadline if deadline is not None else time.monotonic() + self.sample_timeout_s
        now = time.monotonic()
        if now - self._last_read > 1.0:  # the caller was away: silence meant nothing meanwhile
            self._reading_since = now
        try:
            while True:
                message = self._receive(0.25)
                if message is None or time.monotonic() - self._checked > 1.0:
                    self._check_health()
                if message is None:
                    if time.monotonic() > deadline:
                        raise GeneratorError(
                            "No message from any generator instance within the timeout; "
                            f"instances: {self.instances()}."
                        )
                    continue
                if not self._accept(message):  # bookkeeping only: let the caller re-check
                    return "handled", None
                if message[0] == "sample":
                    return "sample", message[1]
                return message[0], message[1:]
        finally:
            self._last_read = time.monotonic()

    def _receive(self, timeout_s: float) -> tuple | None:
        """One message from any instance's pipe (taking one from each ready pipe in turn, so
        none starves), or ``None`` after ``timeout_s``."""
        if not self._received:
            links = {h.link: h for h in self._instances if h.link is not None}
            for link in connection.wait(list(links), timeout_s):
                message = links[link].read()  # None: it died, maybe mid-write
                if message is not None:
                    self._received.append(message)
        return self._received.popleft() if self._received else None

    def _accept(self, message: tuple) -> bool:
        """Bookkeeping of one message; False for messages no caller needs to see."""
        kind = message[0]
        sender = message[1].instance_id if kind == "sample" else message[1]
        handle = self._instances[sender]
        handle.last_seen = time.monotonic()
        if kind == "error":
            reason = f"failed:\n{message[2]}"
            if handle.state == "starting":  # it never ran: a setup problem, not a transient one
                raise GeneratorError(f"Generator instance {sender} {reason}")
            self._fail(handle, reason)
            return False
        if handle.state == "failed":  # a late message of a replaced instance
            self.counts["samples_discarded"] += kind == "sample"
            return False
        if kind == "ready":
            self._join(handle)
        elif kind == "updated":
            handle.version = max(handle.version, message[2])
            if handle.state == "joining" and handle.version >= self._pushed_version:
                self._set_state(handle, "active")
            self._write_status()
        elif kind == "sample":
            if handle.open.pop(message[1].key, None) is None:
                raise GeneratorError(
                    f"Instance {handle.instance_id} sent an unexpected or "
                    f"duplicate sample {message[1].key}."
                )
            if handle.state == "draining":
                self._retire_drained()
        return kind not in ("heartbeat", "ready")

    def _check_health(self) -> None:
        """Replace instances that died, or that stayed silent while we were reading."""
        now = self._checked = time.monotonic()
        for key, error in self.weight_sync.failed:
            self._fail(self._instances[key], f"failed to receive weights ({error})")
        self.weight_sync.failed.clear()
        for handle in list(self._instances):
            if handle.state in ("failed", "stopped"):
                continue
            if not handle.proc.is_alive():
                self._fail(handle, f"died with exit code {handle.proc.exitcode}")
            elif (
                handle.state == "active"
                and now - self._reading_since > self.heartbeat_timeout_s
                and now - handle.last_seen > self.heartbeat_timeout_s
            ):
                self._fail(handle, f"sent nothing for {now - handle.last_seen:.0f} s (hung)")
