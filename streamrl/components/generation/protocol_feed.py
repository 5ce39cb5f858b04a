"""Generator instances fed through vLLM's weight-transfer protocol (StreamRL §6, on vLLM's rails).

With ``weight_protocol=True`` (``StreamGenerationService``; vLLM instances, partial rollout
``keep`` or ``recompute``) each version reaches an instance through vLLM's own four calls
(``streamrl.components.weights.vllm_protocol``), not through a host staging of its own:

- on the trainer, ``ProtocolLink`` is the instance's group in ``AsyncWeightSync``: at its first
  version it builds the trainer's engine through vLLM's factory, on the instance's rendezvous
  store and feed generation (``feeding``), and sends each version from the trainer's staging
  (its buckets as they are);
- the calls reach the instance as messages on its inbox (``InboxInstance``), and in the instance
  ``ProtocolReceiver`` makes them on its generator between two engine steps: join the group,
  then per version ``start_weight_update``, ``update_weights`` (beside the trainer's broadcast)
  and ``finish_weight_update(version)``. Running sequences keep their KV cache (vLLM's ``keep``),
  or are prefilled again (``recompute``); each token's version comes from vLLM's spans.

An instance that fails to take a version reports it (``weights_lost``) and is replaced, as with the
staging path; the trainer's side of a failed group is dropped (``AsyncWeightSync.failed``).
The ``finish`` policy (load once idle) keeps the host staging: with the protocol the trainer's
send would wait for the instance to drain.
"""

from __future__ import annotations

from typing import Any

from streamrl.components.generation.instance import InstanceHandle
from streamrl.components.weights.instances_client import InstancesClient
from streamrl.errors import ConfigError

__all__ = ["InboxInstance", "ProtocolLink", "check_weight_protocol"]


def check_weight_protocol(engine: Any, partial_rollout: str) -> None:
    """Raise ``ConfigError`` unless an instance of ``engine`` can take weights through vLLM's
    protocol under ``partial_rollout``."""
    if not getattr(engine, "speaks_weight_protocol", False):
        raise ConfigError(
            f"weight_protocol needs vLLM instances (rl.engine: vllm); {type(engine).__name__} "
            "takes weights from its host staging. Leave weight_protocol off."
        )
    if partial_rollout == "finish":
        raise ConfigError(
            "weight_protocol loads each version between two engine steps (partial_rollout keep "
            "or recompute); with finish an instance loads once idle, from its host staging. "
            "Choose partial_rollout: keep, or leave weight_protocol off."
        )


class InboxInstance:
    """vLLM's four calls on one instance process, as messages on its inbox (the instance makes
    them on its generator, in order, between two steps). They return at once: the broadcast is
    where both sides meet, and an instance that fails reports ``weights_lost``."""

    def __init__(self, handle: InstanceHandle, link: ProtocolLink) -> None:
        self.handle, self.link = handle, link

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.handle.inbox.put(("wt_init", self.link.generation, init_info))

    def start_weight_update(self) -> None:
        """Nothing to send: the instance starts the update when the update arrives."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.handle.inbox.put(("wt_update", self.link.version, self.link.generation, update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing to send: the instance finishes once every bucket arrived."""


class ProtocolLink:
    """One instance's group in ``AsyncWeightSync``, on vLLM's protocol: ``announce(version)``
    then ``broadcast(buffers)`` send a version from the trainer's staging.

    Args:
        handle: the instance (its inbox, rendezvous store and process).
        sync: the weight sync (its ``staged`` version is what is sent).
        generation: the instance's feed generation (``WeightFeeds``).
        timeout_s: the group's rendezvous and per-bucket timeout.
        ranks: the instance's tensor-parallel ranks (each a member of the group).
    """

    #: Each instance is a group of its own: ``AsyncWeightSync`` sends to them side by side.
    concurrent = True

    def __init__(
        self, handle: InstanceHandle, sync: Any, generation: int, timeout_s: float, ranks: int = 1
    ) -> None:
        self.handle, self.sync, self.generation = handle, sync, generation
        self.timeout_s, self.ranks = timeout_s, ranks
        self.version = -1
        self.engine: Any = None

    def announce(self, version: int) -> None:
        self.version = version

    def broadcast(self, buffers: list) -> int:
        from streamrl.components.weights.vllm_protocol import StagedSource, trainer_engine

        staged = self.sync.staged
        if self.engine is None:  # connected at its first version, as the staging path does
            name = f"{self.handle.instance_id}"
            client = InstancesClient(
                {name: InboxInstance(self.handle, self)}, {name: self.ranks}, self.timeout_s
            )
            self.engine = trainer_engine(
                StagedSource(staged),
                client,
                bucket_bytes=self.sync.bucket_bytes,
                timeout_s=self.timeout_s,
                store=self.handle.store,
                generation=self.generation,
                abandon=self._gone,
            )
        self.engine.source = StagedSource(staged)
        # a version to verify: the instance digests what it loads (``AsyncWeightSync.verifies``)
        self.engine.send_weights(str(self.version), digests=self.sync.verifies(self.version))
        return staged.nbytes

    def _gone(self) -> str | None:
        if self.handle.state == "failed" or self.handle.proc.exitcode is not None:
            return f"instance {self.handle.instance_id} is gone"
        return None
