"""The stream generation service (SGS): a pool of generator instances in their own processes.

StreamRL §3: generation runs apart from training, on its own resources, and every finished sample
is pushed to the trainer the moment it completes. The service has the paper's two calls:
``generate(requests)`` yields samples in completion order, and ``update(weights, version)``
pushes new weights to every instance. A dispatcher decides which instance gets which prompt.

The pool changes while it runs:

- ``add_instance`` grows it (elastic generation, §6): the new instance loads the model, receives
  the current weights, and only then takes requests;
- an instance that dies, or stays silent past ``heartbeat_timeout_s`` (then it is killed), is
  replaced the same way, and the requests it held go to the others: nothing is lost and nothing
  is returned twice (a late sample of a failed instance is discarded).

Examples:
    >>> with StreamGenerationService("path/to/model", num_instances=2) as sgs:  # doctest: +SKIP
    ...     for sample in sgs.generate(requests):
    ...         print(sample.prompt_id, sample.length)
    ...     sgs.update(policy, version=1)
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from streamrl.components.generation.engines import check_engines
from streamrl.components.generation.instance import InstanceHandle, InstanceInfo
from streamrl.components.generation.pool import GeneratorError, InstancePool
from streamrl.components.generation.ray_instance import RayOptions
from streamrl.components.skewness.dispatch import Dispatcher, RoundRobinDispatcher
from streamrl.components.weights.nccl import import_nccl
from streamrl.components.weights.sync import AsyncWeightSync, Weights
from streamrl.components.weights.transport import TRANSPORTS
from streamrl.errors import ConfigError, unknown_name
from streamrl.lora import LoRASpec
from streamrl.records import Request, Sample

__all__ = ["GeneratorError", "StreamGenerationService"]


class StreamGenerationService(InstancePool):
    """N generator instances, each a spawned process running continuous batching (§3, §5).

    Samples come back over one pipe per instance (bounded by the pipe's buffer: instances pause
    when the trainer falls behind, memory stays bounded); weights go out over one
    torch.distributed group per instance.

    Args:
        model_dir: the policy's model directory; every instance loads it at start.
        num_instances: generator processes.
        max_batch_size: batch slots per instance.
        temperature: sampling temperature.
        greedy: decode greedily instead of sampling.
        seed: base sampling seed (instance ``i`` uses ``seed + i``, reseeded for every weight
            version it loads, so a resumed run samples as the uninterrupted one).
        dispatcher: which instance gets which request; round-robin by prompt if ``None``.
        scheduler: admission order inside each instance: ``"fifo"`` or ``"lpt"`` (longest
            ``predicted_length`` first, §5.3).
        start_timeout_s: how long instances may take to load the model.
        sample_timeout_s: the longest wait for the next sample before giving up.
        max_restarts: failed instances replaced over the service's life; one more failure
            raises ``GeneratorError`` (0: every failure raises).
        heartbeat_timeout_s: an active instance silent this long, while the service is
            reading, is taken as hung: killed and replaced.
        status_path: a JSON file rewritten on every change of the pool (instance id -> pid,
            state, weight version), for operators.
        lora: wrap every instance's model with these adapters; updates then carry only the
            adapter tensors (push ``streamrl.lora.adapter_weights(policy)``).
        backend: the generation engine of every instance: ``"hf"`` (``HFStreamGenerator``) or
            ``"vllm"`` (``VLLMStreamGenerator``, the ``[vllm]`` extra).
        cluster: where instances run: ``"local"`` (processes of this machine) or ``"ray"``
            (Ray actors, the ``[ray]`` extra; see ``ray_instance``).
        gpus_per_instance: GPUs each instance runs on (0: the CPU).
        ray: Ray cluster options (address, local cluster size, temp dir) for ``cluster="ray"``.
        weight_transport: ``"gloo"``, ``"bucketed"`` or ``"nccl"`` (GPU to GPU through CuPy):
            how each instance's weight group moves tensors (``WeightGroup``).
        engine_options: more keyword arguments for every instance's generator (for ``"vllm"``,
            engine arguments such as ``max_model_len`` or ``kv_cache_memory_bytes``).
        sites: the site of each instance, in order (``num_instances`` names); instances at a
            site other than ``trainer_site`` get the weights from their site's first instance
            (its *head*), so one copy per version crosses to each remote site (§6,
            ``weight_relay``). ``None``: every instance beside the trainer.
        trainer_site: the trainer's site.
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
        start_timeout_s: float = 180.0,
        sample_timeout_s: float = 300.0,
        max_restarts: int = 3,
        heartbeat_timeout_s: float = 60.0,
        status_path: str | Path | None = None,
        lora: LoRASpec | None = None,
        backend: str = "hf",
        cluster: str = "local",
        gpus_per_instance: int = 0,
        ray: RayOptions | None = None,
        weight_transport: str = "gloo",
        engine_options: dict[str, Any] | None = None,
        sites: Sequence[str] | None = None,
        trainer_site: str = "local",
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}.")
        if scheduler not in ("fifo", "lpt"):
            raise ValueError(f"scheduler must be 'fifo' or 'lpt', got {scheduler!r}.")
        check_engines(backend, cluster, gpus_per_instance, lora=lora is not None)
        self.backend, self.cluster, self.gpus_per_instance = backend, cluster, gpus_per_instance
        self._ray = replace(ray or RayOptions(), gpus_per_instance=gpus_per_instance)
        if weight_transport not in TRANSPORTS:
            raise ConfigError(
                f"weight_transport: {unknown_name('transport', weight_transport, TRANSPORTS)}"
            )
        if weight_transport == "nccl":
            import_nccl()  # CuPy and a GPU, or a ConfigError saying how to get them
        self.weight_transport = weight_transport
        self.model_dir = str(model_dir)
        self.num_instances = num_instances
        self.dispatcher = dispatcher if dispatcher is not None else RoundRobinDispatcher()
        self.start_timeout_s, self.sample_timeout_s = start_timeout_s, sample_timeout_s
        self.max_restarts, self.heartbeat_timeout_s = max_restarts, heartbeat_timeout_s
        self.status_path = Path(status_path) if status_path is not None else None
        self._generator_kwargs = dict(
            max_batch_size=max_batch_size,
            temperature=temperature,
            greedy=greedy,
            scheduler=scheduler,
        )
        if lora is not None:
            self._generator_kwargs["lora"] = lora.to_dict()
        self._generator_kwargs.update(engine_options or {})
        if sites is not None and len(sites) != num_instances:
            raise ValueError(f"sites: one site per instance ({num_instances}), got {list(sites)}.")
        self._sites = list(sites) if sites is not None else [trainer_site] * num_instances
        self.trainer_site = trainer_site
        self._seed = seed
        self._ctx = mp.get_context("spawn")
        self._instances: list[InstanceHandle] = []
        self._running = False
        self._received: deque[tuple] = deque()  # read from the pipes, not yet handled
        self.weight_sync: AsyncWeightSync | None = None
        self._backlog: deque[Sample] = deque()
        self._outstanding: set[tuple] = set()
        self._orphans: list[Request] = []  # requeued while no instance was active
        self._reading_since = time.monotonic()
        self._last_read = 0.0
        self._checked = 0.0  # when instance health was last checked
        self.weight_version = 0  # loaded by every active instance
        self._pushed_version = 0  # the newest version handed to the weight sync
        #: Ledger of the service: requests submitted and requeued, samples returned and
        #: discarded (late copies from failed instances), instances restarted.
        self.counts: Counter[str] = Counter()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> StreamGenerationService:
        """Spawn the instances and wait until each has loaded the model and joined its group."""
        if self._running:
            return self
        self._running, self._instances = True, []
        self.weight_sync = AsyncWeightSync(self.start_timeout_s)
        try:
            for site in self._sites:
                self._spawn(site)
            self.wait_active(self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def add_instance(self, wait: bool = False, site: str | None = None) -> int:
        """Start one more generator instance while the service runs (elastic scale-out, §6).

        It loads the model in its own process, receives the newest weights pushed, and only
        then takes requests (its state goes ``starting`` -> ``joining`` -> ``active`` as the
        service reads its messages). Nothing running stops.

        Args:
            wait: block until it is active (samples finished meanwhile are kept).
            site: where it runs; the trainer's site by default.

        Returns:
            The new instance's id.
        """
        self._require_started()
        handle = self._spawn(site if site is not None else self.trainer_site)
        if wait:
            self.wait_active()
        return handle.instance_id

    def remove_instance(self, instance_id: int | None = None) -> int:
        """Retire one instance gracefully (elastic scale-in): it takes no new requests, finishes
        those it holds, then stops. Nothing is lost or cut short.

        Args:
            instance_id: which one; by default the newest active instance.

        Returns:
            The retired instance's id.
        """
        self._require_started()
        active = self._active()
        if len(active) < 2:
            raise ValueError("remove_instance: the service needs at least one active instance.")
        if instance_id is None:  # the newest that feeds no other instance
            handle = next(h for h in reversed(active) if not h.members)
        else:
            handle = self._instances[instance_id]
        if handle.state != "active":
            raise ValueError(f"remove_instance: instance {handle.instance_id} is {handle.state}.")
        if handle.members:
            raise ValueError(
                f"remove_instance: instance {handle.instance_id} forwards weights "
                f"to instances {sorted(handle.members)} of its site; remove them "
                "first."
            )
        self._set_state(handle, "draining")
        self._retire_drained()
        return handle.instance_id

    def wait_active(self, timeout_s: float | None = None) -> None:
        """Block until no instance is still starting or joining (samples finished meanwhile are
        kept).

        Raises:
            GeneratorError: one did not load the model or receive weights within ``timeout_s``
                (default: twice the start timeout).
        """
        self._require_started()
        timeout_s = 2 * self.start_timeout_s if timeout_s is None else timeout_s
        self._wait_for(
            lambda: not any(h.state in ("starting", "joining") for h in self._instances),
            "did not become active",
            timeout_s,
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every instance: ask politely, then terminate, then kill. Safe to call twice."""
        for handle in self._instances:
            if handle.proc.is_alive():
                handle.inbox.put(("stop",))
        deadline = time.monotonic() + timeout_s
        for handle in self._instances:
            handle.stop(max(0.0, deadline - time.monotonic()))
            handle.state = "stopped" if handle.state != "failed" else "failed"
        for handle in self._instances:
            handle.inbox.cancel_join_thread()  # never block our exit on undelivered messages
            handle.inbox.close()
            handle.close_link()
        if self.weight_sync is not None:
            self.weight_sync.close()
        self._write_status()
        self._running, self.weight_sync = False, None  # instances() still tells their fate
        self._received.clear()
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
            requests: one per sample; their keys must be unique among requests not returned.
            scores: optional predicted lengths, passed to the dispatcher.
        """
        self._require_started()
        keys = {r.key for r in requests}
        if len(keys) != len(requests) or keys & self._outstanding:
            raise ValueError("submit: duplicate (prompt_id, sample_index) among open requests.")
        self._outstanding |= keys
        self.counts["requests_submitted"] += len(requests)
        self._dispatch(list(requests), scores)

    def next_sample(self) -> Sample:
        """The next finished sample from any instance, in completion order.

        Raises:
            GeneratorError: instances failed more often than ``max_restarts`` allows, or no
                sample arrived within ``sample_timeout_s``.
        """
        self._require_started()
        if not self._outstanding:
            raise RuntimeError("next_sample: no request is open; submit() some first.")
        while not self._backlog:
            kind, payload = self._next_message(time.monotonic() + self.sample_timeout_s)
            if kind == "sample":
                self._backlog.append(payload)
        sample = self._backlog.popleft()
        self._outstanding.discard(sample.key)
        self.counts["samples_returned"] += 1
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
        """Block until every active instance has loaded ``version``; returns seconds blocked."""
        started = time.perf_counter()
        self.weight_sync.wait_sent(version)
        self._wait_for(
            lambda: all(h.version >= version for h in self._active()),
            f"did not load weights {version}",
            self.sample_timeout_s,
        )
        self.weight_version = max(self.weight_version, version)
        return time.perf_counter() - started

    # -- inspection --------------------------------------------------------------------------
    def instances(self) -> list[InstanceInfo]:
        """Pid, liveness, weight version and state of every instance (for operators, tests)."""
        return [h.info() for h in self._instances]

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
