"""One weight version in host memory, laid out as the buckets it travels in.

StreamRL §4.1 (one-step asynchrony) needs the trainer to hand a version off and go on training;
§6 needs it to travel in large buffers. A ``StagedWeights`` is both: a fixed set of flat host
buffers, one per bucket (``plan_buckets``), in the wire dtype (the generators' engine dtype),
allocated once and refilled for every version (pinned when CUDA is present, so device copies
are asynchronous DMA). This is the checkpoint-engine pattern: the trainer stages a version
tensor by tensor right after its optimizer step (``stage_parameters``: a sharded tensor is
gathered, cast, copied to host, freed, so the extra *device* memory is one tensor), then a
background thread sends the buffers as they are. A generator instance receives into a staging
of its own and loads the engine from it, so no full-model buffer is ever allocated on a device.
When the engine runs in processes of its own (vLLM's engine core, tensor-parallel workers), that
staging lives in files mapped by every process (``shared=True``): received once, read by all.

Examples:
    >>> staged = StagedWeights.like([("w", torch.ones(2, 3)), ("b", torch.zeros(3))])
    >>> staged.fill([("w", torch.full((2, 3), 2.0)), ("b", torch.ones(3))], version=1)
    >>> dict(staged.named())["w"].sum().item(), staged.nbytes, len(staged.buffers)
    (12.0, 36, 1)
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES, Bucket, TensorSpec, plan_buckets

__all__ = ["StagedWeights", "gather_rows", "map_file", "row_sharded", "stage_parameters"]


class StagedWeights:
    """Host buffers holding one weight version, bucket by bucket.

    Args:
        specs: every tensor's name, shape and (wire) dtype, in the order they are sent.
        bucket_bytes: the largest bucket (a larger tensor gets one of its own).
        pin: page-locked buffers; ``None``: when CUDA is available (not with ``shared``).
        shared: each buffer is a file mapped into memory (``/dev/shm`` when it has room),
            which other processes map too (``files``, ``layout``); ``unlink`` removes the names
            once they all did, so nothing is left behind whatever way the processes end.

    Attributes:
        bucket_bytes: the plan's largest bucket (a larger tensor gets one of its own).
        buckets: the layout, the same on every member that builds it from the same specs.
        buffers: one flat host tensor per bucket; what travels.
        version: the version the buffers hold (``None`` until filled).
        lock: held while the buffers are written or read as a whole version.
        files: the buffers' files when ``shared`` (until ``unlink``), else ``[]``.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pin: bool | None = None,
        shared: bool = False,
    ) -> None:
        self.specs, self.bucket_bytes = tuple(specs), bucket_bytes
        self.buckets: list[Bucket] = plan_buckets(self.specs, bucket_bytes)
        self.files: list[Path] = []
        if shared:
            folder = _shared_folder(sum(b.nbytes for b in self.buckets))
            stem = f"streamrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.files = [folder / f"{stem}-{i}" for i in range(len(self.buckets))]
            self.buffers = [map_file(f, b.numel, b.dtype) for f, b in zip(self.files, self.buckets)]
        else:
            pin = torch.cuda.is_available() if pin is None else pin
            self.buffers = [
                torch.empty(b.numel, dtype=b.dtype, pin_memory=pin) for b in self.buckets
            ]
        self.version: int | None = None
        self.lock = threading.Lock()
        self._where = {  # tensor index -> (bucket, its slot)
            slot.index: (i, slot) for i, b in enumerate(self.buckets) for slot in b.slots
        }

    @classmethod
    def like(
        cls,
        named: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pin: bool | None = None,
        shared: bool = False,
    ) -> StagedWeights:
        """A staging for tensors shaped as ``named`` (meta or sharded ones too), in ``dtype``
        (their own by default)."""
        specs = [
            TensorSpec(name, tuple(t.shape), dtype if dtype is not None else t.dtype)
            for name, t in named
        ]
        return cls(specs, bucket_bytes, pin, shared)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (one model copy in the wire dtype)."""
        return sum(b.nbytes for b in self.buckets)

    def view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` as a view into its bucket's buffer."""
        bucket, slot = self._where[index]
        return self.buffers[bucket][slot.offset : slot.offset + slot.numel].view(slot.shape)

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` of every tensor, in send order; views, never copies."""
        for index, spec in enumerate(self.specs):
            yield spec.name, self.view(index)

    def fill(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy (and cast) ``named`` into the buffers, checking names and shapes, and mark them
        as ``version``."""
        count = 0
        for index, (name, tensor) in enumerate(named):
            self.copy_in(index, name, tensor)
            count += 1
        if count != len(self.specs):
            raise ValueError(f"Staged {count} tensors, but the weights have {len(self.specs)}.")
        self.version = version

    def copy_in(self, index: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor into its slot (cast to the wire dtype on the way)."""
        self.check(index, name, tuple(tensor.shape))
        with torch.no_grad():
            self.view(index).copy_(tensor.detach())

    def holds(self, named: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``named`` are this staging's own views, in order (nothing to copy)."""
        pairs = list(named)
        return len(pairs) == len(self.specs) and all(
            name == spec.name and tensor.data_ptr() == self.view(i).data_ptr()
            for i, ((name, tensor), spec) in enumerate(zip(pairs, self.specs))
        )

    def layout(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """``(name, bucket, offset, shape)`` of every tensor, in send order: with ``files`` and
        each bucket's dtype, what another process needs to map the same views."""
        return [(spec.name, *self._place(i), spec.shape) for i, spec in enumerate(self.specs)]

    def unlink(self) -> None:
        """Remove the shared buffers' files; the mappings (here and elsewhere) stay valid."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files = []

    def _place(self, index: int) -> tuple[int, int]:
        bucket, slot = self._where[index]
        return bucket, slot.offset

    def check(self, index: int, name: str, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` unless tensor ``index`` is ``name`` of ``shape`` here."""
        spec = self.specs[index] if index < len(self.specs) else None
        if spec is None or spec.name != name or shape != spec.shape:
            expected = f"{spec.name!r} {spec.shape}" if spec is not None else "nothing"
            raise ValueError(
                f"Weight {index} is {name!r} {shape}, but the generators expect "
                f"{expected}: the trainer's policy and the generators' model must have the same "
                "parameters in the same order."
            )


def map_file(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``numel`` elements backed by the file at ``path`` (created if need be),
    shared with every process that maps it."""
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def _shared_folder(nbytes: int) -> Path:
    """``/dev/shm`` (memory) when it has room for ``nbytes`` and a margin, else the temporary
    folder (a container's ``/dev/shm`` is often 64 MB)."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        stat = os.statvfs(shm)
        if stat.f_bavail * stat.f_frsize > nbytes * 1.1:
            return shm
    return Path(tempfile.gettempdir())


def stage_parameters(
    named: Iterable[tuple[str, torch.Tensor]],
    staged: StagedWeights | None,
    version: int,
    dtype: torch.dtype | None = None,
    root: int | None = 0,
) -> None:
    """Stage a (possibly FSDP-sharded) model's parameters tensor by tensor.

    A collective when the parameters are ``DTensor`` s: every trainer rank calls it with the
    same parameters in the same order (on the training thread, between optimizer steps, so the
    gathers never race FSDP's own collectives). Each shard is cast to the wire dtype first
    (half the bytes for bfloat16). With ``root`` (the one rank that passes ``staged``), each
    rank sends its rows of a tensor straight into ``root``'s staging: no full tensor exists on
    any device, and a rank's extra memory is its cast shard (plus, over NCCL, one shard-sized
    receive buffer on ``root``). With ``root=None`` every rank stages (each has a staging of
    its own) and the tensors are all-gathered one at a time.

    Args:
        named: the parameters, in send order.
        staged: where this rank stages them; ``None`` on ranks that only contribute shards.
        version: the version they become.
        dtype: the wire dtype, the same on every rank.
        root: the rank (in the parameters' mesh) holding the staging; ``None``: every rank.
    """
    count = 0
    with torch.no_grad():
        for index, (name, param) in enumerate(named):
            wire = param
            if isinstance(param, DTensor) and dtype is not None and param.dtype != dtype:
                wire = param.to(dtype)  # the shard, cast: what travels
            if isinstance(wire, DTensor) and root is not None and row_sharded(wire):
                if staged is not None:
                    staged.check(index, name, tuple(wire.shape))
                gather_rows(wire, staged.view(index) if staged is not None else None, root)
            else:
                full = wire.full_tensor() if isinstance(wire, DTensor) else wire
                if staged is not None:
                    staged.copy_in(index, name, full)
                del full
            del wire
            count += 1
    if staged is not None:
        if count != len(staged.specs):
            raise ValueError(f"Staged {count} tensors, but the weights have {len(staged.specs)}.")
        staged.version = version


def row_sharded(tensor: DTensor) -> bool:
    """Sharded along its first dimension over a one-dimensional mesh (FSDP2's layout)."""
    return tensor.device_mesh.ndim == 1 and tensor.placements == (Shard(0),)


def gather_rows(tensor: DTensor, into: torch.Tensor | None, root: int) -> None:
    """``root`` receives every rank's rows of ``tensor`` into ``into`` (host memory); the other
    ranks send theirs. Rows split as ``torch.chunk`` splits them, FSDP2's sharding."""
    group = tensor.device_mesh.get_group()
    me, world = dist.get_rank(group), dist.get_world_size(group)
    rows = tensor.shape[0]
    chunk = -(-rows // world)
    local = tensor.to_local()
    if me != root:
        if local.numel():
            dist.send(local.contiguous(), dist.get_global_rank(group, root), group=group)
        return
    for rank in range(world):
        start, end = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        if start == end:
            continue
        target = into[start:end]
        if rank == root:
            if local.shape[0] != end - start:
                raise ValueError(
                    f"A shard of {tuple(tensor.shape)} holds {local.shape[0]} rows, not "
                    f"{end - start}: not sharded as torch.chunk splits (FSDP2's layout)."
                )
            target.copy_(local)
        elif local.is_cuda:  # NCCL receives on the device, then one copy to the host
            buffer = torch.empty(target.shape, dtype=target.dtype, device=local.device)
            dist.recv(buffer, dist.get_global_rank(group, rank), group=group)
            target.copy_(buffer)
        else:  # gloo receives straight into the staging
            dist.recv(target, dist.get_global_rank(group, rank), group=group)
