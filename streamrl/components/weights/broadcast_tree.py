"""Network-aware weight broadcast: plan trees over sites, time them, run them (StreamRL §6).

The paper's transmission engine:

- inside a datacenter, **several broadcast trees rooted at different trainer DP ranks**, so the
  load spreads over the trainer's NICs;
- across datacenters, **only one copy crosses the link**, from a trainer rank to one designated
  instance of the remote site, which then broadcasts locally.

``plan_broadcast`` builds that plan from the instances' sites (pure, no I/O); ``direct_plan``
is today's behaviour (the trainer sends to every instance) for comparison; ``plan_time_s`` is the
cost model the simulator uses; ``TreeBroadcaster`` runs one member's part of a plan over one
torch.distributed group per edge (gloo by default, NCCL through ``nccl_transport``).

Examples:
    >>> plan = plan_broadcast({"dc-a": [0, 1], "dc-b": [2, 3, 4]}, trainer_site="dc-a")
    >>> for edge in plan.edges:
    ...     print(edge)
    trainer0@dc-a -> instance2@dc-b [dc-a->dc-b]
    trainer0@dc-a -> instance0@dc-a, instance1@dc-a [dc-a]
    instance2@dc-b -> instance3@dc-b, instance4@dc-b [dc-b]
    >>> plan.link_copies(), direct_plan({"dc-a": [0, 1], "dc-b": [2, 3, 4]}, "dc-a").link_copies()
    (Counter({'dc-a->dc-b': 1}), Counter({'dc-a->dc-b': 3}))
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from streamrl.components.weights.nccl import (
    DEFAULT_BUCKET_BYTES,
    BucketedTransport,
    Communicator,
    GlooCommunicator,
)
from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S
from streamrl.errors import ConfigError

#: ``(key, rank, world_size) -> Communicator`` for the group of one edge (sender is rank 0).
CommunicatorFactory = Callable[[str, int, int], Communicator]


@dataclass(frozen=True)
class Node:
    """A holder of weights: a trainer rank (full weights) or a generator instance, at a site."""

    kind: Literal["trainer", "instance"]
    index: int
    site: str

    def __str__(self) -> str:
        return f"{self.kind}{self.index}@{self.site}"


@dataclass(frozen=True)
class Edge:
    """One broadcast from ``sender`` (which holds the weights by then) to ``receivers`` (all at
    one site). ``link`` names what it crosses: the site for a local edge, ``"a->b"`` across."""

    sender: Node
    receivers: tuple[Node, ...]

    @property
    def crosses_sites(self) -> bool:
        return self.receivers[0].site != self.sender.site

    @property
    def link(self) -> str:
        site = self.receivers[0].site
        return f"{self.sender.site}->{site}" if self.crosses_sites else site

    def __str__(self) -> str:
        return f"{self.sender} -> {', '.join(map(str, self.receivers))} [{self.link}]"


@dataclass(frozen=True)
class BroadcastPlan:
    """Edges in execution order: each sender is a trainer rank or received on an earlier edge,
    and every instance receives exactly once.

    Raises:
        ConfigError: the edges break those rules.
    """

    edges: tuple[Edge, ...]

    def __post_init__(self) -> None:
        holders = {e.sender for e in self.edges if e.sender.kind == "trainer"}
        for edge in self.edges:
            if edge.sender not in holders:
                raise ConfigError(f"Edge {edge}: its sender has no weights yet.")
            if not edge.receivers or len({r.site for r in edge.receivers}) != 1:
                raise ConfigError(f"Edge {edge}: receivers must be non-empty, at one site.")
            if holders & set(edge.receivers):
                raise ConfigError(f"Edge {edge}: a receiver already has the weights.")
            holders.update(edge.receivers)

    def instances(self) -> list[Node]:
        return [r for e in self.edges for r in e.receivers]

    def link_copies(self) -> Counter[str]:
        """Copies of the weights that cross each inter-site link."""
        return Counter(e.link for e in self.edges if e.crosses_sites)


def plan_broadcast(
    sites: Mapping[str, Sequence[int]], trainer_site: str, trainer_ranks: int | Sequence[int] = 1
) -> BroadcastPlan:
    """The network-aware plan of §6.

    Each remote site gets one edge across its link, from trainer ranks taken in turn (rank 0
    first, as in the paper), to its first listed instance, which then sends to the rest of its
    site in one local broadcast. The trainer site's instances are split evenly, in order, into
    one tree per trainer rank. Cross-site edges come first: the link is the long pole.

    Args:
        sites: site name -> instance ids there (from config, e.g. ``{"dc-a": [0, 1]}``).
        trainer_site: where the trainer runs (it may hold no instance).
        trainer_ranks: how many trainer ranks hold the full weights, or their ids.

    Raises:
        ConfigError: no instance, an instance listed twice, or no trainer rank.
    """
    trainers, local = _trainers(sites, trainer_site, trainer_ranks)
    cross, fan_out = [], []
    remote = [site for site, ids in sites.items() if site != trainer_site and ids]
    for k, site in enumerate(remote):
        head, *rest = (Node("instance", i, site) for i in sites[site])
        cross.append(Edge(trainers[k % len(trainers)], (head,)))
        if rest:
            fan_out.append(Edge(head, tuple(rest)))
    trees = []
    for r, trainer in enumerate(trainers):  # contiguous, as even as possible
        chunk = local[r * len(local) // len(trainers) : (r + 1) * len(local) // len(trainers)]
        if chunk:
            trees.append(Edge(trainer, tuple(chunk)))
    return BroadcastPlan(tuple(cross + trees + fan_out))


def direct_plan(
    sites: Mapping[str, Sequence[int]], trainer_site: str, trainer_ranks: int | Sequence[int] = 1
) -> BroadcastPlan:
    """Today's behaviour, for comparison: every instance gets its own copy from a trainer rank
    (ranks in turn), so a remote site's link carries one copy per instance there."""
    trainers, _ = _trainers(sites, trainer_site, trainer_ranks)
    nodes = [Node("instance", i, site) for site, ids in sites.items() for i in ids]
    return BroadcastPlan(
        tuple(Edge(trainers[k % len(trainers)], (n,)) for k, n in enumerate(nodes))
    )


def plan_time_s(
    plan: BroadcastPlan, weight_bytes: float, local_gbps: float, link_gbps: float
) -> float:
    """Seconds until every instance holds the weights: the max over trainer-to-instance paths
    of the summed edge times.

    An edge takes ``weight_bytes x 8 / bandwidth`` (``link_gbps`` across sites, ``local_gbps``
    inside one; a local broadcast to several receivers is pipelined, as NCCL's is, so it costs
    one transfer). Edges sharing a channel split its bandwidth: a cross-site link, or a sender's
    NIC for local edges. In ``plan_broadcast``'s plans no channel is shared, so this is exactly
    the path maximum; ``direct_plan`` pays one copy per instance on each link.
    """
    if weight_bytes < 0 or local_gbps <= 0 or link_gbps <= 0:
        raise ConfigError("plan_time_s: need weight_bytes >= 0 and bandwidths > 0.")
    channel = {e: e.link if e.crosses_sites else str(e.sender) for e in plan.edges}
    sharing = Counter(channel.values())
    done_s: dict[Node, float] = {e.sender: 0.0 for e in plan.edges if e.sender.kind == "trainer"}
    for edge in plan.edges:
        gbps = link_gbps if edge.crosses_sites else local_gbps
        seconds = weight_bytes * 8 / (gbps * 1e9) * sharing[channel[edge]]
        for receiver in edge.receivers:
            done_s[receiver] = done_s[edge.sender] + seconds
    return max(done_s.values(), default=0.0)


class TreeBroadcaster:
    """One member's part of a ``BroadcastPlan``: a group per edge it is on, run in plan order.

    Every member builds its groups and runs its edges in the same global order, so no two
    members wait on each other in a cycle. Bytes are counted per link (``sent_bytes`` and
    ``received_bytes``, cumulative), so a test can see what crossed each link.

    Args:
        plan: the same plan on every member.
        member: this process's node in it.
        store: the rendezvous store (the trainer hosts it: ``weight_transport.make_store``).
        communicator: makes the communicator of one edge; a gloo group over ``store`` by default
            (``NcclCommunicator.connect`` over ``dist.PrefixStore(key, store)`` on GPUs).
        bucket_bytes: bucket size of each broadcast.
        timeout_s: gloo rendezvous timeout.

    Raises:
        ConfigError: ``member`` is on no edge of the plan.
    """

    def __init__(
        self,
        plan: BroadcastPlan,
        member: Node,
        store: dist.Store,
        communicator: CommunicatorFactory | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)

        def gloo(key: str, rank: int, size: int) -> Communicator:
            prefixed = dist.PrefixStore(f"broadcast-tree/{key}", store)
            return GlooCommunicator(dist.ProcessGroupGloo(prefixed, rank, size, timeout))

        make = communicator or gloo
        self.member = member
        self.edges: list[tuple[Edge, BucketedTransport]] = []
        for i, edge in enumerate(plan.edges):
            members = (edge.sender, *edge.receivers)
            if member in members:
                rank = members.index(member)
                comm = make(f"edge{i}", rank, len(members))
                self.edges.append((edge, BucketedTransport(comm, rank, 0, bucket_bytes)))
        if not self.edges:
            raise ConfigError(f"{member} is on no edge of the broadcast plan.")
        self.sent_bytes: Counter[str] = Counter()
        self.received_bytes: Counter[str] = Counter()

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        """Receive (unless a trainer rank) then forward ``tensors`` in place along the plan.

        Returns the bytes this member moved (payload bytes once per edge it is on).
        """
        tensors = list(tensors)
        moved = 0
        for edge, transport in self.edges:
            nbytes = transport.broadcast(tensors)
            sending = edge.sender == self.member
            (self.sent_bytes if sending else self.received_bytes)[edge.link] += nbytes
            moved += nbytes
        return moved


def _trainers(
    sites: Mapping[str, Sequence[int]], trainer_site: str, trainer_ranks: int | Sequence[int]
) -> tuple[list[Node], list[Node]]:
    """Validated trainer nodes, and the instances at the trainer's site."""
    ranks = list(range(trainer_ranks)) if isinstance(trainer_ranks, int) else list(trainer_ranks)
    if not ranks or len(set(ranks)) != len(ranks):
        raise ConfigError(f"Need at least one trainer rank, each once; got {trainer_ranks!r}.")
    ids = [i for site_ids in sites.values() for i in site_ids]
    if not ids:
        raise ConfigError(f"No generator instance in sites {dict(sites)!r}.")
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    if repeated:
        raise ConfigError(f"Instances {repeated} are listed at more than one place in sites.")
    trainers = [Node("trainer", r, trainer_site) for r in ranks]
    local = [Node("instance", i, trainer_site) for i in sites.get(trainer_site, ())]
    return trainers, local
