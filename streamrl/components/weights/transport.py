"""Weights from the trainer to generator instances over a torch.distributed group.

StreamRL §3 / §6: the trainer pushes new weights to the stream generation service after each
optimizer step. Here rank 0 is the trainer and ranks 1..N are generator instances; every
parameter is broadcast from rank 0 (gloo on CPU, the tensor's own backend on GPU). The group is
a standalone ``ProcessGroupGloo`` rather than the default group, so it never collides with the
group Lightning creates for a data-parallel trainer.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist

from streamrl.components.weights.nccl import (
    BucketedTransport,
    Communicator,
    GlooCommunicator,
    NcclCommunicator,
)

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
    """One member of the trainer-plus-generators broadcast group.

    Args:
        port: the rendezvous store's port (``make_store(...).port`` on the trainer).
        rank: 0 for the trainer, ``1 + instance_id`` for generator instances.
        world_size: 1 + number of generator instances.
        store: the trainer passes the store it hosts; members connect to ``port``.
        timeout_s: rendezvous and per-broadcast timeout; a silent peer raises instead of hanging.
        host: the trainer's address as members reach it (loopback by default; a Ray actor on
            another node needs the trainer node's IP).
        transport: ``"gloo"`` (one broadcast per tensor), ``"bucketed"`` (tensors packed into
            large flat buffers, one gloo broadcast each) or ``"nccl"`` (the same buckets over
            NCCL through CuPy, GPU to GPU; see ``nccl_transport``).
        device: where a member receives with ``"nccl"`` (its GPU); the sender's tensors move
            there too if they are not on a GPU already.
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
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}.")
        self.rank, self.world_size, self.transport = rank, world_size, transport
        self.device = torch.device(device)
        prefix = dist.PrefixStore("weights", store)
        self._buckets: BucketedTransport | None = None
        if transport == "nccl":
            communicator: Communicator = NcclCommunicator.connect(prefix, rank, world_size)
        else:
            self._group = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
            communicator = GlooCommunicator(self._group)
        if transport != "gloo":
            self._buckets = BucketedTransport(communicator, rank)

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        """Broadcast ``tensors`` in place from rank 0 (send there, receive elsewhere).

        Every member must pass tensors of the same shapes in the same order. Returns bytes moved.
        """
        if self._buckets is not None:
            if self.transport == "nccl" and self.rank == 0:
                tensors = [t if t.is_cuda else t.to(self.device) for t in tensors]
            return self._buckets.broadcast(tensors)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        moved = 0
        for tensor in tensors:
            # gloo needs contiguous CPU tensors; GPU tensors take a host round trip here.
            buffer = tensor.detach()
            on_host = buffer.is_cuda or not buffer.is_contiguous()
            if on_host:
                buffer = buffer.cpu().contiguous()
            self._group.broadcast([buffer], options).wait()
            if on_host and self.rank != 0:
                tensor.copy_(buffer)
            moved += buffer.numel() * buffer.element_size()
        return moved
