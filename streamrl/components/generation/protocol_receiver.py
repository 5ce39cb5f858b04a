"""In a generator instance fed through vLLM's weight-transfer protocol (``protocol_feed``): the
trainer's messages made as vLLM's calls on the generator, between two engine steps (StreamRL §6).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProtocolReceiver"]


class ProtocolReceiver:
    """In the instance: the trainer's protocol messages, made as vLLM's calls on the
    generator between two steps. Returns what to tell the service."""

    def __init__(self, generator: Any, instance_id: int, policy: str) -> None:
        self.generator, self.instance_id, self.policy = generator, instance_id, policy

    def handle(self, message: tuple) -> tuple | None:
        """``("wt_init", generation, init_info)``: join the trainer's group (a version that
        cannot follow is reported lost); ``("wt_update", version, generation, update_info)``:
        receive and load it, then ``("updated", id, version)``."""
        kind, generation = message[0], message[1] if message[0] == "wt_init" else message[2]
        version = -1 if kind == "wt_init" else message[1]
        try:
            if kind == "wt_init":
                self.generator.init_weight_transfer_engine(message[2])
                return None
            self.generator.start_weight_update()
            self.generator.update_weights(message[3])
            self.generator.finish_weight_update(str(version))
        except Exception as err:  # the service decides: this instance is replaced
            reason = f"{type(err).__name__}: {err}"[:500]
            return ("weights_lost", self.instance_id, version, generation, reason)
        if self.policy == "recompute":
            self.generator.recompute_running()
        return ("updated", self.instance_id, version)
