"""Who feeds each generator instance its weights: the trainer, or another instance (StreamRL §6).

The trainer sends each version once per site, to the site's first instance; every other
instance is fed by one of its site (a chain, or a tree of ``fanout`` children each), which passes
each bucket on as it arrives (``weight_relay``). So the trainer's egress is one model copy per
version per site, whatever the number of instances.

Instances come and go at version boundaries. A newcomer hangs on the first instance of its site
with a free slot and catches up from that one's staging. When an instance stops or fails, the
instances it fed are fed again by its own feeder (or the trainer), on a fresh group: each feed
has a *generation*, every announced version carries it, and an instance ignores versions
announced for a feed it no longer has; the new feeder first sends the last version pushed, so
nothing is missed and healthy instances are never replaced for their feeder's fault.
"""

from __future__ import annotations

from collections.abc import Callable

from streamrl.components.generation.instance import InstanceHandle
from streamrl.components.generation.messages import Refeed, Relay, Unrelay, Update
from streamrl.components.generation.protocol_feed import ProtocolLink, SharedBroadcast, gone
from streamrl.components.weights.relay import RelayedGroup
from streamrl.components.weights.sync import AsyncWeightSync
from streamrl.components.weights.transport import LazyGroup, WeightGroup, set_feed
from streamrl.protocols import WeightTransport

__all__ = ["WeightFeeds"]


class WeightFeeds:
    """The feeding tree of a pool's instances and the weight sync's groups for it.

    Args:
        sync: the trainer's weight sync (its groups are the instances the trainer feeds; the
            others are announce-only ``RelayedGroup`` s).
        handles: the pool's instances (shared, in id order).
        transport: the groups' transport (``WeightGroup``).
        timeout_s: rendezvous and per-transfer timeout of a group.
        fanout: instances each instance feeds at most (new ones; a refeed may exceed it).
        device: the trainer's device the weights leave from (an NCCL link's buffers live
            there: the trainer's own GPU, ``cuda:k``, never a guessed ``cuda:0``).
        protocol: every instance is fed by the trainer through vLLM's weight-transfer
            protocol, all on one broadcast (``protocol_feed.SharedBroadcast``): no chains, no
            relays.
        protocol_ranks: each instance's worker processes (its members in the group).
    """

    def __init__(
        self,
        sync: AsyncWeightSync,
        handles: list[InstanceHandle],
        transport: WeightTransport | str,
        timeout_s: float,
        fanout: int = 1,
        device: str = "cuda",
        protocol: bool = False,
        protocol_ranks: int = 1,
    ) -> None:
        if fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {fanout}.")
        self.sync, self.handles = sync, handles
        self.transport, self.timeout_s, self.fanout = transport, timeout_s, fanout
        self.device, self.protocol, self.protocol_ranks = device, protocol, protocol_ranks
        self.shared = SharedBroadcast(sync, timeout_s) if protocol else None

    def join(self, handle: InstanceHandle) -> None:
        """A new instance that loaded the model: feed it from the first instance of its site
        with a free slot (or the trainer), from the last version pushed on."""
        if self.protocol:
            self._feed(handle, None)
            return
        head = next(
            (
                other
                for other in self.handles
                if other is not handle
                and other.site == handle.site
                and other.state in ("joining", "active")
                and len(other.members) < self.fanout
            ),
            None,
        )
        self._feed(handle, head)

    def leave(self, handle: InstanceHandle) -> None:
        """``handle`` stops or fails: nothing more goes to it, and whoever it fed is fed by its
        own feeder (or the trainer) from now on."""
        set_feed(handle.store, None)  # a group it was meeting gives up now
        self.sync.remove_group(handle.instance_id)
        head = self._head(handle)
        if head is not None:
            head.members.discard(handle.instance_id)
            head.inbox.put(Unrelay(handle.instance_id))
        for member in sorted(handle.members):
            self._feed(self.handles[member], head)
        handle.members.clear()

    def lost(self, handle: InstanceHandle, generation: int) -> InstanceHandle | None:
        """``handle`` failed to receive a version of feed ``generation``: the instance to fail
        (its feeder, if that one died; else itself), or ``None`` if it had been fed anew since
        (the new feeder's catch-up covers the version)."""
        if generation != handle.feed_generation:
            return None
        head = self._head(handle)
        if head is not None and (head.state == "failed" or _died(head)):
            return head
        return handle

    def _head(self, handle: InstanceHandle) -> InstanceHandle | None:
        return self.handles[handle.head] if handle.head is not None else None

    def _feed(self, handle: InstanceHandle, head: InstanceHandle | None) -> None:
        """Connect ``handle`` to ``head`` (``None``: the trainer) on a new feed generation, in
        order with the pushes, and have the last version pushed sent to it first."""
        handle.feed_generation += 1
        generation, port = handle.feed_generation, handle.store.port
        set_feed(handle.store, generation)  # an older feed's group, still meeting, gives up
        if generation > 1:  # its receiving thread opens the new group after what it has queued
            handle.inbox.put(Refeed(generation))

        def announce(version: int) -> None:
            verify = int(self.sync.verifies(version))  # it reports its checksums once loaded
            handle.inbox.put(Update(version, generation, verify))

        handle.head = head.instance_id if head is not None else None
        if head is None and self.protocol:  # vLLM's calls; the group meets at the first version
            link = ProtocolLink(
                handle, self.sync, generation, self.timeout_s, self.protocol_ranks, self.shared
            )
            self.sync.add_group(handle.instance_id, link, link.announce)
            return
        if head is None:  # both sides connect at the first transfer (the instance on receiving)
            group = LazyGroup(self._connect(handle, generation))
            self.sync.add_group(handle.instance_id, group, announce)
            return

        def start_relay(last: int | None) -> None:
            first = last if last is not None else 0
            head.inbox.put(Relay(handle.instance_id, port, first, generation))

        head.members.add(handle.instance_id)
        self.sync.add_group(handle.instance_id, RelayedGroup(), announce, start_relay)

    def _connect(self, handle: InstanceHandle, generation: int) -> Callable[[], WeightGroup]:
        def connect() -> WeightGroup:
            return WeightGroup(
                handle.store.port,
                0,
                2,
                store=handle.store,
                timeout_s=self.timeout_s,
                transport=self.transport,
                device=self.device,
                generation=generation,
                abandon=lambda: gone([handle]),
            )

        return connect


def _died(handle: InstanceHandle, grace_s: float = 2.0) -> bool:
    """Whether the process is gone (given a moment: a peer's socket closes as it dies)."""
    handle.proc.join(grace_s)
    return not handle.proc.is_alive()
