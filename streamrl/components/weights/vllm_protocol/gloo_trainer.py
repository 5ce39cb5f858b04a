"""The trainer's side of ``streamrl_gloo`` (registered in vLLM's ``WeightTransferTrainerFactory``)
and the ``WeightSource`` s it sends from: the trainer's parameters in the wire dtype, or a version
staged in host memory (StreamRL §4.1, §6)."""

from __future__ import annotations

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
)

from streamrl.components.weights.checksums import tensor_digest
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES, plan_buckets
from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S, WeightGroup, make_store
from streamrl.components.weights.vllm_protocol.gloo_worker import (
    GLOO_BACKEND,
    GlooInitInfo,
    GlooUpdateInfo,
)

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "StagedSource",
    "WireSource",
]


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
    attempt: int = 0
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
        store = init_info.store or make_store(
            init_info.world_size, init_info.timeout_s, host=init_info.master_address
        )
        worker = GlooInitInfo(
            init_info.master_address,
            store.port,
            rank_offset=1,
            world_size=init_info.world_size,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
            generation=init_info.generation,
            attempt=init_info.attempt,
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
                attempt=init_info.attempt,
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
        home = {s.index: (b, s) for b, bucket in enumerate(buckets) for s in bucket.slots}
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
            b, slot = home[index]
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
