"""Bucketed weight broadcast, with NCCL through CuPy as the GPU communicator.

StreamRL §6 (weight transfer): after each optimizer step the trainer broadcasts the new weights
to the generation service. ``WeightGroup`` (``weight_transport.py``) sends one gloo broadcast
per tensor through host memory; a 72B model has ~1000 tensors, so per-call latency and host
copies add up. Here tensors are packed into flat buffers of at most ``bucket_bytes``, one dtype
per buffer, and each buffer goes out in one collective call, then is unpacked into the
destination tensors on the receivers. The communicator is injected (``Communicator``):
``NcclCommunicator`` (GPU, ``cupy.cuda.nccl``), ``GlooCommunicator`` (CPU, torch gloo), or a
fake in tests.

Examples:
    >>> specs = [TensorSpec("w", (2, 3), torch.float32), TensorSpec("b", (3,), torch.float32)]
    >>> [len(b.slots) for b in plan_buckets(specs, bucket_bytes=24)]  # 24 B + 12 B: two buckets
    [1, 1]
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from streamrl.errors import ConfigError

#: Default largest bucket: big enough that per-call latency vanishes, small enough that the
#: packing buffer is a small fraction of GPU memory.
DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver must know about one tensor to unpack it: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class Slot:
    """Where tensor ``index`` (its position in the broadcast list) lies in a bucket."""

    index: int
    offset: int  # in elements of the bucket's dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of a single dtype: its slots and total element count."""

    dtype: torch.dtype
    slots: tuple[Slot, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def plan_buckets(
    specs: Sequence[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[Bucket]:
    """Group tensors into buckets of one dtype and at most ``bucket_bytes`` each.

    Tensors are taken in order and a dtype's bucket is closed when the next tensor would not
    fit; a tensor larger than ``bucket_bytes`` gets a bucket of its own (it is never split, so
    it unpacks with one copy). Every member computes the same plan from the same specs, so no
    layout is sent.

    Args:
        specs: one per tensor, in broadcast order.
        bucket_bytes: the largest bucket, except for single oversized tensors.

    Returns:
        The buckets, in the order they are broadcast.

    Raises:
        ConfigError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}.")
    buckets: list[Bucket] = []
    open_slots: dict[torch.dtype, list[Slot]] = {}  # the filling bucket of each dtype
    used: dict[torch.dtype, int] = {}  # its elements so far
    for index, spec in enumerate(specs):
        slots = open_slots.setdefault(spec.dtype, [])
        offset = used.get(spec.dtype, 0)
        if slots and (offset + spec.numel) * _itemsize(spec.dtype) > bucket_bytes:
            buckets.append(Bucket(spec.dtype, tuple(slots), offset))
            slots.clear()
            offset = 0
        slots.append(Slot(index, offset, spec.shape))
        used[spec.dtype] = offset + spec.numel
    for dtype, slots in open_slots.items():
        if slots:
            buckets.append(Bucket(dtype, tuple(slots), used[dtype]))
    return buckets


def pack(tensors: Sequence[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """Copy the bucket's tensors into one flat, contiguous buffer (``[bucket.numel]``).

    Non-contiguous and 0-d tensors are fine: each is copied through a view of its slot.
    """
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=_device(tensors, bucket))
    for slot in bucket.slots:
        tensor = tensors[slot.index]
        _check(tensor, slot, bucket.dtype)
        flat[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(tensor.detach())
    return flat


def unpack(flat: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a received flat buffer back into the destination tensors, in place."""
    with torch.no_grad():
        for slot in bucket.slots:
            tensor = tensors[slot.index]
            _check(tensor, slot, bucket.dtype)
            tensor.copy_(flat[slot.offset : slot.offset + slot.numel].view(slot.shape))


class Communicator(Protocol):
    """A broadcast among fixed members: ``buffer`` (flat, contiguous) is sent from ``root``
    and overwritten on every other member; returns once this member's part is done."""

    def broadcast(self, buffer: torch.Tensor, root: int) -> None: ...


class BucketedTransport:
    """One member's side of a bucketed weight broadcast (same contract as ``WeightGroup``).

    Args:
        communicator: moves one flat buffer (``NcclCommunicator`` on GPUs).
        rank: this member's rank in the communicator.
        root: the sender's rank (the trainer).
        bucket_bytes: the largest bucket (oversized tensors go alone).

    Examples:
        >>> class Loopback:  # a one-member communicator
        ...     def broadcast(self, buffer, root): pass
        >>> BucketedTransport(Loopback(), rank=0).broadcast([torch.ones(4), torch.ones(())])
        20
    """

    def __init__(
        self,
        communicator: Communicator,
        rank: int,
        root: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.communicator, self.rank, self.root = communicator, rank, root
        self.bucket_bytes = bucket_bytes
        self._plans: dict[tuple[TensorSpec, ...], list[Bucket]] = {}

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        """Broadcast ``tensors`` in place from ``root`` (send there, receive elsewhere).

        Every member passes tensors of the same shapes and dtypes in the same order. Returns the
        payload bytes (the sum of the tensors' sizes).
        """
        tensors = list(tensors)
        specs = tuple(TensorSpec.of(str(i), t) for i, t in enumerate(tensors))
        if specs not in self._plans:  # the same model every version: plan once
            self._plans[specs] = plan_buckets(specs, self.bucket_bytes)
        moved = 0
        for bucket in self._plans[specs]:
            if self.rank == self.root:
                flat = pack(tensors, bucket)
            else:
                flat = torch.empty(
                    bucket.numel, dtype=bucket.dtype, device=_device(tensors, bucket)
                )
            self.communicator.broadcast(flat, self.root)
            if self.rank != self.root:
                unpack(flat, bucket, tensors)
            moved += bucket.nbytes
        return moved


class GlooCommunicator:
    """``Communicator`` over a torch gloo process group (CPU; CUDA buffers go through host)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        host = buffer.cpu() if buffer.is_cuda else buffer
        self.group.broadcast([host], options).wait()
        if host is not buffer:
            buffer.copy_(host)


class NcclCommunicator:
    """``Communicator`` over ``cupy.cuda.nccl.NcclCommunicator`` (one CUDA GPU per member).

    Buffers are sent as raw bytes (``NCCL_UINT8``): a broadcast is a copy, so every dtype,
    bfloat16 included, goes through unchanged. Each call runs on the current torch stream and
    waits for it, so a buffer is never reused while NCCL still reads it.

    Args:
        world_size: the members.
        rank: this one.
        unique_id: ``nccl.get_unique_id()`` of rank 0, the same on every member.
        device: the CUDA device; the current one by default.

    Raises:
        ConfigError: CuPy (with NCCL) or a CUDA GPU is missing.
    """

    def __init__(
        self, world_size: int, rank: int, unique_id: Sequence[int], device: int | None = None
    ) -> None:
        nccl = import_nccl()
        import cupy

        self.device = torch.cuda.current_device() if device is None else device
        self._nccl = nccl
        with cupy.cuda.Device(self.device):
            self._comm = nccl.NcclCommunicator(world_size, tuple(unique_id), rank)

    @classmethod
    def connect(
        cls, store: dist.Store, rank: int, world_size: int, key: str = "nccl-unique-id"
    ) -> NcclCommunicator:
        """Rank 0 makes the NCCL id and publishes it in ``store``; the others wait for it."""
        if rank == 0:
            store.set(key, json.dumps(list(import_nccl().get_unique_id())))
        return cls(world_size, rank, json.loads(store.get(key)))

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        if not (buffer.is_cuda and buffer.is_contiguous()):
            raise ValueError("NcclCommunicator.broadcast needs a contiguous CUDA buffer.")
        stream = torch.cuda.current_stream(buffer.device)
        nbytes = buffer.numel() * buffer.element_size()
        # broadcast (size_t count), not bcast (int count): one oversized tensor may pass 2 GiB.
        ptr = buffer.data_ptr()
        self._comm.broadcast(ptr, ptr, nbytes, self._nccl.NCCL_UINT8, root, stream.cuda_stream)
        stream.synchronize()


def import_nccl() -> Any:
    """``cupy.cuda.nccl``, or a ``ConfigError`` saying how to get it."""
    try:
        from cupy.cuda import nccl
    except ImportError as err:
        raise ConfigError(
            "The NCCL weight transport needs CuPy built with NCCL: pip install 'streamrl[gpu]' "
            "(cupy-cuda13x: CUDA 13, as torch and vLLM). NCCL needs a CUDA GPU on every member; "
            "on CPU use WeightGroup (gloo) or BucketedTransport(GlooCommunicator(...))."
        ) from err
    if not getattr(nccl, "available", True) or not torch.cuda.is_available():
        raise ConfigError(
            "The NCCL weight transport needs a CUDA GPU and CuPy's NCCL bindings "
            f"(cupy nccl available={getattr(nccl, 'available', None)}, "
            f"torch.cuda.is_available()={torch.cuda.is_available()}). On CPU use WeightGroup "
            "(gloo) or BucketedTransport(GlooCommunicator(...))."
        )
    return nccl


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _device(tensors: Sequence[torch.Tensor], bucket: Bucket) -> torch.device:
    return tensors[bucket.slots[0].index].device


def _check(tensor: torch.Tensor, slot: Slot, dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != slot.shape or tensor.dtype != dtype:
        raise ValueError(
            f"Tensor {slot.index} is {tuple(tensor.shape)} {tensor.dtype}, but the bucket plan "
            f"expects {slot.shape} {dtype}: every member must pass the same tensors in order."
        )
