"""Bucketed weight broadcast (StreamRL §6): bucket plans, pack/unpack, and the transport over a
fake in-process communicator and over real gloo groups in threads. The CuPy/NCCL path needs a
GPU (``gpu`` marker); without CuPy it must fail with a ConfigError that says what to install."""

from __future__ import annotations

import datetime
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from streamrl.components.weights.nccl import (
    BucketedTransport,
    GlooCommunicator,
    NcclCommunicator,
    TensorSpec,
    import_nccl,
    pack,
    plan_buckets,
    unpack,
)
from streamrl.errors import ConfigError

F32, BF16 = torch.float32, torch.bfloat16


class ThreadHub:
    """A fake communicator for members that are threads of this process: the root's buffer is
    copied to the others between two barriers (a hang fails after 10 s)."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=10)
        self.sent: torch.Tensor | None = None
        self.calls: list[int] = []  # bytes per broadcast, recorded by the root

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)


class _Member:
    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        assert buffer.is_contiguous() and buffer.dim() == 1
        if self.rank == root:
            self.hub.sent = buffer.clone()
            self.hub.calls.append(buffer.numel() * buffer.element_size())
        self.hub.barrier.wait()
        if self.rank != root:
            buffer.copy_(self.hub.sent)
        self.hub.barrier.wait()


def weights(seed: int) -> list[torch.Tensor]:
    """Mixed dtypes and shapes: a non-contiguous (transposed) matrix, a strided slice, 0-d."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(6, 4, generator=g).t(),  # [4, 6], non-contiguous
        torch.randn(10, generator=g).to(BF16),
        torch.randint(0, 100, (3, 2), generator=g),  # int64
        torch.randn(12, generator=g)[::3],  # [4], stride 3
        torch.tensor(float(seed) + 0.5),  # 0-d
        torch.rand(5, generator=g) > 0.5,  # bool
        torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
    ]


def zeros_like_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for t in tensors]
    out[0] = torch.zeros(6, 4).t()  # a non-contiguous destination too
    return out


def run_members(world_size: int, body) -> list:
    """Run ``body(rank)`` in one thread per member; re-raise the first error."""
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a member hung"
    if errors:
        raise errors[0]
    return results


def test_plan_hand_computed():
    # bucket_bytes=64. f32: 40 B + 20 B = 60 B fit, then 80 B does not -> close {0, 2}.
    # bf16: 8 B, then 200 B does not fit -> close {1}. Open buckets {3} (80 B, alone, over the
    # limit) and {4} (200 B) come last, in first-seen dtype order.
    specs = [
        TensorSpec("a", (10,), F32),
        TensorSpec("b", (4,), BF16),
        TensorSpec("c", (5,), F32),
        TensorSpec("d", (4, 5), F32),
        TensorSpec("e", (100,), BF16),
    ]
    plan = plan_buckets(specs, bucket_bytes=64)
    got = [(b.dtype, [s.index for s in b.slots], [s.offset for s in b.slots]) for b in plan]
    assert got == [(F32, [0, 2], [0, 10]), (BF16, [1], [0]), (F32, [3], [0]), (BF16, [4], [0])]
    assert [b.nbytes for b in plan] == [60, 8, 80, 200]


def test_plan_respects_limit_and_dtypes():
    g = torch.Generator().manual_seed(0)
    dtypes = [F32, BF16, torch.int64, torch.float16]
    specs = [
        TensorSpec(str(i), (int(torch.randint(1, 40, (1,), generator=g)),), dtypes[i % 4])
        for i in range(60)
    ]
    plan = plan_buckets(specs, bucket_bytes=100)
    placed = sorted(s.index for b in plan for s in b.slots)
    assert placed == list(range(60))  # every tensor exactly once
    for bucket in plan:
        assert all(specs[s.index].dtype == bucket.dtype for s in bucket.slots)
        assert bucket.nbytes <= 100 or len(bucket.slots) == 1  # only a lone tensor may exceed
        offsets = [s.offset for s in bucket.slots]
        ends = [s.offset + s.numel for s in bucket.slots]
        assert offsets == [0, *ends[:-1]] and ends[-1] == bucket.numel  # packed, no gaps
    with pytest.raises(ConfigError, match="bucket_bytes"):
        plan_buckets(specs, bucket_bytes=0)


def test_oversized_tensor_gets_its_own_bucket():
    specs = [
        TensorSpec("small", (2,), F32),
        TensorSpec("big", (1000,), F32),
        TensorSpec("tail", (2,), F32),
    ]
    plan = plan_buckets(specs, bucket_bytes=64)
    assert [[s.index for s in b.slots] for b in plan] == [[0], [1], [2]]
    assert plan[1].nbytes == 4000


def test_pack_unpack_round_trip_is_exact():
    source, dest = weights(1), zeros_like_all(weights(1))
    specs = [TensorSpec.of(str(i), t) for i, t in enumerate(source)]
    plan = plan_buckets(specs, bucket_bytes=48)
    assert len(plan) > len({t.dtype for t in source})  # some dtype spans several buckets
    for bucket in plan:
        flat = pack(source, bucket)
        assert flat.shape == (bucket.numel,) and flat.is_contiguous()
        unpack(flat, bucket, dest)
    for a, b in zip(source, dest):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert not dest[0].is_contiguous()  # written in place, layout kept
    with pytest.raises(ValueError, match="same tensors in order"):
        pack(source[::-1], plan[0])


def test_receivers_end_with_root_values_and_bytes_equal_payload():
    world_size, hub = 3, ThreadHub(3)
    payload = sum(t.numel() * t.element_size() for t in weights(0))

    def member(rank: int) -> tuple[int, list[torch.Tensor]]:
        tensors = weights(0) if rank == 0 else zeros_like_all(weights(0))
        transport = BucketedTransport(hub.member(rank), rank, root=0, bucket_bytes=64)
        return transport.broadcast(tensors), tensors

    results = run_members(world_size, member)
    expected = plan_buckets([TensorSpec.of(str(i), t) for i, t in enumerate(weights(0))], 64)
    assert hub.calls == [b.nbytes for b in expected]  # one call per bucket
    for moved, tensors in results:
        assert moved == payload == sum(hub.calls)
        assert all(torch.equal(a, b) for a, b in zip(tensors, results[0][1]))


def test_over_real_gloo_groups_in_threads():
    world_size, store = 3, dist.HashStore()
    timeout = datetime.timedelta(seconds=20)

    def member(rank: int) -> list[torch.Tensor]:
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        tensors = weights(2) if rank == 0 else zeros_like_all(weights(2))
        BucketedTransport(GlooCommunicator(group), rank, bucket_bytes=64).broadcast(tensors)
        return tensors

    results = run_members(world_size, member)
    for tensors in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(tensors, weights(2)))


def test_without_cupy_a_config_error_says_what_to_install(monkeypatch):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'streamrl\[gpu\]' \(cupy-cuda13x") as info:
        import_nccl()
    assert "GPU" in str(info.value)
    with pytest.raises(ConfigError, match="cupy-cuda13x"):
        NcclCommunicator(world_size=1, rank=0, unique_id=[0] * 128)


@pytest.mark.gpu
def test_nccl_one_member_round_trip():
    pytest.importorskip("cupy", reason="needs CuPy: pip install cupy-cuda13x")
    nccl = import_nccl()
    comm = NcclCommunicator(1, 0, nccl.get_unique_id())
    tensors = [t.cuda() for t in weights(3)]
    transport = BucketedTransport(comm, rank=0, bucket_bytes=64)
    assert transport.broadcast(tensors) == sum(t.numel() * t.element_size() for t in tensors)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(tensors, weights(3)))
