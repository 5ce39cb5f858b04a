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

One broadcast reaches every instance (``SharedBroadcast``: a ``rank_offset`` each, the trainer's
egress one model copy per version whatever their number). Its size is fixed when it forms, so it
forms again at the first version after the instances changed; a newcomer first catches up alone,
on a group of its own (``ProtocolLink``), from the staging. When a shared broadcast fails, the
version is sent again on each instance's own group: an instance that fails there reports it
(``weights_lost``) and is replaced, as with the staging path (the trainer's side of its group is
dropped, ``AsyncWeightSync.failed``); the others, which waited for it, are not.
The ``finish`` policy (load once idle) keeps the host staging: with the protocol the trainer's
send would wait for the instance to drain.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from streamrl.components.generation.instance import InstanceHandle
from streamrl.components.generation.messages import ProtocolInit, ProtocolUpdate
from streamrl.components.weights.instances_client import InstancesClient
from streamrl.components.weights.transport import make_store
from streamrl.errors import ConfigError

__all__ = ["InboxInstance", "ProtocolLink", "SharedBroadcast", "check_weight_protocol", "gone"]

#: How much longer than a broadcast's timeout a version sent again may take to meet: the
#: instances first wait out the failed broadcast.
RESEND_PATIENCE = 2.0


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
    where both sides meet, and an instance that fails reports ``weights_lost`` (or, in a
    ``shared`` broadcast, waits for the version to come again on its own group)."""

    def __init__(self, handle: InstanceHandle, link: ProtocolLink, shared: bool = False) -> None:
        self.handle, self.link, self.shared = handle, link, shared

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.handle.inbox.put(ProtocolInit(self.link.generation, init_info, self.shared))

    def start_weight_update(self) -> None:
        """Nothing to send: the instance starts the update when the update arrives."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        link = self.link
        self.handle.inbox.put(
            ProtocolUpdate(link.version, link.generation, update_info, self.shared)
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing to send: the instance finishes once every bucket arrived."""


class ProtocolLink:
    """One instance's group in ``AsyncWeightSync``, on vLLM's protocol: ``announce(version)``,
    then the ``hub`` sends the version to every instance at once; alone (a newcomer's catch-up,
    a single instance, a version sent again) ``broadcast(buffers)`` sends it on a group of its
    own, from the trainer's staging.

    Args:
        handle: the instance (its inbox, rendezvous store and process).
        sync: the weight sync (its ``staged`` version is what is sent).
        generation: the instance's feed generation (``WeightFeeds``).
        timeout_s: the group's rendezvous and per-bucket timeout.
        ranks: the instance's tensor-parallel ranks (each a member of the group).
        hub: the broadcast shared by every instance of the service (``None``: always alone).
    """

    #: Each instance alone is a group of its own: ``AsyncWeightSync`` sends to them side by side.
    concurrent = True

    def __init__(
        self,
        handle: InstanceHandle,
        sync: Any,
        generation: int,
        timeout_s: float,
        ranks: int = 1,
        hub: SharedBroadcast | None = None,
    ) -> None:
        self.handle, self.sync, self.generation = handle, sync, generation
        self.timeout_s, self.ranks, self.hub = timeout_s, ranks, hub
        self.version = -1
        self.engine: Any = None
        self.attempt = 0  # its own group formed again (after the instance was in a shared one)

    def announce(self, version: int) -> None:
        self.version = version

    def broadcast(self, buffers: list, patience: float = 1.0) -> int:
        """Send the staged version on this instance's own group (formed at its first use,
        with ``patience`` times the timeout to meet); returns the bytes sent."""
        from streamrl.components.weights.vllm_protocol import StagedSource, trainer_engine

        staged = self.sync.staged
        if self.engine is None:  # connected at its first version, as the staging path does
            name = f"{self.handle.instance_id}"
            client = InstancesClient(
                {name: InboxInstance(self.handle, self)},
                {name: self.ranks},
                self.timeout_s * patience,
            )
            self.engine = trainer_engine(
                StagedSource(staged),
                client,
                bucket_bytes=self.sync.bucket_bytes,
                timeout_s=self.timeout_s * patience,
                store=self.handle.store,
                generation=self.generation,
                attempt=self.attempt,
                abandon=lambda: gone([self.handle]),
            )
        self.engine.source = StagedSource(staged)
        # a version to verify: the instance digests what it loads (``AsyncWeightSync.verifies``)
        self.engine.send_weights(str(self.version), digests=self.sync.verifies(self.version))
        return staged.nbytes

    def leave_own_group(self) -> None:
        """The instance joins a shared broadcast (its engine's one group): this one is gone,
        and forms again under new keys if needed."""
        if self.engine is not None:
            self.engine, self.attempt = None, self.attempt + 1


class SharedBroadcast:
    """One broadcast from the trainer reaching every instance fed through vLLM's protocol, each
    with its own ``rank_offset`` (``InstancesClient``; SkyRL's ``for_servers``, slime): one
    model copy leaves the trainer per version, whatever the number of instances (StreamRL §6).

    The group's size is fixed when it forms, so it forms again (every member joins, a new
    generation on a store the trainer hosts) at the first version after the members changed.
    A newcomer has caught up alone by then, on its own group, from the staging (``add_group``).
    A shared broadcast that fails (a member died or is stuck) is sent again on each member's own
    group, side by side: the member at fault fails there alone and is replaced; the others waited
    for it (``ProtocolReceiver``) and are not.

    Attributes:
        formed_s: the seconds each forming took (until every member had joined).
        alone_s: ``(version, seconds)`` of each version sent to one instance alone (a
            newcomer's catch-up, or the only instance).
        resent: ``(version, why)`` of each version sent again member by member.
    """

    def __init__(self, sync: Any, timeout_s: float) -> None:
        self.sync, self.timeout_s = sync, timeout_s
        self.store: Any = None
        self.generation = 0
        self.members: tuple[int, ...] = ()
        self.engine: Any = None
        self.formed_s: list[float] = []
        self.alone_s: list[tuple[int, float]] = []
        self.resent: list[tuple[int, str]] = []

    def send(
        self, version: int, links: dict[int, ProtocolLink], buffers: list
    ) -> dict[int, int | BaseException]:
        """Send the staged ``version`` to every instance of ``links`` (announced already):
        the bytes that left the trainer for each, or why it failed. Never raises."""
        from streamrl.components.weights.vllm_protocol import StagedSource

        if len(links) == 1:  # a newcomer's catch-up, or a single instance: its own group
            started = time.perf_counter()
            outcomes = _alone(links, buffers)
            self.alone_s.append((version, time.perf_counter() - started))
            return outcomes
        staged = self.sync.staged
        try:
            if tuple(sorted(links)) != self.members or self.engine is None:
                self._form(links)
            self.engine.source = StagedSource(staged)
            self.engine.send_weights(str(version), digests=self.sync.verifies(version))
        except Exception as err:
            self.engine, self.members = None, ()  # the instances see its end
            self.resent.append((version, f"{type(err).__name__}: {err}"[:300]))
            return _alone(links, buffers, RESEND_PATIENCE)
        first = min(links)
        return {key: staged.nbytes if key == first else 0 for key in links}

    def _form(self, links: dict[int, ProtocolLink]) -> None:
        from streamrl.components.weights.vllm_protocol import StagedSource, trainer_engine

        started = time.perf_counter()
        self.engine, self.members = None, ()
        if self.store is None:
            self.store = make_store(1 + len(links), self.timeout_s)
        self.generation += 1
        instances: dict[str, InboxInstance] = {}
        ranks: dict[str, int] = {}
        for key in sorted(links):
            link = links[key]
            link.leave_own_group()
            instances[str(key)] = InboxInstance(link.handle, link, shared=True)
            ranks[str(key)] = link.ranks
        handles = [link.handle for link in links.values()]
        self.engine = trainer_engine(
            StagedSource(self.sync.staged),
            InstancesClient(instances, ranks, self.timeout_s),
            bucket_bytes=self.sync.bucket_bytes,
            timeout_s=self.timeout_s,
            store=self.store,
            generation=self.generation,
            abandon=lambda: gone(handles),
        )
        self.members = tuple(sorted(links))
        self.formed_s.append(time.perf_counter() - started)


def _alone(
    links: dict[int, ProtocolLink], buffers: list[torch.Tensor], patience: float = 1.0
) -> dict[int, int | BaseException]:
    """Each instance on its own group, side by side: the bytes sent, or why it failed."""
    outcomes: dict[int, int | BaseException] = {}
    with ThreadPoolExecutor(len(links)) as pool:
        futures = {
            key: pool.submit(link.broadcast, buffers, patience) for key, link in links.items()
        }
        for key, future in futures.items():
            try:
                outcomes[key] = future.result()
            except Exception as err:
                outcomes[key] = err
    return outcomes


def gone(handles: Sequence[InstanceHandle]) -> str | None:
    """Why to stop waiting for these instances (one failed or exited), or ``None``."""
    for handle in handles:
        if handle.state == "failed" or handle.proc.exitcode is not None:
            return f"instance {handle.instance_id} is gone"
    return None
