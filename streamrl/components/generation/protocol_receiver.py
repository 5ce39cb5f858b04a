"""In a generator instance fed through vLLM's weight-transfer protocol (``protocol_feed``): the
trainer's messages made as vLLM's calls on the generator, between two engine steps (StreamRL §6).
"""

from __future__ import annotations

import time
from typing import Any

from streamrl.components.generation.messages import (
    ProtocolInit,
    ProtocolUpdate,
    Updated,
    WeightsLost,
)
from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S

__all__ = ["ProtocolReceiver"]

#: How many broadcast timeouts an instance waits for a version to come again on its own group
#: after a shared broadcast failed (the trainer waits one out, then forms the group anew).
WAIT_TIMEOUTS = 3.0


class ProtocolReceiver:
    """In the instance: the trainer's protocol messages, made as vLLM's calls on the
    generator between two steps. Returns what to tell the service.

    Attributes:
        waiting: ``(version, feed generation, why, deadline)`` while a version that failed in
            a shared broadcast is awaited again on the instance's own group: the model may be
            half loaded, so the instance draws no token until it arrives (``overdue``).
    """

    def __init__(self, generator: Any, instance_id: int, policy: str) -> None:
        self.generator, self.instance_id, self.policy = generator, instance_id, policy
        self.waiting: tuple[int, int, str, float] | None = None
        self.wait_s = WAIT_TIMEOUTS * DEFAULT_TIMEOUT_S

    def handle(self, message: ProtocolInit | ProtocolUpdate) -> Updated | WeightsLost | None:
        """``ProtocolInit``: join the trainer's group; ``ProtocolUpdate``: receive and load its
        version, then ``Updated``. A failure is reported (``WeightsLost``: the service replaces
        this instance), or, in a ``shared`` broadcast, awaited again."""
        generation, shared = message.generation, message.shared
        version = message.version if isinstance(message, ProtocolUpdate) else -1
        try:
            if isinstance(message, ProtocolInit):
                timeout_s = message.init_info.get("timeout_s", DEFAULT_TIMEOUT_S)
                self.wait_s = WAIT_TIMEOUTS * float(timeout_s)
                self.generator.init_weight_transfer_engine(message.init_info)
                return None
            self.generator.start_weight_update()
            self.generator.update_weights(message.update_info)
            self.generator.finish_weight_update(str(version))
        except Exception as err:  # the service decides: this instance is replaced
            reason = f"{type(err).__name__}: {err}"[:500]
            if shared:  # the trainer sends the version again on this instance's own group
                if self.waiting is None:
                    self.waiting = (version, generation, reason, time.monotonic() + self.wait_s)
                return None
            self.waiting = None
            return WeightsLost(self.instance_id, version, generation, reason)
        if self.waiting is not None and version >= self.waiting[0]:
            self.waiting = None
        if self.policy == "recompute":
            self.generator.recompute_running()
        return Updated(self.instance_id, version)

    def overdue(self) -> WeightsLost | None:
        """``WeightsLost`` once a version awaited again did not come in time, else ``None``."""
        if self.waiting is None or time.monotonic() < self.waiting[3]:
            return None
        version, generation, reason, _ = self.waiting
        self.waiting = None
        why = f"{reason}; not sent again within {self.wait_s:g} s"
        return WeightsLost(self.instance_id, version, generation, why)
