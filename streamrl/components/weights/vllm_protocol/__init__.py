"""vLLM's weight-transfer protocol, with a gloo backend of ours: the one package that knows vLLM's
version (``gloo_worker``: what runs in vLLM's workers; ``gloo_trainer``: the trainer's side and
its sources; here: registration and the trainer's engine for a run's instances).

StreamRL §4.1 / §6: after each optimizer step the new weights go to every generator instance.
vLLM (0.28 onwards; the same API in 0.32-0.34) ships the protocol for it
(``vllm.distributed.weight_transfer``): the trainer builds an engine with
``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` and calls
``send_weights()`` on every rank; the client makes four calls on every instance,
``init_weight_transfer_engine`` (once), then per version ``start_weight_update``,
``update_weights`` (which must run while the trainer broadcasts) and
``finish_weight_update(weight_version=v)``. On CUDA the backend is vLLM's own ``"nccl"``
(packed, double-buffered, GPU to GPU). vLLM has no CPU backend (its NCCL path is a silent
no-op off CUDA, vLLM PR #57022), so ``"streamrl_gloo"`` is registered here in both of vLLM's
factories: the same four calls, each bucket broadcast over a gloo group through host memory,
and CI runs exactly the protocol a GPU run makes.

Several independent instances share one broadcast: each gets its own ``rank_offset`` (1 + the
tensor-parallel ranks before it, as SkyRL's ``BroadcastInitInfo.for_servers`` and slime do;
``InstancesClient``). The group's size is fixed at init.

A silent no-op is caught by checksums (``tensor_digest``): the worker's engine digests every
tensor it loads, under the trainer's name, and ``verify_digests`` compares them with the
trainer's for the same version. On vLLM's CPU build a linear layer's weight lives only in its
kernel's packed form after loading (``layer.weight`` is emptied), so digests of the model's
parameters (vLLM's ``compute_weight_checksums``) would not see a no-op there; the digest of what
was loaded does, on every device.
"""

from __future__ import annotations

import socket
from typing import Any

from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightSource
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from streamrl.components.weights.instances_client import InstancesClient
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES
from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S
from streamrl.components.weights.vllm_protocol.gloo_trainer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    StagedSource,
    WireSource,
)
from streamrl.components.weights.vllm_protocol.gloo_worker import (
    GLOO_BACKEND,
    GlooWeightTransferEngine,
    applied_digests,
    reprocess_cpu_layouts,
)

__all__ = [
    "GLOO_BACKEND",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "StagedSource",
    "WireSource",
    "applied_digests",
    "engine_backend",
    "register_backends",
    "reprocess_cpu_layouts",
    "trainer_engine",
]


def register_backends() -> None:
    """Register ``streamrl_gloo`` in vLLM's worker and trainer factories (once per process;
    every process that builds an engine or a trainer engine calls it)."""
    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
    if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, GlooTrainerWeightTransferEngine)


def trainer_engine(
    source: WeightSource,
    client: InstancesClient,
    *,
    rank: int = 0,
    backend: str = GLOO_BACKEND,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    master_address: str = "127.0.0.1",
    **gloo: Any,
) -> Any:
    """The trainer's engine for ``client``'s instances, through vLLM's factory (call it on
    every trainer rank; rank 0 sends). ``gloo``: ``store``, ``generation``, ``abandon`` of
    ``GlooTrainerInitInfo``."""
    register_backends()
    info: TrainerInitInfo
    if backend == GLOO_BACKEND:
        info = GlooTrainerInitInfo(
            client.world_size,
            master_address=master_address,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            rank=rank,
            **gloo,
        )
    elif backend == "nccl":  # vLLM's own, on CUDA: packed, double-buffered, GPU to GPU
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            master_address,
            free_port(master_address),
            client.world_size,
            packed=True,
            packed_buffer_size_bytes=bucket_bytes,
            packed_num_buffers=2,
            rank=rank,
        )
    else:
        raise ValueError(
            f"Unknown weight-transfer backend {backend!r}: {GLOO_BACKEND!r} (any device, "
            "through host memory) or 'nccl' (vLLM's, CUDA)."
        )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (for a rendezvous the backend opens itself)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def engine_backend(device: str) -> str:
    """The backend an instance on ``device`` takes weights through: vLLM's NCCL on CUDA, ours
    elsewhere."""
    return "nccl" if str(device).startswith("cuda") else GLOO_BACKEND
