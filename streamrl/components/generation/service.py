"""The stream generation service (SGS): a pool of generator instances in their own processes.

StreamRL §3: generation runs apart from training, on its own resources, and every finished sample
is pushed to the trainer the moment it completes. The service has the paper's two calls:
``generate(requests)`` yields samples in completion order, and ``update(weights, version)``
pushes new weights to every instance. A dispatcher decides which instance gets which prompt.

What runs in an instance is given as objects: an ``engine`` (``HFEngine``, ``VLLMEngine`` or
yours, a ``GenerationEngine``) builds its generator, a ``scheduler`` factory (``FIFOScheduler``,
``LPTScheduler`` or yours) makes its admission queue; both are pickled to every instance.

The pool (``InstancePool``, held as ``pool``) changes while it runs:

- ``add_instance`` grows it (elastic generation, §6): the new instance loads the model, receives
  the current weights, and only then takes requests;
- an instance that dies, or stays silent past ``timeouts.heartbeat_s`` (then it is killed), is
  replaced the same way, and the requests it held go to the others: nothing is lost and nothing
  is returned twice (a late sample of a failed instance is discarded).

Examples:
    >>> with StreamGenerationService("path/to/model", num_instances=2) as sgs:  # doctest: +SKIP
    ...     for sample in sgs.generate(requests):
    ...         print(sample.prompt_id, sample.length)
    ...     sgs.update(policy, version=1)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from streamrl.components.generation.clusters import make_cluster
from streamrl.components.generation.engines import HFEngine, check_factories
from streamrl.components.generation.instance import InstanceHandle, InstanceInfo
from streamrl.components.generation.messages import AskFingerprint, Fingerprinted
from streamrl.components.generation.partial import PartialRollout, check_partial_rollout
from streamrl.components.generation.pool import GeneratorError, InstancePool
from streamrl.components.generation.protocol_feed import check_weight_protocol
from streamrl.components.generation.ray_instance import RayOptions
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.skewness.dispatch import RoundRobinDispatcher
from streamrl.components.skewness.instance_profile import LatencyProfile, mean_curve
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import FIFOScheduler
from streamrl.components.weights.path import WeightPath
from streamrl.components.weights.sync import AsyncWeightSync, Weights
from streamrl.errors import ConfigError
from streamrl.protocols import (
    AdmissionScheduler,
    Cluster,
    Dispatcher,
    GenerationEngine,
    GroupStart,
)
from streamrl.records import Request, Sample

__all__ = ["GeneratorError", "StreamGenerationService"]


class StreamGenerationService:
    """N generator instances, each a spawned process running continuous batching (§3, §5).

    Samples come back over one pipe per instance (bounded by the pipe's buffer: instances pause
    when the trainer falls behind, memory stays bounded); weights go out, bucket by bucket, to
    one instance per site, which passes them on along a chain of the others (``fanout``).

    Args:
        model_dir: the policy's model directory; every instance loads it at start.
        num_instances: generator processes.
        engine: builds every instance's generator, inside the instance (``HFEngine()`` if
            ``None``; ``HFEngine(lora=spec)`` for a LoRA policy, whose updates then carry only
            the adapters; ``VLLMEngine(options={...})``; or your ``GenerationEngine``). Its
            ``check`` runs here, before any process starts.
        scheduler: makes each instance's admission queue, in the instance: ``FIFOScheduler``,
            ``LPTScheduler`` (longest ``predicted_length`` first, §5.3) or your factory of
            ``AdmissionScheduler`` s (a class, or a picklable function).
        max_batch_size: batch slots per instance.
        temperature: sampling temperature (a trainer scores the tokens under it too). 0.7 and
            64 slots are what the demo's figures were measured with; on the demo task 1.0 and
            32 slots learn as much (docs/demo.md).
        greedy: decode greedily instead of sampling.
        seed: base sampling seed (instance ``i`` uses ``seed + i``, reseeded for every weight
            version it loads, so a resumed run samples as the uninterrupted one).
        dispatcher: which instance gets which request; round-robin by prompt if ``None``.
        timeouts: how long the service waits for its instances: to start and load the model
            (``start_s``), for the next sample (``sample_s``), silent before taken as hung,
            killed and replaced (``heartbeat_s``), for one weight transfer before the instance
            is replaced and its requests requeued (``weight_s``); ``None``: ``Timeouts()``, or
            ``Timeouts.for_model(...)`` scaled to a policy (``streamrl.components.generation.
            timeouts``).
        max_restarts: failed instances replaced over the service's life; one more failure
            raises ``GeneratorError`` (0: every failure raises).
        status_path: a JSON file rewritten on every change of the pool (instance id -> pid,
            state, weight version), for operators.
        cluster: where instances run: a ``Cluster`` (``LocalCluster()``: processes of this
            machine; ``RayCluster(RayOptions(...))``: Ray actors, the ``[ray]`` extra; yours),
            or ``"local"`` / ``"ray"`` (``clusters.make_cluster``).
        gpus_per_instance: GPUs each instance runs on (0: the CPU).
        gpu_ids: the GPUs local instances take, round-robin (``Placement.generator_gpus`` of
            ``streamrl.runtime.devices.resolve_placement``, which leaves out the trainer's);
            ``None``: every GPU of this machine. With ``cluster="ray"`` a local Ray cluster started
            here is given only these GPUs (``RayOptions.gpu_ids``).
        ray: Ray cluster options (address, local cluster size, temp dir) for ``cluster="ray"``
            (the same as ``cluster=RayCluster(ray)``).
        weights: how each weight version travels to the instances: the transport, buckets,
            fan-out, vLLM's protocol and which versions are verified (a mismatch raises
            ``GeneratorError`` naming the instance and the tensor); ``None``: ``WeightPath()``
            (``streamrl.components.weights.path``).
        profile_latency: each instance measures its ``PTL(BS)`` before it says ready
            (``instance_profile``); ``measured_latency`` averages them.
        sites: the site of each instance, in order (``num_instances`` names); instances at a
            site other than ``trainer_site`` get the weights from their site's first instance
            (its *head*), so one copy per version crosses to each remote site (§6,
            ``weight_relay``). ``None`` (or empty): every instance beside the trainer.
        trainer_site: the trainer's site.
        stop_token_ids: token ids a sample also stops on besides the model's EOS (a chat
            template's end of turn: ``streamrl.policy.chat.stop_token_ids``).
        stop_strings: a sample stops once its decoded text contains one of these.
        partial_rollout: what an instance does with running sequences when new weights
            arrive: ``"finish"`` (finish them under the old weights first: each sample from one
            version), ``"keep"`` (go on under the new weights with the old cache) or
            ``"recompute"`` (their cache computed again under the new weights); see
            ``streamrl.components.generation.partial``.
        trainer_device: the device the trainer's weights leave from: its NCCL link to the
            instances lives there (``Placement``'s first trainer GPU, ``cuda:k``); ``"cuda"``:
            the current one.

    Raises:
        ConfigError: the engine's ``check`` failed, the cluster or transport is unknown or
            not installed, ``gpu_ids`` is empty while instances need GPUs, ``temperature``
            is not above 0, or ``partial_rollout`` is unknown.
        ValueError: a count out of range, or ``sites`` not one per instance.
        TypeError: ``engine`` or ``scheduler`` is not what it must be (an engine object; a
            factory, not a queue), or cannot be pickled to the instances.
    """

    def __init__(
        self,
        model_dir: str | Path,
        num_instances: int = 2,
        *,
        engine: GenerationEngine | None = None,
        scheduler: Callable[[], AdmissionScheduler] = FIFOScheduler,
        max_batch_size: int = 64,
        temperature: float = 0.7,
        greedy: bool = False,
        seed: int = 0,
        dispatcher: Dispatcher | None = None,
        timeouts: Timeouts | None = None,
        max_restarts: int = 3,
        status_path: str | Path | None = None,
        cluster: str | Cluster = "local",
        gpus_per_instance: int = 0,
        gpu_ids: Sequence[int] | None = None,
        ray: RayOptions | None = None,
        weights: WeightPath | None = None,
        profile_latency: LatencyProfile | None = None,
        sites: Sequence[str] | None = None,
        trainer_site: str = "local",
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        partial_rollout: PartialRollout = "finish",
        trainer_device: str = "cuda",
    ) -> None:
        if num_instances < 1 or max_batch_size < 1:
            raise ValueError(
                f"num_instances and max_batch_size must be >= 1, got {num_instances} and "
                f"{max_batch_size}."
            )
        if max_restarts < 0 or gpus_per_instance < 0:
            raise ValueError(
                "max_restarts and gpus_per_instance must be >= 0 (gpus_per_instance 0: the "
                f"CPU), got {max_restarts} and {gpus_per_instance}."
            )
        if sites and len(sites) != num_instances:
            raise ValueError(f"sites: one site per instance ({num_instances}), got {list(sites)}.")
        engine = engine if engine is not None else HFEngine()
        check_factories(engine, scheduler)
        cluster = make_cluster(cluster, ray, where="cluster")
        cluster.check(gpus_per_instance)
        weights = weights or WeightPath()
        weight_transport = weights.make_transport()
        engine.check(cluster=cluster, gpus_per_instance=gpus_per_instance)
        if gpu_ids is not None and not gpu_ids and gpus_per_instance > 0:
            raise ConfigError(
                "gpu_ids is empty but gpus_per_instance > 0: name the GPUs the instances take, "
                "or pass None for every GPU of this machine."
            )
        if not greedy and not temperature > 0:
            raise ConfigError(
                f"temperature must be > 0, got {temperature}; pass greedy=True to take the "
                "most likely token instead of sampling."
            )
        weight_transport.check()  # NCCL: CuPy and a GPU, or a ConfigError saying how to get them
        if weights.protocol:
            check_weight_protocol(engine, partial_rollout)
        self.weights, self.timeouts = weights, timeouts or Timeouts()
        self.engine, self.scheduler = engine, scheduler
        self.model_dir = str(model_dir)
        self.num_instances = num_instances
        self.max_batch_size, self.temperature, self.greedy = max_batch_size, temperature, greedy
        self.seed = seed
        self.stop_token_ids, self.stop_strings = tuple(stop_token_ids), tuple(stop_strings)
        self.partial_rollout = check_partial_rollout(partial_rollout)
        self.cluster, self.gpus_per_instance = cluster, gpus_per_instance
        self.gpu_ids = tuple(gpu_ids) if gpu_ids is not None else None
        self.weight_transport, self.profile_latency = weight_transport, profile_latency
        self.trainer_site = trainer_site
        self._sites = list(sites) if sites else [trainer_site] * num_instances
        dispatcher = dispatcher if dispatcher is not None else RoundRobinDispatcher()
        limits = dispatcher.batch_limits(num_instances) or []
        if any(limit > max_batch_size for limit in limits):  # given twice: they must agree
            raise ValueError(
                f"The dispatcher sizes batches up to {max(limits)} sequences but the instances "
                f"have max_batch_size={max_batch_size}; give both the same max_batch_size."
            )
        #: The instances: their processes, weight groups and messages.
        self.pool = InstancePool(
            self._launch,
            dispatcher=dispatcher,
            trainer_site=trainer_site,
            weights=weights,
            weight_transport=weight_transport,
            timeouts=self.timeouts,
            max_restarts=max_restarts,
            status_path=status_path,
            max_batch_size=max_batch_size,
            trainer_device=trainer_device,
            protocol_ranks=engine.ranks(gpus_per_instance) if weights.protocol else 1,
        )
        self._outstanding: set[tuple] = set()  # keys submitted and not yet returned
        self._evaluating: set[tuple] = set()  # of those, an evaluation's (``submit``)
        self.weight_version = 0  # loaded by every active instance

    # -- what the pool holds -----------------------------------------------------------------
    @property
    def dispatcher(self) -> Dispatcher:
        """Which active instance gets which request (may be swapped between submits)."""
        return self.pool.dispatcher

    @dispatcher.setter
    def dispatcher(self, dispatcher: Dispatcher) -> None:
        self.pool.dispatcher = dispatcher

    @property
    def weight_sync(self) -> AsyncWeightSync | None:
        """The background weight pushes (``bytes_sent``, ``transfer_s``); ``None`` unless
        running."""
        return self.pool.weight_sync

    @property
    def counts(self) -> Counter[str]:
        """Ledger of the service: requests submitted and requeued, samples returned and
        discarded (late copies from failed instances), instances restarted."""
        return self.pool.counts

    @property
    def open_requests(self) -> int:
        """Requests submitted whose sample has not been taken yet."""
        return len(self._outstanding)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> StreamGenerationService:
        """Spawn the instances and wait until each has loaded the model and joined its group."""
        if not self.pool.running:
            self.pool.start(self._sites)
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
        self.pool.require_running()
        handle = self.pool.spawn(site if site is not None else self.trainer_site)
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
        self.pool.require_running()
        return self.pool.retire(instance_id)

    def wait_active(self, timeout_s: float | None = None) -> None:
        """Block until no instance is still starting or joining (samples finished meanwhile are
        kept).

        Raises:
            GeneratorError: one did not load the model or receive weights within ``timeout_s``
                (default: twice the start timeout).
        """
        self.pool.require_running()
        self.pool.wait_active(2 * self.timeouts.start_s if timeout_s is None else timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every instance: ask politely, then terminate, then kill. Safe to call twice."""
        self.pool.close(timeout_s)
        self._outstanding.clear()

    def __enter__(self) -> StreamGenerationService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- as RolloutStream's sampler (streamrl.protocols.Sampler) ----------------------------
    #: One completion per sample: the stream's reward scores it.
    scores_samples = False

    def start_group(self, group: GroupStart) -> list[Request]:
        """The group's requests: ``group.size`` completions of the row's rendered prompt.

        Raises:
            ValueError: the prompt leaves no room in the context.
        """
        pid, ids = group.row["prompt_id"], group.prompt_ids()
        budget = min(group.max_tokens, group.context - len(ids))
        if budget < 1:
            raise ValueError(
                f"Prompt {pid!r} has {len(ids)} tokens: no room left in the "
                f"context of {group.context}; shorten it."
            )
        forced = None  # one length per prompt: a group's samples finish together
        if group.forced_length is not None:
            forced = budget = min(group.forced_length, group.context - len(ids))
        return [
            Request(
                pid,
                ids,
                budget,
                index,
                forced_length=forced,
                iteration=group.iteration,
                min_weight_version=group.min_weight_version,
            )
            for index in range(group.size)
        ]

    def left_out(self, sample: Sample) -> bool:
        """A completion is never left out of the loss."""
        return False

    # -- the two calls -----------------------------------------------------------------------
    def submit(
        self,
        requests: Sequence[Request],
        scores: Sequence[float] | None = None,
        *,
        evaluation: bool = False,
    ) -> None:
        """Dispatch ``requests`` to the instances and return at once (see ``next_sample``).

        Args:
            requests: one per sample; their keys must be unique among requests not returned.
            scores: optional predicted lengths, passed to the dispatcher.
            evaluation: the requests of a held-out evaluation run beside training
                (``streamrl.eval.on_generators``): dealt to the least busy instances without
                the dispatcher, counted apart from the run's samples, and returned only to
                ``next_sample(keys=...)`` / ``poll_sample(keys=...)`` (a training sample
                arriving meanwhile waits for the stream, and theirs never reach it).
        """
        self.pool.require_running()
        keys = {r.key for r in requests}
        if len(keys) != len(requests) or keys & self._outstanding:
            raise ValueError("submit: duplicate (prompt_id, sample_index) among open requests.")
        self._outstanding |= keys
        if evaluation:
            self._evaluating |= keys
            self.counts["evaluation_requests"] += len(requests)
        else:
            self.counts["requests_submitted"] += len(requests)
        self.pool.dispatch(list(requests), scores, plan=not evaluation)

    def next_sample(self, keys: set[tuple] | None = None) -> Sample:
        """The next finished sample from any instance, in completion order.

        Args:
            keys: the next one of these (an evaluation's requests); ``None``: of the run's.

        Raises:
            GeneratorError: instances failed more often than ``max_restarts`` allows, or no
                sample arrived within ``timeouts.sample_s``.
        """
        self.pool.require_running()
        if not self._open(keys):
            raise RuntimeError("next_sample: no request is open; submit() some first.")
        while (sample := self._take(keys)) is None:
            self.pool.next_message(time.monotonic() + self.timeouts.sample_s)
        return sample

    def poll_sample(self, timeout_s: float, keys: set[tuple] | None = None) -> Sample | None:
        """The next finished sample if one comes within ``timeout_s``, else ``None`` (for a
        caller with other work meanwhile: an episode runner waits on its environments too);
        ``keys`` as for ``next_sample``.

        Raises:
            GeneratorError: instances failed more often than ``max_restarts`` allows.
        """
        self.pool.require_running()
        deadline = time.monotonic() + timeout_s
        while (sample := self._take(keys)) is None and self._open(keys):
            if self.pool.next_message(deadline, quiet=True) is None and (
                time.monotonic() >= deadline
            ):
                return None
        return sample

    def _open(self, keys: set[tuple] | None) -> bool:
        """Whether a request is open among ``keys`` (``None``: among the run's)."""
        if keys is None:
            return bool(self._outstanding - self._evaluating)
        return bool(keys & self._outstanding)

    def _take(self, keys: set[tuple] | None) -> Sample | None:
        """The first read sample among ``keys`` (``None``: of the run's), out of the backlog."""
        backlog = self.pool.backlog
        for i, sample in enumerate(backlog):
            if (sample.key in keys) if keys is not None else (sample.key not in self._evaluating):
                del backlog[i]
                break
        else:
            return None
        self._outstanding.discard(sample.key)
        if sample.key in self._evaluating:
            self._evaluating.discard(sample.key)
            self.counts["evaluation_samples"] += 1
        else:
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
                same order as the policy's parameters (a LoRA policy: its adapters).
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
        self.pool.require_running()
        return self.pool.push_weights(weights, version)

    def wait_weights(self, version: int) -> float:
        """Block until every active instance has loaded ``version``; returns seconds blocked."""
        started = time.perf_counter()
        self.pool.wait_loaded(version, self.timeouts.sample_s)
        self.weight_version = max(self.weight_version, version)
        return time.perf_counter() - started

    # -- inspection --------------------------------------------------------------------------
    def measured_latency(self) -> LatencyModel | None:
        """The mean ``PTL(BS)`` the instances measured at start (``profile_latency``; §5.1), at
        the batch sizes all of them measured; ``None`` if none did."""
        return mean_curve([h.latency for h in self.pool.handles if h.latency is not None])

    def instances(self) -> list[InstanceInfo]:
        """Pid, liveness, weight version and state of every instance (for operators, tests)."""
        return self.pool.infos()

    def fingerprints(self) -> dict[int, str]:
        """Each active instance's weight hash (compare with
        ``hf_generator.fingerprint(policy)``; an engine whose generator has a
        ``fingerprint()``)."""
        self.pool.require_running()
        active = self.pool.active()
        for handle in active:
            handle.inbox.put(AskFingerprint())
        found: dict[int, str] = {}
        while len(found) < len(active):
            message = self.pool.next_message()  # a sample meanwhile stays in the backlog
            if isinstance(message, Fingerprinted):
                found[message.instance_id] = message.digest
        return found

    # -- what runs in an instance ------------------------------------------------------------
    def _launch(self, instance_id: int, site: str) -> InstanceHandle:
        """Start instance ``instance_id`` at ``site``: a local process or a Ray actor running
        ``worker_main`` with this service's engine, scheduler factory and sampling settings."""
        what = dict(
            model_dir=self.model_dir,
            engine=self.engine,
            scheduler=self.scheduler,
            max_batch_size=self.max_batch_size,
            temperature=self.temperature,
            greedy=self.greedy,
            seed=self.seed + instance_id,
            device=self.cluster.device(
                instance_id,
                self.gpus_per_instance,
                spare_first=self.weight_transport.needs_own_gpu,
                gpu_ids=self.gpu_ids,
            ),
            transport=self.weight_transport,
            bucket_bytes=self.weights.bucket_bytes,
            profile=self.profile_latency,
            weight_timeout_s=self.timeouts.weight_s,
            stop_token_ids=self.stop_token_ids,
            stop_strings=self.stop_strings,
            partial_rollout=self.partial_rollout,
            weight_protocol=self.weights.protocol,
        )
        return self.cluster.spawn(
            instance_id,
            what,
            gpus_per_instance=self.gpus_per_instance,
            gpu_ids=self.gpu_ids,
            start_timeout_s=self.timeouts.start_s,
        )
