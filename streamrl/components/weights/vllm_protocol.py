"""vLLM's weight-transfer protocol, with a gloo backend of ours: the one module that knows vLLM's
version.

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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from streamrl.components.weights.checksums import tensor_digest
from streamrl.components.weights.instances_client import InstancesClient
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES, TensorSpec, plan_buckets
from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S, WeightGroup, make_store

#: Our CPU backend's name in vLLM's factories.
GLOO_BACKEND = "streamrl_gloo"


# ------------------------------------------------------------------------ the worker's side
@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What an instance's workers need to join the group (from the trainer, at init)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    generation: int = 1  # the feed on the trainer's store this group belongs to (``feeding``)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One version's tensors, in broadcast order (the trainer's names, the wire dtype)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    digests: bool = False  # the workers digest what they load (``verify_digests``)

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(n, tuple(s), getattr(torch, d))
            for n, d, s in zip(self.names, self.dtype_names, self.shapes)
        ]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side of ``streamrl_gloo``: receives each bucket of a version over a gloo group
    and loads it through vLLM's layerwise reload, as vLLM's NCCL engine does.

    Attributes:
        loaded_digests: ``tensor_digest`` of every tensor loaded in the last update that asked
            for digests, by the trainer's name.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: WeightGroup | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.loaded_digests: dict[str, str] = {}

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = WeightGroup(
            init_info.master_port,
            rank,
            init_info.world_size,
            timeout_s=init_info.timeout_s,
            host=init_info.master_address,
            device="cpu",
            generation=init_info.generation,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises without one.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("streamrl_gloo: update_weights before init_weight_transfer_engine.")
        specs = update_info.specs()
        self.loaded_digests = {}
        for bucket in plan_buckets(specs, self.bucket_bytes):
            # A fresh buffer per bucket: the layerwise reload keeps the views of a layer's
            # tensors until the layer is complete.
            flat = torch.empty(bucket.numel, dtype=bucket.dtype)
            self.group.broadcast([flat])
            named = [
                (specs[s.index].name, flat[s.offset : s.offset + s.numel].view(s.shape))
                for s in bucket.slots
            ]
            if update_info.digests:
                self.loaded_digests.update((n, tensor_digest(t)) for n, t in named)
            self.model.load_weights(named)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_lm_heads(self.model)

    def shutdown(self) -> None:
        self.group = None


def applied_digests(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``tensor_digest`` of the weights a vLLM model holds now, under the trainer's names and
    in the wire ``dtype`` (the engine's: vLLM's CPU build keeps biases in float32, an exact
    upcast): a fused projection (``qkv_proj``, ``gate_up_proj``) split back into its parts by
    its ``output_sizes``, through the model's ``packed_modules_mapping``. Parameters a kernel
    repacked away (a linear layer's weight on the CPU build) and tensor-parallel shards have
    no digest here; the others show whether an update was applied, not just received."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    digests: dict[str, str] = {}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            continue
        owner, _, leaf = name.rpartition(".")
        module, _, fused = owner.rpartition(".")
        layer = modules.get(owner)
        if getattr(layer, "tp_size", 1) != 1:
            continue
        parts = packed.get(fused)
        sizes = getattr(layer, "output_sizes", None)
        vocab = getattr(layer, "org_vocab_size", None)  # an embedding padded past the vocab
        if parts and sizes and len(parts) == len(sizes) and sum(sizes) == param.shape[0]:
            for part, piece in zip(parts, torch.split(param.detach().to(dtype), list(sizes))):
                digests[f"{module}.{part}.{leaf}"] = tensor_digest(piece)
        else:
            held = param.detach().to(dtype)
            digests[name] = tensor_digest(held[:vocab] if vocab is not None else held)
    return digests


def reprocess_lm_heads(model: torch.nn.Module) -> None:
    """Re-run the LM heads' post-load processing: a tied head gets no tensor of its own, so
    vLLM 0.32 would keep its CPU-packed copy of the old embedding (stale logits)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


# ----------------------------------------------------------------------- the trainer's side
@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side of ``streamrl_gloo``: rank 0 hosts the group's store on ``master_address``
    (loopback unless the instances are on other hosts) and a free port."""

    backend: ClassVar[str] = GLOO_BACKEND

    world_size: int
    master_address: str = "127.0.0.1"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: A store the trainer already hosts for these instances (else a new one on a free port),
    #: the feed ``generation`` on it, and ``abandon()``: why to stop waiting for them, or None.
    store: Any = field(default=None, repr=False, compare=False)
    generation: int = 1
    abandon: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Sends each version bucket by bucket from trainer rank 0; the other ranks iterate the
    source with it (FSDP's gathers in lockstep) and send nothing.

    Attributes:
        sent_digests: the trainer's ``tensor_digest`` of each tensor of the last version sent
            with ``digests=True`` (rank 0).
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, client: Any, source: WeightSource, info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.source: WeightSource = source
        self.info = info
        self.group: WeightGroup | None = None
        self.sent_digests: dict[str, str] = {}

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("streamrl_gloo: the trainer's engine needs a WeightSource.")
        engine = cls(client, source, init_info)
        if not engine.is_sender:
            return engine
        store = init_info.store or make_store(init_info.world_size, init_info.timeout_s)
        worker = GlooInitInfo(
            init_info.master_address,
            store.port,
            rank_offset=1,
            world_size=init_info.world_size,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
            generation=init_info.generation,
        )
        # The instances wait in their rendezvous inside the call: run it beside ours.
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group = WeightGroup(
                store.port,
                0,
                init_info.world_size,
                store=store,
                timeout_s=init_info.timeout_s,
                generation=init_info.generation,
                abandon=init_info.abandon,
            )
            joined.result(timeout=init_info.timeout_s)
        return engine

    def send_weights(self, weight_version: str | None = None, digests: bool = False) -> None:
        """One version to every instance: start, update (beside the broadcast), finish with
        ``weight_version`` (vLLM tags each token's output with it). Called on every rank."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # the gathers are collectives of all ranks
                pass
            return
        info = GlooUpdateInfo(
            [m.name for m in meta],
            [str(m.dtype).removeprefix("torch.") for m in meta],
            [list(m.shape) for m in meta],
            digests=digests,
        )
        self.client.start_weight_update()
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(self.client.update_weights, asdict(info))
            self._broadcast(info, digests)
            received.result(timeout=self.info.timeout_s)
        self.client.finish_weight_update(weight_version=weight_version)

    def _broadcast(self, info: GlooUpdateInfo, digests: bool) -> None:
        assert self.group is not None
        specs = info.specs()
        buckets = plan_buckets(specs, self.info.bucket_bytes)
        staged = getattr(self.source, "staged", None)
        if staged is not None and staged.buckets == buckets and not digests:
            self.group.broadcast(staged.buffers)  # already laid out as the instances expect
            return
        home = {s.index: b for b, bucket in enumerate(buckets) for s in bucket.slots}
        flats: dict[int, torch.Tensor] = {}
        filled = [0] * len(buckets)
        following = 0  # the next bucket to broadcast: in plan order, once full
        self.sent_digests = {}
        for index, (name, tensor) in enumerate(self.source):
            spec = specs[index]
            if name != spec.name or tuple(tensor.shape) != spec.shape:
                raise ValueError(
                    f"streamrl_gloo: the source gave {name!r} {tuple(tensor.shape)} where its "
                    f"metadata() said {spec.name!r} {spec.shape}; both must list the same "
                    "tensors in the same order."
                )
            b = home[index]
            slot = next(s for s in buckets[b].slots if s.index == index)
            flat = flats.setdefault(b, torch.empty(buckets[b].numel, dtype=buckets[b].dtype))
            view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            view.copy_(tensor.detach())
            if digests:
                self.sent_digests[name] = tensor_digest(view)
            filled[b] += 1
            while following < len(buckets) and filled[following] == len(buckets[following].slots):
                self.group.broadcast([flats.pop(following)])
                following += 1
        if following != len(buckets):
            raise ValueError("streamrl_gloo: the source ended before its metadata() did.")

    def shutdown(self) -> None:
        self.group = None


# --------------------------------------------------------------------------- the sources
class StagedSource(WeightSource):
    """A version staged in host memory (``StagedWeights``, the wire dtype) as vLLM's
    ``WeightSource``; the gloo engine sends its buckets as they are."""

    def __init__(self, staged: Any) -> None:
        self.staged = staged

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(s.name, s.dtype, tuple(s.shape)) for s in self.staged.specs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.staged.named()


class WireSource(WeightSource):
    """The trainer's parameters as vLLM's ``WeightSource``: each in the wire dtype (the
    engines'), an FSDP2 shard gathered whole (cast first: half the bytes in bf16), one at a
    time, on every rank in the same order.

    Args:
        named: a callable giving ``(name, tensor)`` pairs afresh for each pass (e.g.
            ``model.named_parameters``).
        dtype: the wire dtype; ``None``: each tensor's own.
    """

    def __init__(
        self,
        named: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        dtype: torch.dtype | None = None,
    ) -> None:
        self.named, self.dtype = named, dtype

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self.dtype or t.dtype, tuple(t.shape)) for n, t in self.named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.named():
            with torch.no_grad():
                cast = tensor.detach().to(self.dtype) if self.dtype is not None else tensor
                whole = getattr(cast, "full_tensor", None)
                yield name, whole() if callable(whole) else cast


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


__all__ = [
    "GLOO_BACKEND",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "StagedSource",
    "WireSource",
    "applied_digests",
    "engine_backend",
    "register_backends",
    "reprocess_lm_heads",
    "trainer_engine",
]
