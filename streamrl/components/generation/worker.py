"""The body of one generator instance process of the stream generation service (StreamRL §3).

It builds its generator with the service's engine (``GenerationEngine``: ``HFEngine``,
``VLLMEngine`` or yours) and its own admission queue (the service's scheduler factory, called
here), then loops: take requests and weight updates from its inbox, run one continuous-batching
step, push every finished sample to its outbox (a pipe of its own to the service) at once.
Messages are plain tuples of picklable values; samples hold lists, never tensors. A pipe per
instance means an instance killed mid-write can garble only its own pipe. What a weight update
fills is the generator's ``weight_templates()`` (the whole policy, or a LoRA policy's adapters).

Inbox:  ``("submit", [Request, ...])``, ``("limit", batch_size)``, ``("update", version)``,
``("fingerprint",)``, ``("relay", member, port, first)`` / ``("unrelay", member)`` (a site's head
forwards weights to a member, ``weight_relay``), ``("stop",)``.
Outbox: ``("ready", instance_id, pid)``, ``("sample", Sample)``, ``("updated", instance_id,
version)``, ``("fingerprint", instance_id, hex)``, ``("heartbeat", instance_id)`` (every
``heartbeat_s`` while it runs), ``("error", instance_id, traceback_text)``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# fingerprint: imported from here by callers that compare an instance's weights with a policy.
from streamrl.components.generation.hf_generator import fingerprint
from streamrl.components.generation.partial import WeightLoader
from streamrl.components.skewness.schedulers import FIFOScheduler
from streamrl.components.weights.relay import WeightRelay, relay_messages
from streamrl.protocols import AdmissionScheduler, EngineSpec, GenerationEngine
from streamrl.records import Request

__all__ = ["WorkerSpec", "fingerprint", "worker_main"]

#: How often an idle or blocked worker checks that its parent is still alive.
POLL_S = 0.5


@dataclass
class WorkerSpec:
    """What a generator instance process needs to start (pickled to it at spawn).

    ``engine`` builds the generator there, ``scheduler`` (a factory, e.g. ``LPTScheduler``) its
    admission queue; the sampling settings and ``device`` become its ``EngineSpec``.
    """

    instance_id: int
    model_dir: str
    store_port: int
    world_size: int
    rank: int
    engine: GenerationEngine
    scheduler: Callable[[], AdmissionScheduler] = FIFOScheduler
    max_batch_size: int = 32
    temperature: float = 1.0
    greedy: bool = False
    seed: int = 0
    weight_version: int = 0
    timeout_s: float = 120.0
    heartbeat_s: float = 1.0
    store_host: str = "127.0.0.1"  # where the trainer hosts the weight group's store
    device: str = "cpu"  # where the model runs: "cpu", or "cuda" with a GPU of its own
    transport: str = "gloo"  # how weights arrive: "gloo", "bucketed" or "nccl" (WeightGroup)
    relays: bool = False  # at a remote site: may forward weights to its site (weight_relay)
    stop_token_ids: tuple[int, ...] = ()  # end-of-turn ids a sample also stops on
    stop_strings: tuple[str, ...] = ()  # a sample stops once its text contains one
    partial_rollout: str = "finish"  # running sequences at a weight update (``partial.py``)

    def engine_spec(self) -> EngineSpec:
        """What the engine gets to build this instance."""
        return EngineSpec(
            model_dir=self.model_dir,
            device=self.device,
            instance_id=self.instance_id,
            weight_version=self.weight_version,
            max_batch_size=self.max_batch_size,
            temperature=self.temperature,
            greedy=self.greedy,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            stop_strings=self.stop_strings,
        )


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any, leave: Any = None) -> None:
    """Run one generator instance until told to stop or its parent dies.

    ``leave``: how the process ends once stopped (default ``os._exit(0)``; a Ray actor passes
    ``ray.actor.exit_actor``, so Ray sees a clean exit).
    """
    # Ctrl-C goes to the whole process group; the parent decides and stops us cleanly.
    with contextlib.suppress(ValueError):  # not the main thread (a Ray actor may be threaded)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    parent = os.getppid()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per instance would only clutter the log
        _Instance(spec, outbox, parent).run(inbox)
    except BaseException:  # report everything, including SystemExit from a broken import
        _put(outbox, ("error", spec.instance_id, traceback.format_exc()), parent)
        return
    # Stopped: leave at once. A normal interpreter exit would tear down gloo's threads
    # mid-receive, which aborts with "terminate called without an active exception".
    outbox.close()
    leave() if leave is not None else os._exit(0)


class _Instance:
    """The generator plus what it waits for: requests held until their weight version arrives
    (admission pacing for the staleness bound) and weights being received in the background."""

    def __init__(self, spec: WorkerSpec, outbox: Any, parent: int) -> None:
        from streamrl.components.weights.transport import WeightGroup

        self.spec, self.outbox, self.parent = spec, outbox, parent
        self.generator = spec.engine(spec.engine_spec(), spec.scheduler())
        synced = dict(self.generator.weight_templates())  # the trainer's names, shapes, dtypes
        _put(outbox, ("ready", spec.instance_id, os.getpid()), parent)
        group = WeightGroup(
            spec.store_port,
            spec.rank,
            spec.world_size,
            timeout_s=spec.timeout_s,
            host=spec.store_host,
            transport=spec.transport,
            device=spec.device,
        )
        on = spec.device if spec.transport == "nccl" else "cpu"  # NCCL receives GPU to GPU
        relay = (
            WeightRelay(spec.store_host, spec.timeout_s, spec.transport) if spec.relays else None
        )
        self.receiver = _WeightReceiver(group, synced, on, relay)
        self.loader = WeightLoader(self.generator, spec.partial_rollout)
        self.held: list[Request] = []

    def run(self, inbox: Any) -> None:
        beat = time.monotonic()
        while os.getppid() == self.parent:
            if time.monotonic() - beat > self.spec.heartbeat_s:
                beat = time.monotonic()
                _put(self.outbox, ("heartbeat", self.spec.instance_id), self.parent)
            self._apply_received_weights()
            idle = self.generator.idle
            message = _next_message(
                inbox, block=idle, poll_s=0.005 if self.receiver.busy else POLL_S
            )
            if message is not None:
                if message[0] == "stop":
                    return
                self._handle(message)
                continue  # drain the inbox before decoding: requests join this step's batch
            for sample in self.generator.step():
                _put(self.outbox, ("sample", sample), self.parent)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        relay = relay_messages(message)
        if relay is not None:
            self.receiver.relay(*relay)  # in order with the receives, on the receiving thread
            return
        if kind not in ("submit", "limit", "update", "fingerprint") or (
            kind == "update" and not isinstance(message[1], int)
        ):  # fail loudly: the service replaces this instance and requeues its requests
            raise ValueError(f"Corrupt message from the service: {message!r:.200}")
        if kind == "submit":
            self.held.extend(message[1])
            self._release_held()
        elif kind == "limit":
            self.generator.set_batch_limit(message[1])
        elif kind == "update":
            self.receiver.receive(message[1])  # joins the broadcast in the background
        elif kind == "fingerprint":
            digest = getattr(self.generator, "fingerprint", None)
            if digest is None:
                raise ValueError(
                    f"fingerprint: {type(self.generator).__name__} has no fingerprint() (the "
                    "vLLM engine keeps no HF copy of the weights)."
                )
            _put(self.outbox, ("fingerprint", self.spec.instance_id, digest()), self.parent)

    def _apply_received_weights(self) -> None:
        for version, buffers in self.receiver.ready():
            self.loader.offer(version, buffers)
        # Between two decode steps (running sequences keep their slots), or once idle when
        # each sample must come from one version (partial_rollout "finish").
        loaded = self.loader.apply()
        for version in loaded:
            _put(self.outbox, ("updated", self.spec.instance_id, version), self.parent)
        if loaded:
            self._release_held()

    def _release_held(self) -> None:
        version = self.generator.weight_version
        ready = [r for r in self.held if r.min_weight_version <= version]
        if ready:
            self.held = [r for r in self.held if r.min_weight_version > version]
            self.generator.submit(ready)


class _WeightReceiver:
    """Receives broadcast weights on a background thread, so decoding goes on meanwhile; a
    site's head also forwards them there to its members (``WeightRelay``)."""

    def __init__(
        self,
        group: Any,
        params: dict[str, torch.Tensor],
        device: str = "cpu",
        relay: WeightRelay | None = None,
    ) -> None:
        self.group, self.params, self.device, self._relay = group, params, device, relay
        self._todo: queue.Queue[tuple] = queue.Queue()
        self._done: queue.Queue[tuple[int, dict] | BaseException] = queue.Queue()
        self._pending = 0
        threading.Thread(target=self._loop, daemon=True, name="weight-receiver").start()

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def receive(self, version: int) -> None:
        self._pending += 1
        self._todo.put(("receive", version))

    def relay(self, kind: str, args: tuple) -> None:
        if self._relay is None:
            raise ValueError("relay: this instance was not started at a remote site.")
        self._todo.put((kind, args))

    def ready(self) -> list[tuple[int, dict]]:
        out = []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out
            self._pending -= 1
            if isinstance(item, BaseException):
                raise RuntimeError("Receiving weights failed") from item
            out.append(item)

    def _loop(self) -> None:
        while True:
            kind, payload = self._todo.get()
            try:
                if kind == "relay":
                    self._relay.add(*payload)
                elif kind == "unrelay":
                    self._relay.remove(*payload)
                else:
                    self._done.put((payload, self._receive(payload)))
            except BaseException as err:  # handed to the main loop, which reports it
                if kind == "receive":
                    self._done.put(err)
                else:  # a member that never connected: the service replaces it
                    self._relay.remove(payload[0])

    def _receive(self, version: int) -> dict[str, torch.Tensor]:
        # torch.empty, not empty_like: templates may live on the meta device (vLLM).
        buffers = {
            n: torch.empty(p.shape, dtype=p.dtype, device=self.device)
            for n, p in self.params.items()
        }
        self.group.broadcast(buffers.values())
        if self._relay is not None:
            self._relay.forward(version, buffers)
        return buffers


def _next_message(inbox: Any, block: bool, poll_s: float = POLL_S) -> tuple | None:
    try:
        return inbox.get(timeout=poll_s) if block else inbox.get_nowait()
    except queue.Empty:
        return None


def _put(outbox: Any, item: tuple, parent: int) -> None:
    """Send ``item`` to the service. A full pipe blocks (back-pressure: the trainer catches up);
    once the service is gone the pipe is broken, and the instance leaves."""
    try:
        outbox.send(item)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        os._exit(0)  # nobody reads our results any more
