"""A generator instance that forwards the weights it receives to the others of its site.

StreamRL §6 (weight transfer across datacenters): for instances at a remote site, one copy of
the weights crosses the link, to a designated instance (the site's *head*), which fans it out
over the local network. In the generation service each instance has a group of two whose
rank 0 is normally the trainer; for an instance at a remote site, rank 0 is its site's head
instead. The head receives every version from the trainer, then sends the same tensors to each
of its members (store-and-forward, in the head's weight-receiving thread).

Versions line up by construction: the service announces every version to each member as it
pushes it to the head, and the head forwards every version it receives from ``first`` on, so
each announced receive meets exactly one forward. ``first`` is the member's catch-up version
(the last one pushed when it joined), which the head already holds or is about to receive.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from streamrl.components.weights.transport import WeightGroup

log = logging.getLogger(__name__)


class WeightRelay:
    """The head's side: its members' groups, and the last version it received (for catch-up).

    Args:
        host: where the trainer hosts the members' rendezvous stores.
        timeout_s: rendezvous and per-broadcast timeout of each member's group.
        transport: the members' groups' transport (``WeightGroup``).
    """

    def __init__(self, host: str, timeout_s: float, transport: str = "gloo") -> None:
        self.host, self.timeout_s, self.transport = host, timeout_s, transport
        self.members: dict[int, tuple[WeightGroup, int]] = {}  # id -> (group, first version)
        self.last: tuple[int, dict[str, torch.Tensor]] | None = None
        self.bytes_forwarded = 0

    def add(self, member: int, port: int, first: int) -> None:
        """Connect to ``member``'s group as its rank 0; send it ``first`` now if it is held."""
        group = WeightGroup(
            port, 0, 2, timeout_s=self.timeout_s, host=self.host, transport=self.transport
        )
        self.members[member] = (group, first)
        if self.last is not None and self.last[0] >= first:
            self._send(member, *self.last)

    def remove(self, member: int) -> None:
        """Forward nothing more to ``member`` (it stopped, or failed)."""
        self.members.pop(member, None)

    def forward(self, version: int, buffers: dict[str, torch.Tensor]) -> None:
        """After receiving ``version``: keep it for catch-ups and send it to every member that
        expects it."""
        self.last = (version, buffers)
        for member, (_, first) in list(self.members.items()):
            if version >= first:
                self._send(member, version, buffers)

    def _send(self, member: int, version: int, buffers: dict[str, torch.Tensor]) -> None:
        group, _ = self.members[member]
        try:
            self.bytes_forwarded += group.broadcast(buffers.values())
        except Exception as err:  # the member died: the service replaces it; serve the others
            log.warning("relay to instance %d failed at version %d: %s", member, version, err)
            self.members.pop(member, None)


class RelayedGroup:
    """Stands in the trainer's weight sync for an instance fed by its site's head: versions are
    announced to it, but no bytes leave the trainer for it."""

    def broadcast(self, tensors: Any) -> int:
        del tensors
        return 0


def relay_messages(message: tuple) -> tuple[str, Any] | None:
    """Validate a relay message from the service: ``("relay", member, port, first)`` or
    ``("unrelay", member)``; returns ``None`` for any other kind."""
    kind = message[0]
    if kind == "relay" and len(message) == 4 and all(isinstance(x, int) for x in message[1:]):
        return kind, message[1:]
    if kind == "unrelay" and len(message) == 2 and isinstance(message[1], int):
        return kind, message[1:]
    if kind in ("relay", "unrelay"):
        raise ValueError(f"Corrupt relay message from the service: {message!r:.200}")
    return None
