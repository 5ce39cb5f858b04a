"""vLLM's four weight-sync calls made on several generator instances at once.

vLLM's trainer-side engines drive the inference side through a ``VLLMWeightSyncClient``: four
calls, "reach every replica, block until all done, raise on failure". StreamRL §6 sends one
version to every instance of the stream generation service: ``InstancesClient`` makes each call
on all of them in parallel, each waited with a timeout (a dead or stuck instance fails the call
with its name, never a hang: TRL #6797), and gives each instance its own ``rank_offset`` so one
broadcast reaches them all (SkyRL's ``BroadcastInitInfo.for_servers``, slime).

Examples:
    >>> class Instance:
    ...     def init_weight_transfer_engine(self, init_info): self.offset = init_info["rank_offset"]
    ...     def start_weight_update(self): pass
    ...     def update_weights(self, update_info): pass
    ...     def finish_weight_update(self, weight_version=None): pass
    >>> a, b = Instance(), Instance()
    >>> client = InstancesClient({"a": a, "b": b}, ranks={"a": 2})
    >>> client.init_weight_transfer_engine({"rank_offset": 1}); (a.offset, b.offset)
    (1, 3)
    >>> client.world_size
    4
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamrl.components.weights.transport import DEFAULT_TIMEOUT_S

__all__ = ["InstancesClient", "WeightSyncClient"]


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the four calls, on one instance or on all."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@dataclass
class InstancesClient:
    """vLLM's four calls on several instances at once: each in parallel on a thread, each
    waited with ``timeout_s``, so a dead or stuck instance fails the call with its name.

    ``init_weight_transfer_engine`` gives each instance its own ``rank_offset`` (1 + the ranks
    of the instances before it), so one broadcast reaches all of them.

    Args:
        instances: ``{name: client}``; a client has the four methods (one instance's
            ``VLLMStreamGenerator`` does, or an RPC stub to one).
        ranks: ``{name: tensor-parallel ranks}``; 1 for any not given.
        timeout_s: the longest one call may take on one instance.
    """

    instances: dict[str, WeightSyncClient]
    ranks: dict[str, int] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def world_size(self) -> int:
        """The group's members: the trainer's sending rank and every instance's ranks."""
        return 1 + sum(self.ranks.get(name, 1) for name in self.instances)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets, offset = {}, int(init_info.get("rank_offset", 1))
        for name in self.instances:
            offsets[name] = {**init_info, "rank_offset": offset}
            offset += self.ranks.get(name, 1)
        self._each(lambda name, c: c.init_weight_transfer_engine(offsets[name]), "init")

    def start_weight_update(self) -> None:
        self._each(lambda _, c: c.start_weight_update(), "start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each(lambda _, c: c.update_weights(update_info), "update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda _, c: c.finish_weight_update(weight_version), "finish_weight_update")

    def _each(self, call: Callable[[str, WeightSyncClient], None], what: str) -> None:
        pool = ThreadPoolExecutor(len(self.instances))
        try:
            futures: dict[str, Future] = {
                name: pool.submit(call, name, client) for name, client in self.instances.items()
            }
            for name, future in futures.items():
                try:
                    future.result(timeout=self.timeout_s)
                except FutureTimeout:
                    raise TimeoutError(
                        f"Weight sync: instance {name} did not finish {what} within "
                        f"{self.timeout_s:g} s (the weight timeout)."
                    ) from None
                except Exception as err:
                    raise RuntimeError(
                        f"Weight sync: instance {name} failed {what}: {err}"
                    ) from err
        finally:
            pool.shutdown(wait=False)  # a stuck call must not hold the caller
