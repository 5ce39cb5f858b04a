"""The stream generation service (SGS): a pool of generator instances in their own processes.

StreamRL §3: generation runs apart from training, on its own resources, and every finished sample
is pushed to the trainer the moment it completes. The service has the paper's two calls:
``generate(requests)`` yields samples in completion order, and ``update(weights, version)``
pushes new weights to every instance. A dispatcher decides which instance gets which prompt.

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
from collections.abc import Iterator, Sequence
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
    """What the service knows about one generator instance."""

    instance_id: int
    pid: int | None
    alive: bool
    weight_version: int


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
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self.weight_sync: AsyncWeightSync | None = None
        self._backlog: deque[Sample] = deque()
        self._outstanding: set[tuple[str, int]] = set()
        self.weight_version = 0
        self._versions = [0] * num_instances

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> StreamGenerationService:
        """Spawn the instances and wait until each has loaded the model and joined the group."""
        if self._procs:
            return self
        store = make_store(self.num_instances + 1, self.start_timeout_s)
        self._outbox = self._ctx.Queue(maxsize=self._queue_size)
        try:
            for i in range(self.num_instances):
                spec = WorkerSpec(
                    i, self.model_dir, store.port, self.num_instances + 1,
                    {**self._generator_kwargs, "seed": self._seed + i}, self.weight_version,
                    self.start_timeout_s,
                )  # fmt: skip
                inbox = self._ctx.Queue()
                proc = self._ctx.Process(
                    target=worker_main, args=(spec, inbox, self._outbox), daemon=True,
                    name=f"streamrl-generator-{i}",
                )  # fmt: skip
                proc.start()
                self._procs.append(proc)
                self._inboxes.append(inbox)
            self._wait_ready()
            group = WeightGroup(
                store.port, 0, self.num_instances + 1, store=store, timeout_s=self.start_timeout_s
            )
            self.weight_sync = AsyncWeightSync(group, self._announce, self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _announce(self, version: int) -> None:
        for inbox in self._inboxes:
            inbox.put(("update", version))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every instance: ask politely, then terminate, then kill. Safe to call twice."""
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(("stop",))
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for q in [*self._inboxes, self._outbox]:
            if q is not None:
                q.cancel_join_thread()  # never block our own exit on undelivered messages
                q.close()
        if self.weight_sync is not None:
            self.weight_sync.close()
        self._procs, self._inboxes, self._outbox, self.weight_sync = [], [], None, None
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
        for instance, batch in enumerate(
            self.dispatcher.plan(requests, scores, self.num_instances)
        ):
            if batch:
                self._inboxes[instance].put(("submit", list(batch)))

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
        return self.weight_sync.push(weights, version)

    def wait_weights(self, version: int) -> float:
        """Block until every instance has loaded ``version``; returns the seconds blocked."""
        started = time.perf_counter()
        self.weight_sync.wait_sent(version)
        while min(self._versions) < version:
            kind, payload = self._next_message()
            if kind == "sample":  # finished meanwhile: keep it for next_sample
                self._backlog.append(payload)
        self.weight_version = max(self.weight_version, version)
        return time.perf_counter() - started

    # -- inspection --------------------------------------------------------------------------
    def instances(self) -> list[InstanceInfo]:
        """Pid, liveness and weight version of every instance (for operators and tests)."""
        return [
            InstanceInfo(i, p.pid, p.is_alive(), self._versions[i])
            for i, p in enumerate(self._procs)
        ]

    def fingerprints(self) -> dict[int, str]:
        """Each instance's weight hash (compare with ``generator_worker.fingerprint(policy)``)."""
        self._require_started()
        for inbox in self._inboxes:
            inbox.put(("fingerprint",))
        found: dict[int, str] = {}
        while len(found) < self.num_instances:
            kind, payload = self._next_message()
            if kind == "fingerprint":
                found[payload[0]] = payload[1]
            elif kind == "sample":  # finished meanwhile: keep it for next_sample
                self._backlog.append(payload)
        return found

    # -- internals ---------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._procs:
            raise RuntimeError(
                "StreamGenerationService is not started; call start() or use `with`."
            )

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.num_instances:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_instances)) - ready)
                raise GeneratorError(f"Generator instances {missing} did not start within "
                                     f"{self.start_timeout_s:.0f} s.")  # fmt: skip
            kind, payload = self._next_message(deadline)
            if kind == "ready":
                ready.add(payload[0])

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
            kind = message[0]
            if kind == "error":
                raise GeneratorError(f"Generator instance {message[1]} failed:\n{message[2]}")
            if kind == "updated":  # bookkeeping here, so no reader can miss an acknowledgement
                self._versions[message[1]] = max(self._versions[message[1]], message[2])
            if kind == "sample" and len(message) == 2:
                return kind, message[1]
            return kind, message[1:]

    def _check_alive(self) -> None:
        for i, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise GeneratorError(
                    f"Generator instance {i} (pid {proc.pid}) died with exit code {proc.exitcode}."
                )
