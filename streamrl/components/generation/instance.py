"""The service's handle on one generator instance process (StreamRL §3): how it is started, how
its messages are read, and how it is stopped, whatever state it is in.

Each instance gets its own inbox, its own pipe of results and its own weight-group rendezvous
store, so one that dies, hangs or is killed mid-write affects nothing but itself.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from streamrl.components.generation.messages import Finished, InstanceMessage, Released
from streamrl.components.generation.worker import WorkerSpec, worker_main
from streamrl.components.weights.transport import make_store
from streamrl.records import Request, Sample

#: How often an instance says it is alive while it runs (see ``worker``).
HEARTBEAT_S = 1.0


@dataclass
class InstanceInfo:
    """What the service knows about one generator instance.

    ``state``: ``"starting"`` (loading the model), ``"joining"`` (receiving current weights),
    ``"active"`` (takes requests), ``"draining"`` (finishing its requests before it stops),
    ``"failed"`` (died or hung; replaced) or ``"stopped"``.
    """

    instance_id: int
    pid: int | None
    alive: bool
    weight_version: int
    state: str


@dataclass
class InstanceHandle:
    """One instance process and what the service tracks about it."""

    instance_id: int
    proc: Any
    inbox: Any
    link: Any  # the read end of its pipe of results (None once it is closed)
    store: Any  # the rendezvous store of its weight group (kept alive with the group)
    state: str = "starting"
    version: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    open: dict[tuple, Request] = field(default_factory=dict)  # requests it holds, by key
    site: str = "local"  # where it runs (the trainer's site unless the service was given sites)
    head: int | None = None  # the instance feeding it weights; None: the trainer
    members: set[int] = field(default_factory=set)  # instances it feeds weights to
    feed_generation: int = 0  # bumped each time it is connected to a (new) feeder
    latency: dict | None = None  # the latency model it measured at start (its fields), if asked
    batch_limit: int | None = None  # the dispatcher's batch size for it; None: the service's

    @classmethod
    def spawn(
        cls, ctx: Any, instance_id: int, spec_fields: dict[str, Any], timeout_s: float
    ) -> InstanceHandle:
        """Start the process; it loads the model and says ``ready`` on its pipe.

        ``spec_fields``: the ``WorkerSpec`` fields that say what to run (``model_dir``,
        ``engine``, ``scheduler``, the sampling settings, ``device``...).
        """
        store = make_store(2, timeout_s)
        spec = instance_spec(instance_id, store.port, timeout_s, spec_fields)
        inbox = ctx.Queue()
        link, outbox = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=worker_main,
            args=(spec, inbox, outbox),
            daemon=True,
            name=f"streamrl-generator-{instance_id}",
        )
        proc.start()
        outbox.close()  # the child holds the write end: its death reads as end-of-file here
        return cls(instance_id, proc, inbox, link, store)

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            self.instance_id, self.proc.pid, self.proc.is_alive(), self.version, self.state
        )

    def read(self) -> InstanceMessage | None:
        """One message from the pipe, or ``None`` (and the pipe closed) if the process died,
        maybe mid-write."""
        try:
            return self.link.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            self.close_link()
            return None

    def salvage(self) -> list[Sample]:
        """After a failure: the samples it finished and sent before it went (each is one whole
        pickled message); they leave ``open``, so only what it still held gets requeued (the
        requests it released to move on, with their progress)."""
        kept = []
        while self.link is not None and self.link.poll(0):
            message = self.read()
            if isinstance(message, Finished) and self.open.pop(message.sample.key, None):
                kept.append(message.sample)
            elif isinstance(message, Released):  # requeued with the progress they had
                self.open.update((r.key, r) for r in message.requests if r.key in self.open)
        self.close_link()
        return kept

    def close_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def stop(self, timeout_s: float) -> None:
        """Join, then terminate, then kill (a stopped — SIGSTOP — process needs SIGCONT)."""
        proc = self.proc
        proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def instance_spec(
    instance_id: int,
    store_port: int,
    timeout_s: float,
    spec_fields: dict[str, Any],
    **launcher_fields: Any,
) -> WorkerSpec:
    """The ``WorkerSpec`` of an instance that joins its weight group (the trainer, rank 0, and
    it, rank 1) through the rendezvous store at ``store_port``.

    Args:
        instance_id: the instance's id in the service.
        store_port: the port of the group's store (``make_store``).
        timeout_s: the service's start timeout.
        spec_fields: what to run (``model_dir``, ``engine``, ``scheduler``, the sampling
            settings, ``device``...).
        **launcher_fields: fields its launcher sets (a Ray actor's ``store_host``).
    """
    return WorkerSpec(
        instance_id,
        store_port=store_port,
        world_size=2,
        rank=1,
        timeout_s=timeout_s,
        heartbeat_s=HEARTBEAT_S,
        **launcher_fields,
        **spec_fields,
    )
