"""How long the generation service waits for its instances, scaled to the model.

Fixed timeouts fit one model size: a 0.5B policy in float32 takes longer to load, to decode an
8k-token sample and to receive its weights than the test model, and several vLLM instances
compiling at once take longer still. Each timeout a run leaves unset (``null`` in ``rl:``) is a
base plus a share per GB of the policy's weights, so a run that is merely big is not taken for a
hung one, while a small one still fails fast.

Examples:
    >>> t = Timeouts.for_model(model_bytes=2e9, max_tokens=1024)
    >>> t.start_s, t.sample_s, t.heartbeat_s, t.weight_s
    (300.0, 504.8, 80.0, 180.0)
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.errors import ConfigError


@dataclass(frozen=True)
class Timeouts:
    """The service's timeouts, in seconds.

    Attributes:
        start_s: an instance starts and loads the model.
        sample_s: the longest wait for the next sample.
        heartbeat_s: an active instance silent this long is taken as hung.
        weight_s: one weight transfer (received, or passed on).
    """

    start_s: float = 180.0
    sample_s: float = 300.0
    heartbeat_s: float = 60.0
    weight_s: float = 120.0

    @classmethod
    def for_model(
        cls,
        model_bytes: float,
        max_tokens: int,
        start_s: float | None = None,
        sample_s: float | None = None,
        heartbeat_s: float | None = None,
        weight_s: float | None = None,
    ) -> Timeouts:
        """The defaults for a policy of ``model_bytes`` generating up to ``max_tokens``; a value
        given wins over its default.

        Raises:
            ConfigError: a given timeout is not positive.
        """
        gb = model_bytes / 1e9
        given = dict(start_s=start_s, sample_s=sample_s, heartbeat_s=heartbeat_s, weight_s=weight_s)
        for name, value in given.items():
            if value is not None and not value > 0:
                raise ConfigError(
                    f"rl.timeouts: {name} must be > 0 seconds, got {value}; leave it out for a "
                    "default scaled to the model."
                )
        defaults = dict(
            start_s=180.0 + 60.0 * gb,
            sample_s=300.0 + 0.1 * max_tokens * max(1.0, gb),
            heartbeat_s=60.0 + 10.0 * gb,
            weight_s=120.0 + 30.0 * gb,
        )
        return cls(
            **{k: round(v if given[k] is None else given[k], 1) for k, v in defaults.items()}
        )
