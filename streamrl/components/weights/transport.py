"""Weights from the trainer to generator instances over a torch.distributed group.

StreamRL §3 / §6: the trainer pushes new weights to the stream generation service after each
optimizer step. Here rank 0 is the sender (the trainer, or an instance that forwards what it
received) and the other ranks receive; every bucket is broadcast from rank 0 (gloo through host
memory on CPU, NCCL on GPUs). The group is
a standalone ``ProcessGroupGloo`` rather than the default group, so it never collides with the
group Lightning creates for a data-parallel trainer.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from streamrl.components.weights.nccl import NcclCommunicator

#: How long a rendezvous or a broadcast may wait for its peers before failing.
DEFAULT_TIMEOUT_S = 120.0
#: Ways weights travel (see ``WeightGroup``).
TRANSPORTS = ("gloo", "bucketed", "nccl")


def make_store(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store, hosted by the trainer on a free loopback port (``store.port``)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class WeightGroup:
    """One member of a weight broadcast group: rank 0 sends, the others receive.

    What travels is a list of flat buffers, the buckets of a ``StagedWeights`` (one collective
    call per bucket); any list of tensors works the same way.

    Args:
        port: the rendezvous store's port (``make_store(...).port`` on the trainer).
        rank: 0 for the sender (the trainer, or the instance feeding this one), 1.. for
            receivers.
        world_size: the members.
        store: the sender passes the store it hosts; members connect to ``port``.
        timeout_s: rendezvous and per-broadcast timeout; a silent peer raises instead of hanging.
        host: the store's address as members reach it (loopback by default; a Ray actor on
            another node needs the trainer node's IP).
        transport: ``"gloo"`` or ``"bucketed"`` (the same: every version travels in buckets
            over gloo, through host memory) or ``"nccl"`` (each bucket copied to the GPU and
            broadcast GPU to GPU through CuPy, on a CUDA stream of its own, so it never waits
            for, or holds up, the training stream).
        device: where a member's NCCL copy of a bucket lives (its GPU).
        generation: which feed of the store this is: a member fed anew connects again on the
            same store under a new generation.
    """

    def __init__(
        self,
        port: int,
        rank: int,
        world_size: int,
        store: dist.Store | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: str = "127.0.0.1",
        transport: str = "gloo",
        device: str = "cuda",
        generation: int = 1,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}.")
        self.rank, self.world_size, self.transport = rank, world_size, transport
        self.device = torch.device(device)
        prefix = dist.PrefixStore(f"weights-{generation}", store)
        self._stream = None
        if transport == "nccl":
            self._nccl = NcclCommunicator.connect(prefix, rank, world_size)
            self._stream = torch.cuda.Stream(self.device)
        else:
            self._group = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        """Broadcast ``tensors`` in place from rank 0 (send there, receive elsewhere), one
        collective call each.

        Every member passes tensors of the same shapes and dtypes in the same order. Returns
        the bytes moved.
        """
        moved = 0
        for tensor in tensors:
            if self._stream is not None:
                self._broadcast_nccl(tensor)
            else:
                self._broadcast_gloo(tensor)
            moved += tensor.numel() * tensor.element_size()
        return moved

    def _broadcast_gloo(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        # gloo needs contiguous CPU tensors; others take a host round trip here.
        buffer = tensor.detach()
        on_host = buffer.is_cuda or not buffer.is_contiguous()
        if on_host:
            buffer = buffer.cpu().contiguous()
        self._group.broadcast([buffer], options).wait()
        if on_host and self.rank != 0:
            tensor.copy_(buffer)

    def _broadcast_nccl(self, tensor: torch.Tensor) -> None:
        with torch.no_grad(), torch.cuda.stream(self._stream):
            flat = tensor.detach().reshape(-1)
            on_device = flat.to(self.device, non_blocking=True).contiguous()
            self._nccl.broadcast(on_device, root=0)  # on this stream; waits for it
            if self.rank != 0 and on_device.data_ptr() != flat.data_ptr():
                flat.copy_(on_device)
                self._stream.synchronize()


class LazyGroup:
    """A sender's ``WeightGroup`` connected on first use (``connect``, or the first
    ``broadcast``), on whichever thread gets there: a member fed anew opens its side only once
    its receiving thread reaches the new feed."""

    def __init__(self, connect: Callable[[], WeightGroup]) -> None:
        self._connect, self._group = connect, None

    def connect(self) -> WeightGroup:
        if self._group is None:
            self._group = self._connect()
        return self._group

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        return self.connect().broadcast(tensors)
