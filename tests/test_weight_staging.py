"""A weight version staged once in host memory, bucket by bucket, and sent from there (StreamRL
§4.1, §6): layout, casting, snapshot semantics, the wait before the next version overwrites
the staging, and timeouts that fail instead of hanging."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.weights.staging import StagedWeights, stage_parameters
from streamrl.components.weights.sync import AsyncWeightSync
from streamrl.errors import ConfigError


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(10, 4, generator=gen)),
        ("layer.w", torch.randn(4, 4, generator=gen)),
        ("layer.b", torch.randn(4, generator=gen)),
        ("head", torch.randn(4, 10, generator=gen).t()),  # not contiguous
    ]


class RecordingGroup:
    """A peer that copies what it is sent (optionally slowly, or never returning)."""

    def __init__(self, delay_s: float = 0.0, hang: bool = False) -> None:
        self.received: list[list[torch.Tensor]] = []
        self.delay_s, self.hang = delay_s, hang
        self.sending = threading.Event()

    def broadcast(self, buffers) -> int:
        self.sending.set()
        if self.hang:
            threading.Event().wait()
        time.sleep(self.delay_s)
        self.received.append([b.clone() for b in buffers])
        self.sending.clear()
        return sum(b.numel() * b.element_size() for b in buffers)


def _unpack(staged: StagedWeights, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a receiver with the same layout reads from ``buffers``."""
    receiver = StagedWeights(staged.specs, bucket_bytes=staged.bucket_bytes, pin=False)
    for mine, theirs in zip(receiver.buffers, buffers):
        mine.copy_(theirs)
    return {name: t.clone() for name, t in receiver.named()}


def test_staging_lays_tensors_out_in_buckets_and_casts_them():
    named = _named()
    staged = StagedWeights.like(named, torch.bfloat16, bucket_bytes=64, pin=False)
    assert len(staged.buffers) == 3  # 80, 32 + 8, 80 bytes in bf16 (the two larger alone)
    assert staged.nbytes == sum(t.numel() for _, t in named) * 2
    staged.fill(named, version=3)
    assert staged.version == 3
    for (name, view), (_, tensor) in zip(staged.named(), named):
        assert view.dtype == torch.bfloat16
        assert torch.equal(view, tensor.to(torch.bfloat16)), name
    # views, not copies: the engine loads straight from the buffers
    first = next(staged.named())[1]
    assert first.untyped_storage().data_ptr() == staged.buffers[0].untyped_storage().data_ptr()


def test_staging_refuses_weights_of_another_model():
    staged = StagedWeights.like(_named(), pin=False)
    other = _named()
    other[1] = ("layer.w", torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"'layer.w' \(4, 5\).*expect 'layer.w' \(4, 4\)"):
        staged.fill(other, version=1)
    with pytest.raises(ValueError, match="Staged 3 tensors, but the weights have 4"):
        staged.fill(_named()[:3], version=1)


def test_stage_parameters_of_an_unsharded_model_is_the_model_in_the_wire_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    staged = StagedWeights.like(model.named_parameters(), torch.bfloat16, 64, pin=False)
    stage_parameters(list(model.named_parameters()), staged, 2, torch.bfloat16)
    assert staged.version == 2
    for (name, view), (_, param) in zip(staged.named(), model.named_parameters()):
        assert torch.equal(view, param.detach().to(torch.bfloat16)), name


def test_a_push_sends_the_staged_snapshot_while_training_changes_the_weights():
    named = _named()
    group = RecordingGroup(delay_s=0.3)
    sync = AsyncWeightSync(timeout_s=10, bucket_bytes=64)
    announced: list[int] = []
    sync.add_group(0, group, announced.append)
    expected = {n: t.clone() for n, t in named}
    sync.push(dict(named), version=1)
    assert group.sending.wait(5)
    for _, tensor in named:  # the next optimizer step, while version 1 is on the wire
        tensor.add_(1.0)
    sync.wait_sent(1)
    got = _unpack(sync.staged, group.received[0])
    assert all(torch.equal(got[n], t) for n, t in expected.items())
    assert announced == [1] and sync.bytes_sent == sync.staged.nbytes
    sync.close()


def test_the_next_version_is_staged_only_once_the_previous_one_is_out():
    named = _named()
    group = RecordingGroup(delay_s=0.5)
    sync = AsyncWeightSync(timeout_s=10, bucket_bytes=64)
    sync.add_group(0, group, lambda v: None)
    sync.push(dict(named), version=1)
    started = time.perf_counter()
    staged = sync.staging(named)  # blocks while version 1's buffers are being sent
    assert time.perf_counter() - started > 0.3 and len(group.received) == 1
    assert staged is sync.staged  # one host copy, reused
    for _, tensor in named:
        tensor.mul_(2.0)
    staged.fill(named, version=2)
    sync.push(staged, version=2)
    sync.wait_sent(2)
    second = _unpack(staged, group.received[1])
    assert all(torch.equal(second[n], t) for n, t in named)
    assert sync.exposed_s > 0.3  # the wait counts as the trainer's blocked time
    sync.close()


def test_a_newcomer_gets_the_staged_version_first():
    named = _named()
    sync = AsyncWeightSync(timeout_s=10)
    sync.push(dict(named), version=4)
    sync.wait_sent(4)
    late, announced = RecordingGroup(), []
    sync.add_group(7, late, announced.append)
    sync.staging(named)  # returns once the catch-up is out
    assert announced == [4] and len(late.received) == 1
    assert all(torch.equal(_unpack(sync.staged, late.received[0])[n], t) for n, t in named)
    sync.close()


class Hub:
    """A broadcast shared by several groups (vLLM's protocol: ``SharedBroadcast``): it sends
    once to every member given, and says per member what left the trainer, or why it failed."""

    def __init__(self, fails: set[int] = frozenset()) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.fails = fails

    def send(self, version: int, members: dict, buffers) -> dict:
        self.calls.append((version, sorted(members)))
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        first = min(members)
        return {
            key: RuntimeError(f"{key} died") if key in self.fails else nbytes * (key == first)
            for key in members
        }


class Member:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def broadcast(self, buffers) -> int:
        raise AssertionError("a member of a shared broadcast is sent to by its hub")


def test_groups_behind_one_shared_broadcast_are_sent_to_once_and_a_failed_member_dropped():
    named = _named()
    sync, hub = AsyncWeightSync(timeout_s=10), Hub(fails={2})
    alone = RecordingGroup()
    for key in (1, 2, 3):
        sync.add_group(key, Member(hub), lambda version: None)
    sync.add_group(9, alone, lambda version: None)
    sync.push(dict(named), version=1)
    sync.wait_sent(1)
    assert hub.calls == [(1, [1, 2, 3])] and len(alone.received) == 1
    assert sync.bytes_sent == 2 * sync.staged.nbytes  # one copy for the hub, one for the other
    assert [key for key, _ in sync.failed] == [2] and "2 died" in sync.failed[0][1]
    sync.push(dict(named), version=2)
    sync.wait_sent(2)
    assert hub.calls[-1] == (2, [1, 3])
    sync.close()


def test_a_stuck_transfer_times_out_instead_of_hanging_the_trainer():
    sync = AsyncWeightSync(timeout_s=0.5)
    sync.add_group(0, RecordingGroup(hang=True), lambda v: None)
    sync.push(dict(_named()), version=1)
    started = time.perf_counter()
    with pytest.raises(
        TimeoutError,
        match=r"version 1 was not sent within 1 s \(the weight timeout, 0.5 s, per group",
    ):
        sync.wait_sent(1)
    with pytest.raises(TimeoutError, match="previous weight version was not sent"):
        sync.staging(_named())
    assert time.perf_counter() - started < 3
    sync.close()


def test_push_refuses_a_staging_that_is_not_the_version():
    sync = AsyncWeightSync()
    staged = sync.staging(_named())
    with pytest.raises(ValueError, match="hold version None, not 1"):
        sync.push(staged, version=1)
    sync.close()


def test_default_timeouts_scale_with_the_model_and_a_given_one_wins():
    small = Timeouts.for_model(model_bytes=1e6, max_tokens=64)
    big = Timeouts.for_model(model_bytes=30e9, max_tokens=8192)
    assert small.start_s == pytest.approx(180.1, abs=0.1)
    for name in ("start_s", "sample_s", "heartbeat_s", "weight_s"):
        assert getattr(big, name) > 5 * getattr(small, name)
    assert Timeouts.for_model(30e9, 8192, weight_s=7).weight_s == 7
    with pytest.raises(ConfigError, match=r"rl.timeouts: weight_s must be > 0"):
        Timeouts.for_model(1e6, 64, weight_s=0)


def test_a_receiver_skips_versions_announced_for_a_feed_it_no_longer_has():
    """After a re-feed (its feeder stopped or failed), versions announced for the old feed are
    not waited for: the new feeder's catch-up brings the last one (``feeding``)."""
    from streamrl.components.generation.weight_receiver import WeightReceiver

    connected: list[int] = []

    def connect(generation: int) -> RecordingGroup:
        connected.append(generation)
        return RecordingGroup()

    class NoMembers:
        def forward(self, version, index, buffer) -> None:
            pass

    staged = StagedWeights.like(_named(), pin=False)
    receiver = WeightReceiver(connect, staged, NoMembers())
    receiver.refeed(2)
    # A connect of feed 1 still under way gives up at once (``WeightGroup``'s ``abandon``).
    assert receiver.fed_anew(1) == "fed anew (feed 2)" and receiver.fed_anew(2) is None
    receiver.receive(5, 1)  # announced for feed 1, arrives after the re-feed: skipped
    receiver.receive(5, 2)  # the new feeder's catch-up
    deadline = time.monotonic() + 5
    got: list = []
    while len(got) < 1 and time.monotonic() < deadline:
        got += receiver.ready()
        time.sleep(0.01)
    assert got == [(5, staged)] and staged.version == 5
    assert connected == [2] and not receiver.busy  # one group, of the new feed


def test_a_shared_staging_is_files_another_process_maps_and_leaves_no_name():
    """``shared=True``: the buffers are files a second mapping sees (vLLM's tensor-parallel
    workers map them); ``unlink`` removes the names, the mappings stay; ``holds`` tells the
    staging's own views from a copy."""
    from streamrl.components.weights.staging import map_file

    staged = StagedWeights.like(
        [("a", torch.ones(3, 4)), ("b", torch.ones(5))],
        torch.bfloat16,
        bucket_bytes=16,
        shared=True,
    )
    assert [f.exists() for f in staged.files] == [True, True]
    assert staged.layout() == [("a", 0, 0, (3, 4)), ("b", 1, 0, (5,))]
    other = [map_file(f, b.numel, b.dtype) for f, b in zip(staged.files, staged.buckets)]
    files = list(staged.files)
    staged.unlink()
    assert staged.files == [] and not any(f.exists() for f in files)
    staged.fill([("a", torch.full((3, 4), 2.0)), ("b", torch.arange(5.0))], version=1)
    assert other[0].sum().item() == 24.0 and other[1].tolist() == [0, 1, 2, 3, 4]
    assert staged.holds(staged.named())
    assert not staged.holds([("a", torch.ones(3, 4)), ("b", torch.ones(5))])
    assert not staged.holds(list(staged.named())[:1])
