"""Partial rollout: what a generator instance does with its running sequences when new weights
arrive (beyond StreamRL §4.1, which trains each sample on one weight version).

Three policies (``rl.generation.partial_rollout``,
``StreamGenerationService(partial_rollout=...)``):

- ``"finish"``: every sample comes from one weight version. The instance finishes what runs, and
  the requests those weights may still admit, under the weights it holds, and loads the new
  ones once it is idle. This is one-step asynchronous RL as the paper has it, and the
  iteration's longest sample decides when the next weights load: the slots it does not use
  stay empty meanwhile (the tail bubble partial rollout removes).
- ``"keep"``: load between two decode steps; running sequences go on under the new weights
  with the key/value cache the old weights computed (as TRL's async trainer and OpenRLHF do).
- ``"recompute"``: load, then prefill every running sequence again, prompt and tokens so far,
  under the new weights (the re-prefill of verl's fully-async mode, AReaL and slime), which
  costs one prefill of the running sequences per update.

With ``"keep"`` and ``"recompute"`` a sample may span versions: each token carries the version
that drew it (``Sample.token_versions``), and the trainer corrects each token by its own
version (``streamrl.components.training.off_policy``). Admission pacing keeps every token
within the run's staleness bound (``Request.min_weight_version``): nothing is dropped for
being long.
"""

from __future__ import annotations

from typing import Any, Literal

from streamrl.errors import ConfigError
from streamrl.protocols import RecomputingGenerator, StreamGenerator

PartialRollout = Literal["finish", "keep", "recompute"]
PARTIAL_ROLLOUT: tuple[str, ...] = ("finish", "keep", "recompute")


def check_partial_rollout(policy: str) -> str:
    """``policy`` if it is one of ``PARTIAL_ROLLOUT``; a ``ConfigError`` saying the choices
    otherwise."""
    if policy not in PARTIAL_ROLLOUT:
        raise ConfigError(
            f"partial_rollout: {policy!r} is not a policy; choose one of "
            f"{', '.join(PARTIAL_ROLLOUT)} (finish: running sequences finish under their "
            "weights, each sample from one version; keep: they go on under new weights with "
            "their cache; recompute: their cache is computed again under the new weights)."
        )
    return policy


class WeightLoader:
    """Received weight versions waiting to be loaded into one instance's generator.

    ``offer`` hands over a received version (the instance's ``StagedWeights``, which holds the
    newest one received); ``apply`` loads what the policy allows now and returns the versions
    loaded (each is announced to the service). With ``"finish"`` nothing loads until the
    generator is idle; then only the newest version is copied in (the older ones are
    announced too: the instance has moved past them). The engine loads straight from the staging's
    buffers (views, no copy); while the next version is being received into them, loading
    waits for it.
    """

    def __init__(self, generator: StreamGenerator, policy: str = "finish") -> None:
        self.generator, self.policy = generator, check_partial_rollout(policy)
        if policy == "recompute" and not isinstance(generator, RecomputingGenerator):
            raise ConfigError(
                f"partial_rollout: recompute needs a RecomputingGenerator "
                f"(streamrl.protocols: recompute_running()); {type(generator).__name__} is not "
                "one. Use keep or finish."
            )
        self._pending: list[int] = []
        self._staged: Any = None
        self.loaded_version = -1

    def offer(self, version: int, staged: Any) -> None:
        self._pending.append(version)
        self._staged = staged

    def apply(self) -> list[int]:
        if not self._pending or (self.policy == "finish" and not self.generator.idle):
            return []
        staged = self._staged
        if not staged.lock.acquire(blocking=False):  # the next version is arriving: after it
            return []
        try:
            newest = staged.version
            if newest is not None and newest > self.loaded_version:
                self.generator.load_weights(dict(staged.named()), newest)
                self.loaded_version = newest
                if self.policy == "recompute":
                    self.generator.recompute_running()  # counted in each sample's prefill_tokens
        finally:
            staged.lock.release()
        versions = [v for v in self._pending if v <= self.loaded_version]
        self._pending = [v for v in self._pending if v > self.loaded_version]
        return versions
