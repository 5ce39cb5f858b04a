"""The body of one generator instance process of the stream generation service (StreamRL §3).

It builds its generator with the service's engine (``GenerationEngine``: ``HFEngine``,
``VLLMEngine`` or yours) and its own admission queue (the service's scheduler factory, called
here), then loops: take requests and weight updates from its inbox, run one continuous-batching
step, push every finished sample to its outbox (a pipe of its own to the service) at once.
Messages both ways are typed records of picklable values (``messages``); samples hold lists,
never tensors. A pipe per instance means an instance killed mid-write can garble only its own
pipe. What a weight update
fills is the generator's ``weight_templates()`` (the whole policy, or a LoRA policy's adapters):
each version is received bucket by bucket into one host staging in the engine's dtype
(``StagedWeights``, pinned when CUDA is present), passed on bucket by bucket to the instances this
one feeds, and loaded from there into the engine when the partial-rollout policy allows; no
full-model receive buffer is allocated, and a version that must wait waits in host memory.

Inbox: the service's records (``streamrl.components.generation.messages``): ``Submit``,
``Limit``, ``Update`` (a weight version to receive), ``Refeed``, ``Relay`` / ``Unrelay`` (pass
weights on to a member, ``weight_relay``), ``AskFingerprint``, ``Release`` (requests leave for
another instance, ``moving``), ``AskStatus``, ``Reprioritize``, ``ProtocolInit`` /
``ProtocolUpdate`` (vLLM's weight-transfer protocol), ``Stop``; anything else is refused.
Outbox: the records of ``streamrl.components.generation.messages``: ``Ready``, ``Finished``
(a sample), ``Heartbeat``, ``Updated`` (after ``Digests`` for a version to verify),
``WeightsLost``, ``Fingerprinted``, ``Released``, ``Running`` (a status answer), ``Crashed``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from streamrl.components.generation.hf_generator import fingerprint
from streamrl.components.generation.messages import (
    AskFingerprint,
    AskStatus,
    Crashed,
    Digests,
    Fingerprinted,
    Finished,
    Heartbeat,
    Limit,
    ProtocolInit,
    ProtocolUpdate,
    Ready,
    Refeed,
    Relay,
    Release,
    Released,
    Reprioritize,
    Running,
    ServiceMessage,
    Stop,
    Submit,
    Unrelay,
    Update,
    Updated,
    WeightsLost,
    corrupt,
)
from streamrl.components.generation.partial import WeightLoader
from streamrl.components.generation.protocol_receiver import ProtocolReceiver
from streamrl.components.generation.weight_receiver import WeightReceiver
from streamrl.components.skewness.instance_profile import LatencyProfile, profiled_latency
from streamrl.components.skewness.schedulers import FIFOScheduler
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES
from streamrl.components.weights.relay import WeightRelay
from streamrl.components.weights.staging import StagedWeights
from streamrl.protocols import (
    AdmissionScheduler,
    EngineSpec,
    GenerationEngine,
    MovableGenerator,
    WeightTransport,
)
from streamrl.records import Request
from streamrl.runtime.devices import pin_visible_gpu

# fingerprint: imported from here by callers that compare an instance's weights with a policy.
from streamrl.runtime.peak_memory import (
    DECODE_FREED_MEMORY_THRESHOLD_BYTES,
    release_freed_memory,
)

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
    timeout_s: float = 120.0  # the service's start timeout
    weight_timeout_s: float = 300.0  # one weight transfer (and its group's connection)
    heartbeat_s: float = 1.0
    store_host: str = "127.0.0.1"  # where the trainer hosts the weight group's store
    device: str = "cpu"  # where the model runs: "cpu", or "cuda" with a GPU of its own
    transport: WeightTransport | str = "gloo"  # how weights arrive (WeightGroup)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # the staging's largest bucket (the trainer's)
    profile: LatencyProfile | None = None  # measure PTL(BS) here before saying ready
    stop_token_ids: tuple[int, ...] = ()  # end-of-turn ids a sample also stops on
    stop_strings: tuple[str, ...] = ()  # a sample stops once its text contains one
    partial_rollout: str = "finish"  # running sequences at a weight update (``partial.py``)
    weight_protocol: bool = False  # weights through vLLM's protocol (``protocol_feed``)

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
    if not str(spec.device).startswith("cuda"):  # memory follows the live big tensors
        release_freed_memory(DECODE_FREED_MEMORY_THRESHOLD_BYTES)
    # The pool starts instances as daemons (never outliving it); an instance may start processes
    # of its own (vLLM's tensor-parallel workers, daemons too, which watch it and end with it).
    multiprocessing.current_process().daemon = False
    # Before CUDA starts here: this instance sees its own GPU only (vLLM takes "the" GPU).
    spec = replace(spec, device=pin_visible_gpu(spec.device))
    parent = os.getppid()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per instance would only clutter the log
        _Instance(spec, outbox, parent).run(inbox)
    except BaseException:  # report everything, including SystemExit from a broken import
        _put(outbox, Crashed(spec.instance_id, traceback.format_exc()), parent)
        return
    # Stopped: leave at once. A normal interpreter exit would tear down gloo's threads
    # mid-receive, which aborts with "terminate called without an active exception".
    outbox.close()
    leave() if leave is not None else os._exit(0)


class _Instance:
    """The generator plus what it waits for: requests held until their weight version arrives
    (admission pacing for the staleness bound) and weights being received in the background."""

    def __init__(self, spec: WorkerSpec, outbox: Any, parent: int) -> None:
        self.spec, self.outbox, self.parent = spec, outbox, parent
        self.generator = spec.engine(spec.engine_spec(), spec.scheduler())
        templates = self.generator.weight_templates()
        wire = str(next(iter(templates.values())).dtype) if templates else "float32"
        wire = wire.removeprefix("torch.")
        self.protocol = (
            ProtocolReceiver(self.generator, spec.instance_id, spec.partial_rollout)
            if spec.weight_protocol
            else None
        )
        curve = None
        if spec.profile is not None:  # PTL(BS) of this engine, device and dtype (§5.1)
            model, _ = profiled_latency(
                self.generator, spec.profile, spec.model_dir, spec.engine, spec.device
            )
            curve = asdict(model)
        self.loader = WeightLoader(self.generator, spec.partial_rollout)
        self.held: list[Request] = []
        self.verify: set[int] = set()  # versions whose checksums the service wants once loaded
        # The trainer's names and shapes, in the engine's dtype: what travels. An engine that
        # loads from a staging of its own (vLLM's, shared with its worker processes) receives
        # straight into that one; with vLLM's protocol there is none.
        self.receiver = None if self.protocol is not None else self._receiver(templates)
        _put(outbox, Ready(spec.instance_id, os.getpid(), wire, curve), parent)

    def _receiver(self, templates: dict[str, torch.Tensor]) -> WeightReceiver:
        from streamrl.components.weights.transport import WeightGroup

        spec = self.spec
        own = getattr(self.generator, "weight_staging", None)
        staged = (
            own(spec.bucket_bytes)
            if own is not None
            else StagedWeights.like(templates.items(), bucket_bytes=spec.bucket_bytes)
        )
        timeout_s = spec.weight_timeout_s

        def connect(generation: int) -> WeightGroup:
            return WeightGroup(
                spec.store_port,
                spec.rank,
                spec.world_size,
                timeout_s=timeout_s,
                host=spec.store_host,
                transport=spec.transport,
                device=spec.device,
                generation=generation,
                abandon=lambda: receiver.fed_anew(generation),  # a dead feeder's connect
            )

        relay = WeightRelay(staged, spec.store_host, timeout_s, spec.transport)
        receiver = WeightReceiver(connect, staged, relay)
        return receiver

    def run(self, inbox: Any) -> None:
        beat = time.monotonic()
        while os.getppid() == self.parent:
            if time.monotonic() - beat > self.spec.heartbeat_s:
                beat = time.monotonic()
                _put(self.outbox, Heartbeat(self.spec.instance_id), self.parent)
            self._apply_received_weights()
            # A version cut short in a shared broadcast is awaited again: no token before it.
            waiting = self.protocol is not None and self.protocol.waiting is not None
            idle = self.generator.idle or waiting
            busy = self.receiver is not None and self.receiver.busy
            message = _next_message(inbox, block=idle, poll_s=0.005 if busy else POLL_S)
            if message is not None:
                if isinstance(message, Stop):
                    return
                self._handle(message)
                continue  # drain the inbox before decoding: requests join this step's batch
            if waiting:
                continue
            for sample in self.generator.step():
                _put(self.outbox, Finished(sample), self.parent)

    def _handle(self, message: ServiceMessage) -> None:
        if corrupt(message):  # fail loudly: the service replaces this instance, requeues
            raise ValueError(f"Corrupt message from the service: {message!r:.200}")
        generator, me = self.generator, self.spec.instance_id
        movable = isinstance(generator, MovableGenerator)
        match message:
            case Submit(requests=requests):
                self.held.extend(requests)
                self._release_held()
            case Limit(batch_size=size):
                generator.set_batch_limit(size)
            case Update(version=version, generation=generation, verify=verify):
                if verify:
                    self.verify.add(version)
                self.receiver.receive(version, generation)  # joins it in the background
            case Refeed(generation=generation):
                self.receiver.refeed(generation)
            case Relay(member=member, port=port, first=first, generation=generation):
                # In order with the receives, on the receiving thread.
                self.receiver.relay("relay", (member, port, first, generation))
            case Unrelay(member=member):
                self.receiver.relay("unrelay", (member,))
            case AskFingerprint():
                digest = getattr(generator, "fingerprint", None)
                if digest is None:
                    raise ValueError(
                        f"fingerprint: {type(generator).__name__} has no fingerprint() (the "
                        "vLLM engine keeps no HF copy of the weights)."
                    )
                _put(self.outbox, Fingerprinted(me, digest()), self.parent)
            case AskStatus(query_id=query):  # the planner's (``moving``); None: cannot move
                running = generator.running_progress() if movable else None
                _put(self.outbox, Running(me, query, running), self.parent)
            case Reprioritize(costs=costs):
                for request in self.held:
                    request.predicted_length = costs.get(request.key, request.predicted_length)
                if movable:
                    generator.reprioritize(costs)
            case Release(move_id=move_id, keys=keys):  # requests leave for another instance
                keys = set(keys)
                moved = [r for r in self.held if r.key in keys]
                self.held = [r for r in self.held if r.key not in keys]
                moved += generator.release(keys) if movable else []
                _put(self.outbox, Released(me, move_id, moved), self.parent)
            case ProtocolInit() | ProtocolUpdate():
                self._protocol(message)

    def _protocol(self, message: ProtocolInit | ProtocolUpdate) -> None:
        """vLLM's weight-transfer calls, between two steps (``protocol_feed``)."""
        if self.protocol is None:
            raise ValueError(
                f"{type(message).__name__}: this instance was not started with weight_protocol."
            )
        reply = self.protocol.handle(message)
        if isinstance(reply, Updated):
            if message.update_info.get("digests"):
                self._report_digests(reply.version)
            _put(self.outbox, reply, self.parent)
            self._release_held()
        elif reply is not None:
            _put(self.outbox, reply, self.parent)

    def _report_digests(self, version: int) -> None:
        """The checksums of the weights held now, by the trainer's names (before ``updated``:
        the service has checked them by the time every instance says it loaded)."""
        digests = getattr(self.generator, "weight_digests", None)
        if digests is not None:
            _put(self.outbox, Digests(self.spec.instance_id, version, digests()), self.parent)

    def _apply_received_weights(self) -> None:
        if self.receiver is None:  # fed through vLLM's protocol (``_protocol``)
            lost = self.protocol.overdue() if self.protocol is not None else None
            if lost is not None:
                _put(self.outbox, lost, self.parent)
            return
        for version, staged in self.receiver.ready():
            if isinstance(staged, str):  # it did not arrive: the service decides whose fault
                lost = WeightsLost(self.spec.instance_id, *version, staged)
                _put(self.outbox, lost, self.parent)
            else:
                self.loader.offer(version, staged)
        # Between two decode steps (running sequences keep their slots), or once idle when
        # each sample must come from one version (partial_rollout "finish").
        loaded = self.loader.apply()
        for version in loaded:
            if version in self.verify and version == self.generator.weight_version:
                self._report_digests(version)
            self.verify.discard(version)
            _put(self.outbox, Updated(self.spec.instance_id, version), self.parent)
        if loaded:
            self._release_held()

    def _release_held(self) -> None:
        version = self.generator.weight_version
        ready = [r for r in self.held if r.min_weight_version <= version]
        if ready:
            self.held = [r for r in self.held if r.min_weight_version > version]
            self.generator.submit(ready)


def _next_message(inbox: Any, block: bool, poll_s: float = POLL_S) -> ServiceMessage | None:
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
