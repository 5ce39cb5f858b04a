"""A generator instance that forwards the weights it receives to others.

StreamRL §6 (weight transfer): the trainer sends each version once per site, to one instance
(the site's *head*), and the instances pass it on among themselves, so the trainer's egress is
one model copy per version per site whatever the number of instances. Inside a site the
instances form a chain (or a tree of ``fanout`` children each): every instance forwards each
bucket to its members as soon as it has received it, so the buckets flow down the chain in a
pipeline instead of store-and-forward of whole models. Across datacenters, only one copy
crosses the link, to the remote site's head.

In the generation service each instance has a group of two whose rank 0 is its feeder (the
trainer, or the instance before it). Versions line up by construction: the service announces
every version to each member as it pushes it to the trainer's groups, and a feeder forwards
every version it receives from ``first`` on, so each announced receive meets exactly one
forward. ``first`` is the member's catch-up version (the last one pushed when it joined), which
the feeder already holds (sent at once from its staging) or is about to receive.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from streamrl.components.weights.staging import StagedWeights
from streamrl.components.weights.transport import LazyGroup, WeightGroup
from streamrl.protocols import WeightTransport

log = logging.getLogger(__name__)


class WeightRelay:
    """The feeder's side: its members' groups, fed from its own staging.

    Args:
        staged: the instance's staging (what it receives into and loads from).
        host: where the trainer hosts the members' rendezvous stores.
        timeout_s: rendezvous and per-broadcast timeout of each member's group.
        transport: the members' groups' transport (``WeightGroup``).
    """

    def __init__(
        self,
        staged: StagedWeights,
        host: str,
        timeout_s: float,
        transport: WeightTransport | str = "gloo",
    ) -> None:
        self.staged, self.host, self.timeout_s, self.transport = staged, host, timeout_s, transport
        self.members: dict[int, LazyGroup] = {}
        self.first: dict[int, int] = {}  # the first version each member expects from us
        self.sent: dict[int, int] = {}  # the last version sent to each
        self.bytes_forwarded = 0
        self._targets: list[int] = []  # who gets the version being received

    def add(self, member: int, port: int, first: int, generation: int = 1) -> None:
        """Connect to ``member``'s group (feed ``generation``) as its rank 0; send it ``first``
        now if it is held."""
        self.members[member] = LazyGroup(  # it connects as it receives its first version
            lambda: WeightGroup(
                port,
                0,
                2,
                timeout_s=self.timeout_s,
                host=self.host,
                transport=self.transport,
                generation=generation,
            )
        )
        self.first[member], self.sent[member] = first, -1
        with self.staged.lock:
            held = self.staged.version
            if held is not None and held >= first:
                for index, buffer in enumerate(self.staged.buffers):
                    self._send(member, held, index, buffer)
                self.sent[member] = held

    def remove(self, member: int) -> None:
        """Forward nothing more to ``member`` (it stopped, or failed)."""
        self.members.pop(member, None)

    def forward(self, version: int, index: int, buffer: torch.Tensor) -> None:
        """Bucket ``index`` of ``version`` has arrived: send it to every member expecting it
        (each version at most once: a catch-up this instance receives after being fed anew
        is not sent again to members that hold it)."""
        if index == 0:
            self._targets = [
                m for m in self.members if self.first[m] <= version and self.sent[m] < version
            ]
            for member in self._targets:
                self.sent[member] = version
        for member in self._targets:
            self._send(member, version, index, buffer)

    def _send(self, member: int, version: int, index: int, buffer: torch.Tensor) -> None:
        group = self.members.get(member)
        if group is None:  # failed earlier in this version
            return
        try:
            self.bytes_forwarded += group.broadcast([buffer])
        except Exception as err:  # the member died: the service replaces it; serve the others
            log.warning(
                "relay to instance %d failed at version %d (bucket %d): %s",
                member,
                version,
                index,
                err,
            )
            self.members.pop(member, None)


class RelayedGroup:
    """Stands in the trainer's weight sync for an instance fed by its site's head: versions are
    announced to it, but no bytes leave the trainer for it."""

    def broadcast(self, tensors: Any) -> int:
        del tensors
        return 0
