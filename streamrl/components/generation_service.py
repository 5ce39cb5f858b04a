"""The stream generation service (SGS): a pool of generator instances in their own processes.

StreamRL §3: generation runs apart from training, on its own resources, and every finished sample
is pushed to the trainer the moment it completes. The service has the paper's two calls:
``generate(requests)`` yields samples in completion order, and ``update(weights, version)``
pushes new weights to every instance. A dispatcher decides which instance gets which prompt.
``add_instance`` grows the pool while it runs (elastic generation, §6): the new instance loads the
model, receives the current weights, and only then takes requests.

Example:
    >>> with StreamGenerationService("path/to/model", num_instances=2) as sgs:  # doctest: +SKIP
    ...     for sample in sgs.generate(requests):
    ...         print(sample.prompt_id, sample.length)
    ...     sgs.update(policy, version=1)
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.components.dispatch import Dispatcher, RoundRobinDispatcher
from streamrl.components.generator_worker import WorkerSpec, worker_main
from streamrl.components.weight_sync import AsyncWeightSync, Weights
from streamrl.components.weight_transport import WeightGroup, make_store
from streamrl.records import Request, Sample


class GeneratorError(RuntimeError):
    """A generator instance failed; the message names the instance and the cause."""


@dataclass
class InstanceInfo:
    """What the service knows about one generator instance.

    ``state``: ``"starting"`` (loading the model), ``"joining"`` (receiving current weights),
    ``"active"`` (takes requests) or ``"stopped"``.
    """

    instance_id: int
    pid: int | None
    alive: bool
    weight_version: int
    state: str


@dataclass
class _Instance:
    """The service's handle on one instance process."""

    instance_id: int
    proc: Any
    inbox: Any
    state: str = "starting"
    version: int = 0
    store: Any = None  # the rendezvous store of an instance's own weight group (elastic)


class StreamGenerationService:
    """N generator instances, each a spawned process running continuous batching (§3, §5).

    Samples come back on one bounded queue (back-pressure: instances pause when the trainer
    falls behind, memory stays bounded); weights go out over a torch.distributed group.

    Args:
        model_dir: the policy's model directory; every instance loads it at start.
        num_instances: generator processes.
        max_batch_size: batch slots per instance.
        temperature / greedy: sampling settings.
        seed: base sampling seed (instance ``i`` uses ``seed + i``).
        dispatcher: which instance gets which request; round-robin by prompt if ``None``.
        scheduler: admission order inside each instance: ``"fifo"`` or ``"lpt"`` (longest
            ``predicted_length`` first, §5.3).
        queue_size: capacity of the sample queue.
        start_timeout_s: how long instances may take to load the model.
        sample_timeout_s: the longest wait for the next sample before giving up.
    """

    def __init__(
        self,
        model_dir: str | Path,
        num_instances: int = 2,
        *,
        max_batch_size: int = 32,
        temperature: float = 1.0,
        greedy: bool = False,
        seed: int = 0,
        dispatcher: Dispatcher | None = None,
        scheduler: str = "fifo",
        queue_size: int = 1024,
        start_timeout_s: float = 180.0,
        sample_timeout_s: float = 300.0,
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}.")
        self.model_dir = str(model_dir)
        self.num_instances = num_instances
        self.dispatcher = dispatcher if dispatcher is not None else RoundRobinDispatcher()
        self.start_timeout_s, self.sample_timeout_s = start_timeout_s, sample_timeout_s
        if scheduler not in ("fifo", "lpt"):
            raise ValueError(f"scheduler must be 'fifo' or 'lpt', got {scheduler!r}.")
        self._generator_kwargs = dict(
            max_batch_size=max_batch_size, temperature=temperature, greedy=greedy,
            scheduler=scheduler,
        )  # fmt: skip
        self._seed, self._queue_size = seed, queue_size
        self._ctx = mp.get_context("spawn")
        self._instances: list[_Instance] = []
        self._outbox: Any = None
        self.weight_sync: AsyncWeightSync | None = None
        self._backlog: deque[Sample] = deque()
        self._outstanding: set[tuple[str, int, int]] = set()
        self.weight_version = 0  # loaded by every active instance
        self._pushed_version = 0  # the newest version handed to the weight sync

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> StreamGenerationService:
        """Spawn the instances and wait until each has loaded the model and joined the group."""
        if self._instances:
            return self
        store = make_store(self.num_instances + 1, self.start_timeout_s)
        self._outbox = self._ctx.Queue(maxsize=self._queue_size)
        try:
            for i in range(self.num_instances):
                self._spawn(i, store.port, rank=1 + i, world_size=self.num_instances + 1)
            self._wait_for(lambda: all(h.state != "starting" for h in self._instances),
                           "did not start", self.start_timeout_s)  # fmt: skip
            group = WeightGroup(
                store.port, 0, self.num_instances + 1, store=store, timeout_s=self.start_timeout_s
            )
            self.weight_sync = AsyncWeightSync(
                group, self._announcer(list(self._instances)), self.start_timeout_s
            )
            for handle in self._instances:
                handle.state, handle.version = "active", self.weight_version
        except BaseException:
            self.close()
            raise
        return self

    def add_instance(self, wait: bool = False) -> int:
        """Start one more generator instance while the service runs (elastic scale-out, §6).

        It loads the model in its own process, joins a weight group of its own, receives the
        newest weights pushed, and only then takes requests (its state goes ``starting`` ->
        ``joining`` -> ``active`` as the service reads its messages). Nothing running stops.

        Args:
            wait: block until it is active (samples finished meanwhile are kept).

        Returns:
            The new instance's id.
        """
        self._require_started()
        instance_id = len(self._instances)
        store = make_store(2, self.start_timeout_s)
        handle = self._spawn(instance_id, store.port, rank=1, world_size=2)
        handle.store = store
        if wait:
            self.wait_active()
        return instance_id

    def wait_active(self, timeout_s: float | None = None) -> None:
        """Block until every instance started is active (samples finished meanwhile are kept).

        Raises:
            GeneratorError: one did not load the model or receive weights within ``timeout_s``
                (default: twice the start timeout).
        """
        self._require_started()
        timeout_s = 2 * self.start_timeout_s if timeout_s is None else timeout_s
        self._wait_for(lambda: all(h.state == "active" for h in self._instances),
                       "did not become active", timeout_s)  # fmt: skip

    def _spawn(self, instance_id: int, port: int, rank: int, world_size: int) -> _Instance:
        spec = WorkerSpec(
            instance_id, self.model_dir, port, world_size, rank,
            {**self._generator_kwargs, "seed": self._seed + instance_id}, 0, self.start_timeout_s,
        )  # fmt: skip
        inbox = self._ctx.Queue()
        proc = self._ctx.Process(
            target=worker_main, args=(spec, inbox, self._outbox), daemon=True,
            name=f"streamrl-generator-{instance_id}",
        )  # fmt: skip
        proc.start()
        handle = _Instance(instance_id, proc, inbox)
        self._instances.append(handle)
        return handle

    def _join(self, handle: _Instance) -> None:
        """A late instance has loaded the model: connect its weight group, queue its catch-up."""
        group = WeightGroup(handle.store.port, 0, 2, store=handle.store,
                            timeout_s=self.start_timeout_s)  # fmt: skip
        handle.state = "joining"
        self.weight_sync.add_group(group, self._announcer([handle]))
        if self._pushed_version == 0:  # nothing pushed yet: the model directory is current
            handle.state = "active"

    @staticmethod
    def _announcer(handles: list[_Instance]) -> Callable[[int], None]:
        def announce(version: int) -> None:
            for handle in handles:
                if handle.state != "stopped":
                    handle.inbox.put(("update", version))

        return announce

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every instance: ask politely, then terminate, then kill. Safe to call twice."""
        for handle in self._instances:
            if handle.proc.is_alive():
                handle.inbox.put(("stop",))
        deadline = time.monotonic() + timeout_s
        for handle in self._instances:
            proc = handle.proc
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
            handle.state = "stopped"
        for q in [*(h.inbox for h in self._instances), self._outbox]:
            if q is not None:
                q.cancel_join_thread()  # never block our own exit on undelivered messages
                q.close()
        if self.weight_sync is not None:
            self.weight_sync.close()
        self._instances, self._outbox, self.weight_sync = [], None, None
        self._outstanding.clear()
        self._backlog.clear()

    def __enter__(self) -> StreamGenerationService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the two calls -----------------------------------------------------------------------
    def submit(self, requests: Sequence[Request], scores: Sequence[float] | None = None) -> None:
        """Dispatch ``requests`` to the instances and return at once (see ``next_sample``).

        Args:
            requests: one per sample; ``(prompt_id, sample_index)`` must be unique among all
                requests not yet returned.
            scores: optional predicted lengths, passed to the dispatcher.
        """
        self._require_started()
        keys = {r.key for r in requests}
        if len(keys) != len(requests) or keys & self._outstanding:
            raise ValueError("submit: duplicate (prompt_id, sample_index) among open requests.")
        self._outstanding |= keys
        active = self._active()
        parts = self.dispatcher.plan(requests, scores, len(active))
        limits = getattr(self.dispatcher, "batch_limits", None)  # per-pool batch sizes (§5.3)
        for i, (handle, batch) in enumerate(zip(active, parts)):
            if limits is not None:
                handle.inbox.put(("limit", limits(len(active))[i]))
            if batch:
                handle.inbox.put(("submit", list(batch)))

    def next_sample(self) -> Sample:
        """The next finished sample from any instance, in completion order.

        Raises:
            GeneratorError: an instance died or reported an error, sent a sample nobody asked
                for, or no sample arrived within ``sample_timeout_s``.
        """
        self._require_started()
        if not self._outstanding:
            raise RuntimeError("next_sample: no request is open; submit() some first.")
        while not self._backlog:
            kind, payload = self._next_message(time.monotonic() + self.sample_timeout_s)
            if kind == "sample":
                self._backlog.append(payload)
        sample = self._backlog.popleft()
        if sample.key not in self._outstanding:
            raise GeneratorError(f"Instance {sample.instance_id} sent an unexpected or "
                                 f"duplicate sample {sample.key}.")  # fmt: skip
        self._outstanding.discard(sample.key)
        return sample

    def generate(
        self, requests: Sequence[Request], scores: Sequence[float] | None = None
    ) -> Iterator[Sample]:
        """Dispatch ``requests`` and yield each sample as soon as any instance finishes it
        (the paper's ``generate``; ``submit`` + ``next_sample`` when several batches overlap).
        """
        self.submit(requests, scores)
        for _ in range(len(requests)):
            yield self.next_sample()

    def update(self, weights: Weights, version: int) -> float:
        """Push new weights to every instance and wait until each has loaded them.

        Args:
            weights: the policy (its ``named_parameters``) or a name -> tensor mapping in the
                same order as the policy's parameters.
            version: the new weight version; samples admitted afterwards carry it.

        Returns:
            Seconds spent, broadcast and acknowledgements included.
        """
        started = time.perf_counter()
        self.push_weights(weights, version)
        self.wait_weights(version)
        return time.perf_counter() - started

    def push_weights(self, weights: Weights, version: int) -> float:
        """Start sending ``version`` in the background and return (one-step async mode, §4.1).

        Instances load it between two decode steps, without stopping their batch. Returns the
        seconds the caller was blocked (taking the snapshot).
        """
        self._require_started()
        self._pushed_version = max(self._pushed_version, version)
        return self.weight_sync.push(weights, version)

    def wait_weights(self, version: int) -> float:
        """Block until every instance has loaded ``version``; returns the seconds blocked."""
        started = time.perf_counter()
        self.weight_sync.wait_sent(version)
        self._wait_for(lambda: min(h.version for h in self._active()) >= version,
                       f"did not load weights {version}", self.sample_timeout_s)  # fmt: skip
        self.weight_version = max(self.weight_version, version)
        return time.perf_counter() - started

    # -- inspection --------------------------------------------------------------------------
    def instances(self) -> list[InstanceInfo]:
        """Pid, liveness, weight version and state of every instance (for operators, tests)."""
        return [
            InstanceInfo(h.instance_id, h.proc.pid, h.proc.is_alive(), h.version, h.state)
            for h in self._instances
        ]

    def fingerprints(self) -> dict[int, str]:
        """Each active instance's weight hash (compare with
        ``generator_worker.fingerprint(policy)``)."""
        self._require_started()
        active = self._active()
        for handle in active:
            handle.inbox.put(("fingerprint",))
        found: dict[int, str] = {}
        while len(found) < len(active):
            kind, payload = self._next_message()
            if kind == "fingerprint":
                found[payload[0]] = payload[1]
            elif kind == "sample":  # finished meanwhile: keep it for next_sample
                self._backlog.append(payload)
        return found

    # -- internals ---------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._instances:
            raise RuntimeError(
                "StreamGenerationService is not started; call start() or use `with`."
            )

    def _active(self) -> list[_Instance]:
        return [h for h in self._instances if h.state == "active"]

    def _wait_for(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Read messages (keeping samples for ``next_sample``) until ``done()``; raise
        ``GeneratorError`` naming the instances that are not there yet after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise GeneratorError(f"Generator instances {what} within {timeout_s:.0f} s: "
                                     f"{self.instances()}.")  # fmt: skip
            kind, payload = self._next_message(deadline)
            if kind == "sample":
                self._backlog.append(payload)

    def _next_message(self, deadline: float | None = None) -> tuple[str, Any]:
        """Next message from any instance; raises if one died, reported an error, or timed out."""
        deadline = deadline if deadline is not None else time.monotonic() + self.sample_timeout_s
        while True:
            try:
                message = self._outbox.get(timeout=0.25)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise GeneratorError(
                        "No message from any generator instance within the timeout; instances: "
                        f"{self.instances()}."
                    ) from None
                continue
            self._track(message)
            kind = message[0]
            if kind == "error":
                raise GeneratorError(f"Generator instance {message[1]} failed:\n{message[2]}")
            if kind == "sample" and len(message) == 2:
                return kind, message[1]
            return kind, message[1:]

    def _track(self, message: tuple) -> None:
        """Instance bookkeeping, here so that no reader can miss a state change."""
        kind = message[0]
        if kind == "ready":
            handle = self._instances[message[1]]
            if handle.store is None:  # first cohort: start() connects the group
                handle.state = "loaded"
            else:
                self._join(handle)
        elif kind == "updated":
            handle = self._instances[message[1]]
            handle.version = max(handle.version, message[2])
            if handle.state == "joining" and handle.version >= self._pushed_version:
                handle.state = "active"

    def _check_alive(self) -> None:
        for h in self._instances:
            if not h.proc.is_alive():
                raise GeneratorError(
                    f"Generator instance {h.instance_id} (pid {h.proc.pid}) died with exit code "
                    f"{h.proc.exitcode}."
                )
