"""Where generator instances run: objects with the ``Cluster`` protocol (``streamrl.protocols``).

- ``LocalCluster``: one spawned process per instance on this machine, each on the GPUs it is
  given (``gpu_ids`` round-robin, or every GPU of the machine) or on the CPU;
- ``RayCluster``: one Ray actor per instance in a placement group of its own, on the cluster
  ``RayOptions.address`` (or ``RAY_ADDRESS``) names or on a local one started here (the
  ``[ray]`` extra).

``StreamGenerationService(cluster=...)`` takes one (or ``"local"`` / ``"ray"``); a config names one
in ``rl.cluster``: ``local``, ``ray``, ``{class_path: ray, init_args: {address: auto}}``
(``RayOptions`` fields), or ``package.module.Name`` for your own. A cluster is checked before
any process starts: a missing package or absent GPUs fail there with the fix, never inside an
instance.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from collections.abc import Mapping, Sequence
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from typing import Any

from streamrl.components.generation.instance import InstanceHandle
from streamrl.components.generation.ray_instance import RayInstanceHandle, RayOptions
from streamrl.components.run_context import RunContext, build_from_run
from streamrl.errors import ConfigError
from streamrl.protocols import Cluster
from streamrl.runtime.references import checked, pick

RAY_INSTALL = "pip install 'streamrl[ray]'"


class LocalCluster:
    """Instances as spawned processes of this machine."""

    def __str__(self) -> str:
        return "local"

    def check(self, gpus_per_instance: int) -> None:
        """The GPUs asked for exist on this machine."""
        _check_count(gpus_per_instance)
        if gpus_per_instance > 0:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    f"gpus={gpus_per_instance} but this machine has no CUDA GPU "
                    f"(torch {torch.__version__}, torch.cuda.is_available() is False); drop "
                    "--gpus / set rl.generation.gpus_per_instance: 0 to generate on the CPU, or "
                    "use a CUDA torch on a GPU machine."
                )

    def device(
        self,
        instance_id: int,
        gpus_per_instance: int,
        *,
        spare_first: bool = False,
        gpu_ids: Sequence[int] | None = None,
    ) -> str:
        """``gpu_ids`` (``Placement.generator_gpus``: the trainer's already left out) in sets of
        ``gpus_per_instance``, round-robin; without them every GPU of the machine, leaving
        ``cuda:0`` to the trainer when ``spare_first`` (NCCL refuses two members of a group on
        one GPU).

        Raises:
            ConfigError: ``gpu_ids`` is empty, or ``spare_first`` without ``gpu_ids`` on a
                machine with fewer than 2 GPUs.
        """
        if gpus_per_instance <= 0:
            return "cpu"
        if gpu_ids is not None:
            if not gpu_ids:
                raise ConfigError("gpu_ids is empty: name the generators' GPUs, or None for all.")
            return _gpu_set(instance_id, gpus_per_instance, gpu_ids)
        import torch

        count = max(torch.cuda.device_count(), 1)
        if not spare_first:
            return _gpu_set(instance_id, gpus_per_instance, range(count))
        if count < 2:
            raise ConfigError(
                "weight_transport 'nccl' needs the trainer and each generator on GPUs of their "
                f"own (NCCL refuses two members on one GPU); this machine has {count}. Use "
                "'gloo' or 'bucketed' here."
            )
        return _gpu_set(instance_id, gpus_per_instance, range(1, count))

    def spawn(
        self,
        instance_id: int,
        spec_fields: Mapping[str, Any],
        *,
        gpus_per_instance: int,
        gpu_ids: Sequence[int] | None,
        start_timeout_s: float,
    ) -> InstanceHandle:
        """Start instance ``instance_id`` as a spawned process."""
        ctx = mp.get_context("spawn")
        return InstanceHandle.spawn(ctx, instance_id, dict(spec_fields), start_timeout_s)


class RayCluster:
    """Instances as Ray actors (the ``[ray]`` extra).

    Args:
        options: the cluster to join or start (``address``, a local cluster's ``num_cpus`` and
            ``temp_dir``, CPUs per actor); GPUs per actor and a local cluster's GPUs come from
            the service.
        **fields: ``RayOptions`` fields over ``options`` (a config's ``{class_path: ray,
            init_args: {address: auto}}``).

    Raises:
        ConfigError: a field ``RayOptions`` does not have.
    """

    def __init__(self, options: RayOptions | None = None, **fields: Any) -> None:
        known = {f.name for f in dataclass_fields(RayOptions)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(
                f"cluster ray: no option(s) {unknown}; RayOptions has {sorted(known)}."
            )
        self.options = replace(options or RayOptions(), **fields)

    def __str__(self) -> str:
        return "ray"

    def check(self, gpus_per_instance: int) -> None:
        """Ray is installed (a Ray cluster's GPUs are checked when it is joined)."""
        _check_count(gpus_per_instance)
        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                f"cluster 'ray' needs the 'ray' package, not installed: {RAY_INSTALL}"
            )

    def device(
        self,
        instance_id: int,
        gpus_per_instance: int,
        *,
        spare_first: bool = False,
        gpu_ids: Sequence[int] | None = None,
    ) -> str:
        """``"cuda"``: an actor sees only the GPUs Ray gave it (``CUDA_VISIBLE_DEVICES``)."""
        return "cuda" if gpus_per_instance > 0 else "cpu"

    def spawn(
        self,
        instance_id: int,
        spec_fields: Mapping[str, Any],
        *,
        gpus_per_instance: int,
        gpu_ids: Sequence[int] | None,
        start_timeout_s: float,
    ) -> RayInstanceHandle:
        """Start instance ``instance_id`` as an actor with ``gpus_per_instance`` GPUs (a local
        cluster started here gets only ``gpu_ids``, if given)."""
        options = replace(self.options, gpus_per_instance=gpus_per_instance)
        if gpu_ids is not None:  # else keep the options' own (None: every GPU)
            options = replace(options, gpu_ids=tuple(gpu_ids))
        fields = dict(spec_fields)
        return RayInstanceHandle.spawn_actor(options, instance_id, fields, start_timeout_s)


#: Built-in clusters by the name a config gives (``rl.cluster``).
CLUSTERS: dict[str, type] = {"local": LocalCluster, "ray": RayCluster}


def make_cluster(
    value: str | Mapping[str, Any] | Cluster,
    ray: RayOptions | None = None,
    where: str = "rl.cluster",
) -> Cluster:
    """The cluster ``value`` names (``"local"``, ``"ray"`` with ``ray``'s options, a mapping,
    ``package.module:Name``), or ``value`` itself when it is one.

    Raises:
        ConfigError: an unknown name, or an object without the ``Cluster`` methods.
    """
    if not isinstance(value, str | Mapping):
        return checked(value, Cluster, where)
    if value == "ray" and ray is not None:
        return RayCluster(ray)
    factory, options = pick(value, kind="cluster", builtins=CLUSTERS, where=where)
    cluster = build_from_run(factory, RunContext(max_batch_size=1), options, where=where)
    return checked(cluster, Cluster, where)


def _check_count(gpus_per_instance: int) -> None:
    if gpus_per_instance < 0:
        raise ConfigError(
            f"gpus must be >= 0 (0 runs generation on the CPU), got {gpus_per_instance}."
        )


def _gpu_set(instance_id: int, size: int, gpu_ids: Sequence[int]) -> str:
    """Instance ``instance_id``'s GPUs: ``gpu_ids`` cut into sets of ``size`` (a
    tensor-parallel engine's), taken round-robin; ``"cuda:k"``, or ``"cuda:k,l"`` for a set.

    Raises:
        ConfigError: fewer GPUs than one set.
    """
    sets = len(gpu_ids) // size
    if sets == 0:
        raise ConfigError(
            f"rl.generation.gpus_per_instance={size} GPUs per generator instance, but the "
            f"generators have {len(gpu_ids)} ({list(gpu_ids)}); lower it or free GPUs from the "
            "trainer."
        )
    first = (instance_id % sets) * size
    return "cuda:" + ",".join(str(g) for g in gpu_ids[first : first + size])
