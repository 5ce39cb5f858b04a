"""How long the trainer ranks wait for each other, scaled to the model.

Several trainer ranks wait on each other in three places, each with its own bound so that a dead
rank stops the run instead of hanging it: every collective (FSDP2's gathers and reductions, a
checkpoint's write), a launched rank's wait for rank 0 (which prepares the policy, starts the
generators and evaluates before the first step), and a rank's wait for its next share of samples
(rank 0 waits for the generators, and evaluates every ``rl.eval.every``). A fixed bound fits one
model size; each bound a run leaves unset (``null`` in ``trainer:``) is a base plus a share per GB
of the policy's weights, as the generation service's are (``streamrl.components.generation.
timeouts``).

Examples:
    >>> t = RankTimeouts.for_model(model_bytes=28e9, max_tokens=8192)
    >>> t.collective_s, t.prepare_s, t.share_s
    (1140.0, 5160.0, 46775.2)
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.errors import ConfigError


@dataclass(frozen=True)
class RankTimeouts:
    """The trainer ranks' timeouts, in seconds.

    Attributes:
        collective_s: one collective of the ranks (the default process group's timeout).
        prepare_s: a launched rank waits for rank 0 (policy, generators, first evaluation).
        share_s: a rank > 0 waits for its next share of samples.
    """

    collective_s: float = 300.0
    prepare_s: float = 1800.0
    share_s: float = 900.0

    @classmethod
    def for_model(
        cls,
        model_bytes: float,
        max_tokens: int,
        collective_s: float | None = None,
        prepare_s: float | None = None,
        share_s: float | None = None,
    ) -> RankTimeouts:
        """The defaults for a policy of ``model_bytes`` generating up to ``max_tokens``; a value
        given wins over its default.

        Raises:
            ConfigError: a given timeout is not positive.
        """
        gb = model_bytes / 1e9
        given = dict(collective_s=collective_s, prepare_s=prepare_s, share_s=share_s)
        for name, value in given.items():
            if value is not None and not value > 0:
                raise ConfigError(
                    f"trainer.{name.removesuffix('_s')}_timeout_s must be > 0 seconds, got "
                    f"{value}; leave it null for a default scaled to the model."
                )
        defaults = dict(
            collective_s=300.0 + 30.0 * gb,
            prepare_s=1800.0 + 120.0 * gb,
            share_s=900.0 + 0.2 * max_tokens * max(1.0, gb),
        )
        return cls(
            **{k: round(v if given[k] is None else given[k], 1) for k, v in defaults.items()}
        )
