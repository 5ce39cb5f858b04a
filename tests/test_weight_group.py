"""The weight group's rendezvous (``WeightGroup``): members meet over the trainer's store, and
one that will never come costs a poll, not the whole timeout (a peer process gone, a feed that
moved on), while a silent one still fails at the timeout, naming the missing rank."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from streamrl.components.weights import transport
from streamrl.components.weights.transport import (
    GlooTransport,
    WeightGroup,
    make_store,
    make_transport,
    set_feed,
)
from streamrl.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def test_two_members_meet_and_broadcast():
    store = make_store(2, 10)
    got = torch.zeros(5)
    receiver = threading.Thread(
        target=lambda: WeightGroup(store.port, 1, 2, timeout_s=10).broadcast([got])
    )
    receiver.start()
    sent = WeightGroup(store.port, 0, 2, store=store, timeout_s=10).broadcast([torch.arange(5.0)])
    receiver.join(10)
    assert sent == 20 and torch.equal(got, torch.arange(5.0))


@dataclass(frozen=True)
class DoublingTransport(GlooTransport):
    """A user's transport: gloo, with every received bucket doubled (proof it carried them)."""

    def connect(self, store, rank, world_size, *, timeout_s, device):
        link = super().connect(store, rank, world_size, timeout_s=timeout_s, device=device)

        class Doubling:
            def broadcast(self, tensor):
                link.broadcast(tensor)
                if rank != 0:
                    tensor.mul_(2)

        return Doubling()


def test_a_users_transport_object_or_name_carries_the_buckets():
    store = make_store(2, 10)
    got = torch.zeros(3)
    by_name = f"{__name__}:DoublingTransport"  # as rl.weights.transport names it
    receiver = threading.Thread(
        target=lambda: WeightGroup(store.port, 1, 2, timeout_s=10, transport=by_name).broadcast(
            [got]
        )
    )
    receiver.start()
    group = WeightGroup(store.port, 0, 2, store=store, timeout_s=10, transport=DoublingTransport())
    group.broadcast([torch.arange(3.0)])
    receiver.join(10)
    assert torch.equal(got, 2 * torch.arange(3.0))
    with pytest.raises(ConfigError, match=r"weight_transport: .*not a WeightTransport"):
        make_transport(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Unknown transport 'ncl'.*did you mean 'nccl'"):
        make_transport("ncl")


def test_the_sender_gives_up_as_soon_as_abandon_gives_a_reason():
    store = make_store(2, 30)
    gone_at = time.monotonic() + 0.5

    def abandon() -> str | None:
        return "instance 7 is gone" if time.monotonic() > gone_at else None

    started = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match="instance 7 is gone"):
        WeightGroup(store.port, 0, 2, store=store, timeout_s=30, abandon=abandon)
    assert time.monotonic() - started < 5  # not the 30 s timeout


@pytest.mark.parametrize(("feed", "why"), [(2, "fed anew"), (None, "left the service")])
def test_a_member_of_an_older_feed_gives_up_once_the_store_moves_on(feed, why):
    store = make_store(2, 30)
    set_feed(store, 1)
    threading.Timer(0.5, set_feed, (store, feed)).start()
    started = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match=why):
        WeightGroup(store.port, 1, 2, timeout_s=30, generation=1)
    assert time.monotonic() - started < 5


def test_a_silent_member_times_out_naming_its_rank():
    store = make_store(3, 10)
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1, 2 did not join within 0.5 s"):
        WeightGroup(store.port, 0, 3, store=store, timeout_s=0.5)


def test_a_peer_that_dies_after_saying_it_is_here_costs_the_connect_timeout(monkeypatch):
    """It joined the rendezvous, then died before the backend's own: the sender fails at the
    short connect timeout, not at the weight timeout (which bounds each broadcast)."""
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 1.0)
    store = make_store(2, 60)
    dist.PrefixStore("weights-1", store).set("present-1", "1")  # here, then gone
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        WeightGroup(store.port, 0, 2, store=store, timeout_s=60)
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("rank", [0, 1])
def test_a_connect_held_by_a_dead_peer_ends_on_abandon_not_on_glooss_timeout(rank):
    """The peer said it is here, then died before gloo connected it: gloo's own connect waits
    (on the store, then in its pair retries: 150 s measured) whatever our timeouts say. With
    ``abandon`` (the sender: the instance's process gone; a member: it was fed anew) the group
    gives up at the next poll instead."""
    store = make_store(2, 60)
    dist.PrefixStore("weights-1", store).set(f"present-{1 - rank}", "1")  # here, then gone
    gone_at = time.monotonic() + 1.0

    def abandon() -> str | None:
        return "the peer is gone" if time.monotonic() > gone_at else None

    started = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match=r"feed 1\): the peer is gone"):
        if rank == 0:
            WeightGroup(store.port, 0, 2, store=store, timeout_s=60, abandon=abandon)
        else:
            WeightGroup(store.port, 1, 2, timeout_s=60, abandon=abandon)
    assert time.monotonic() - started < 5  # gloo's connect would wait CONNECT_TIMEOUT_S (30 s)


def test_a_broadcast_waits_the_weight_timeout_not_the_connect_one(monkeypatch):
    """A member slow to take its bucket (busy decoding) is waited for up to ``timeout_s``."""
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 1.0)
    store = make_store(2, 30)
    got = torch.zeros(3)

    def slow_member() -> None:
        group = WeightGroup(store.port, 1, 2, timeout_s=30)
        time.sleep(3)
        group.broadcast([got])

    member = threading.Thread(target=slow_member)
    member.start()
    WeightGroup(store.port, 0, 2, store=store, timeout_s=30).broadcast([torch.ones(3)])
    member.join(30)
    assert torch.equal(got, torch.ones(3))


def test_a_users_transport_is_named_in_the_config(tmp_path):
    """``rl.weights.transport`` takes a user's class by import path, as the Python API takes
    the object: checked when the config is read, and the run makes it (``WeightPath``)."""
    from streamrl.run.config_file import load_config

    path = tmp_path / "run.yaml"
    path.write_text(f"rl:\n  weights: {{transport: '{__name__}:DoublingTransport', fanout: 2}}\n")
    weights = load_config(path).rl.weights
    assert isinstance(weights.make_transport(), DoublingTransport) and weights.fanout == 2
