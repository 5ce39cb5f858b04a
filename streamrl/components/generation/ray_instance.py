"""Generator instances as Ray actors: the stream generation service past one machine (StreamRL §3,
§6: generation on its own resources, elastic instances; the field hosts such services on Ray).

Each instance is one Ray actor in a placement group of its own (one bundle: a CPU, plus GPUs when
asked), running the same loop as a local instance (``worker.worker_main``). What the
service sees is the same as for a local process (``InstanceHandle``):

- requests and results travel over one authenticated TCP connection per actor
  (``multiprocessing.connection``), so the service waits on local pipes and Ray actors alike;
- weights travel over a torch.distributed group of two, the trainer and the actor, whose
  rendezvous store the trainer hosts (``WeightGroup``): the actors are members of the group;
- liveness is the actor's: its ``serve`` call ending (death, ``ray.kill``) is a death.

The connection is opened in the background, so ``add_instance`` returns at once while Ray
schedules and starts the actor; an actor that cannot be placed or started within the start
timeout counts as failed (the service replaces it, or stops naming it).
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from streamrl.components.generation.instance import InstanceHandle, instance_spec
from streamrl.components.generation.messages import InstanceMessage, Ready
from streamrl.components.generation.worker import WorkerSpec
from streamrl.components.weights.transport import make_store
from streamrl.errors import ConfigError

#: Install hint shown when the ``[ray]`` extra is missing.
RAY_INSTALL = "pip install 'streamrl[ray]'"


@dataclass
class RayOptions:
    """Where and how generator actors run.

    Attributes:
        address: a running cluster (``"auto"``, ``"ray://host:10001"``); ``None`` starts a local
            one unless ``RAY_ADDRESS`` names one (Ray's own rule).
        gpus_per_instance: GPUs in each actor's placement-group bundle (0: CPU only).
        cpus_per_instance: CPUs in each bundle.
        num_cpus: CPUs of a local cluster started here (``None``: all of them).
        temp_dir: Ray's session folder for a local cluster (keep it short: socket paths).
        gpu_ids: this machine's GPUs a local cluster started here gets (``num_gpus`` and
            ``CUDA_VISIBLE_DEVICES`` for ``ray.init``), so Ray never hands a trainer GPU to an
            actor; ``None``: every GPU. A cluster you join (``address`` or ``RAY_ADDRESS``)
            keeps its own GPUs: start its nodes with only the generators' GPUs
            (``CUDA_VISIBLE_DEVICES=2,3 ray start ...`` where the trainer uses 0 and 1).
    """

    address: str | None = None
    gpus_per_instance: float = 0
    cpus_per_instance: float = 1
    num_cpus: int | None = None
    temp_dir: str | None = None
    gpu_ids: tuple[int, ...] | None = None


def import_ray() -> Any:
    """``ray``, or a ``ConfigError`` with the install command."""
    try:
        import ray
    except ImportError as err:
        raise ConfigError(
            f"cluster 'ray' needs Ray, which is not installed: {RAY_INSTALL}"
        ) from err
    return ray


def connect(options: RayOptions) -> Any:
    """Join (or start) the Ray cluster once per process; check it has the GPUs asked for.

    A local cluster starts without dashboard or token authentication (one machine, loopback),
    with only ``options.gpu_ids`` when given.
    """
    ray = import_ray()
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs: dict[str, Any] = dict(
            include_dashboard=False, configure_logging=False, log_to_driver=False
        )
        local = options.address is None and "RAY_ADDRESS" not in os.environ
        gpu_ids = options.gpu_ids if local else None
        if local:
            kwargs.update(num_cpus=options.num_cpus, _temp_dir=options.temp_dir)
        if gpu_ids is not None:
            kwargs["num_gpus"] = len(gpu_ids)
        with _visible_gpus(gpu_ids):
            ray.init(address=options.address, **kwargs)
    have = ray.cluster_resources().get("GPU", 0)
    if options.gpus_per_instance > have:
        raise ConfigError(
            f"Generator instances need {options.gpus_per_instance} GPU(s) each but the Ray "
            f"cluster has {have:g}; set gpus to 0 or join a cluster with GPUs (ray start ...)."
        )
    return ray


@contextlib.contextmanager
def _visible_gpus(gpu_ids: tuple[int, ...] | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` narrowed to ``gpu_ids`` (torch's indices, so read through a
    variable already set) while Ray starts its node, which keeps it; restored afterwards."""
    if gpu_ids is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(max(gpu_ids, default=0) + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in gpu_ids)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class GeneratorActor:
    """The body of one Ray actor: opens a listening socket, then serves one generator instance.

    Used as ``ray.remote(GeneratorActor)``; Ray calls its methods one at a time, in order.
    """

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def open_channel(self, authkey: bytes) -> tuple[str, int]:
        """Listen on this node's address; returns it for the service to connect to."""
        import ray

        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self._listener.address

    def serve(self, spec: WorkerSpec) -> None:
        """Accept the service's connection, then run the generator loop until told to stop.

        The accept has no timeout of its own: a service that gives up on this actor kills it.
        """
        import ray

        from streamrl.components.generation.worker import worker_main

        if self._listener is None:
            raise RuntimeError("GeneratorActor.serve: call open_channel() first.")
        conn = self._listener.accept()
        self._listener.close()
        worker_main(spec, _ConnectionInbox(conn), conn, leave=ray.actor.exit_actor)


class _ConnectionInbox:
    """The worker's inbox over a connection (``get``/``get_nowait`` as on a queue)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, timeout: float | None = None) -> tuple:
        if not self.conn.poll(timeout):
            raise queue.Empty
        return self.conn.recv()  # EOFError once the service is gone: the worker leaves

    def get_nowait(self) -> tuple:
        return self.get(0)


class _Outbox:
    """The service's side of the inbox: ``put`` as on a queue, from any thread (the weight
    sync announces versions from its own), buffered until the actor has connected."""

    def __init__(self) -> None:
        self.conn: Connection | None = None
        self._pending: list[tuple] = []
        self._lock = threading.Lock()

    def put(self, message: tuple) -> None:
        with self._lock:
            if self.conn is None:
                self._pending.append(message)
                return
            with contextlib.suppress(OSError):  # the actor is gone: its failure is seen elsewhere
                self.conn.send(message)

    def connected(self, conn: Connection) -> None:
        with self._lock:
            self.conn = conn
            for message in self._pending:
                conn.send(message)
            self._pending.clear()

    def cancel_join_thread(self) -> None:
        """Nothing to join: sends are synchronous (queue API parity)."""

    def close(self) -> None:
        with self._lock:
            self._pending.clear()


class _ActorProcess:
    """Process-like view of an actor for the service: ``pid``, ``is_alive()``, ``exitcode``,
    ``join``/``terminate``/``kill``."""

    def __init__(self, ray: Any, actor: Any, serving: Any, placement: Any) -> None:
        self.ray, self.actor, self.serving, self.placement = ray, actor, serving, placement
        self.pid: int | None = None  # from its "ready" message
        self.start_error: str | None = None
        self._ended = False

    def is_alive(self) -> bool:
        if self.start_error is not None or self._ended:
            return False
        done, _ = self.ray.wait([self.serving], timeout=0)
        self._ended = bool(done)
        return not self._ended

    @property
    def exitcode(self) -> str | None:
        if self.start_error is not None:
            return f"none (never started: {self.start_error})"
        return None if self.is_alive() else "none (the Ray actor ended)"

    def join(self, timeout_s: float | None = None) -> None:
        if self.start_error is None and not self._ended:
            done, _ = self.ray.wait([self.serving], timeout=timeout_s)
            self._ended = bool(done)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor, no_restart=True)
        self._ended = True
        with contextlib.suppress(Exception):
            self.ray.util.remove_placement_group(self.placement)


class RayInstanceHandle(InstanceHandle):
    """An ``InstanceHandle`` whose process is a Ray actor (see the module docstring)."""

    @classmethod
    def spawn_actor(
        cls, options: RayOptions, instance_id: int, spec_fields: dict[str, Any], timeout_s: float
    ) -> RayInstanceHandle:
        """Place and start the actor, and connect to it in the background; returns at once."""
        ray = connect(options)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": options.cpus_per_instance}
        if options.gpus_per_instance:
            bundle["GPU"] = options.gpus_per_instance
        placement = ray.util.placement_group([bundle])
        actor_class = ray.remote(GeneratorActor).options(
            num_cpus=options.cpus_per_instance,
            num_gpus=options.gpus_per_instance,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement),
        )
        actor = actor_class.remote()
        here = ray.util.get_node_ip_address()  # where the actor, maybe on another node, reaches it
        store = make_store(2, timeout_s, host=here)
        spec = instance_spec(instance_id, store.port, timeout_s, spec_fields, store_host=here)
        authkey = secrets.token_bytes(32)
        address = actor.open_channel.remote(authkey)
        serving = actor.serve.remote(spec)
        handle = cls(
            instance_id, _ActorProcess(ray, actor, serving, placement), _Outbox(), None, store
        )
        threading.Thread(
            target=handle._connect,
            args=(address, authkey, timeout_s),
            daemon=True,
            name=f"ray-connect-{instance_id}",
        ).start()
        return handle

    def _connect(self, address_ref: Any, authkey: bytes, timeout_s: float) -> None:
        proc: _ActorProcess = self.proc
        started = time.monotonic()
        try:
            address = proc.ray.get(address_ref, timeout=timeout_s)
            conn = Client(tuple(address), authkey=authkey)
        except Exception as err:  # not placed, not started, or unreachable in time
            proc.start_error = f"{type(err).__name__}: {err}"[:500]
            return
        if self.state in ("failed", "stopped"):  # given up on meanwhile
            conn.close()
            return
        self.inbox.connected(conn)
        self.link = conn
        self.last_seen = max(self.last_seen, started)

    def read(self) -> InstanceMessage | None:
        message = super().read()
        if isinstance(message, Ready):
            self.proc.pid = message.pid
        return message

    def stop(self, timeout_s: float) -> None:
        """Wait for it to leave after ``("stop",)``, then kill the actor and free its placement."""
        self.proc.join(timeout_s)
        self.proc.kill()
