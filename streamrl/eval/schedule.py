"""When a run evaluates its policy on the held-out set, and with what budget (``rl.eval``).

A run evaluates before RL (the starting weights), every ``every`` iterations while it trains
(``streamrl.eval.periodic.PeriodicEval``: logged as ``eval/*``, plotted to ``eval.png``) and
after RL, on its own generator instances (``streamrl.eval.on_generators``), with the engine,
chat handling and reward of training (docs/real-models.md, "Evaluation on the generators").

Examples:
    >>> EvalSchedule(every=20, k=4).budget(512)
    512
    >>> EvalSchedule(max_tokens=32).budget(512)
    32
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.errors import ConfigError


@dataclass(frozen=True)
class EvalSchedule:
    """The held-out evaluations of a run.

    Args:
        every: iterations between evaluations while training; 0: only before and after RL.
        k: samples per held-out prompt for pass@k, drawn at temperature 1 beside the greedy
            one (1: greedy pass@1 only). Single-turn runs: an episode run evaluates one greedy
            episode per held-out row.
        max_tokens: the decode budget of a held-out completion (of each turn of an episode),
            cut to what the context leaves; ``None``: the run's ``rl.rollouts.max_tokens``.

    Raises:
        ConfigError: ``every < 0``, ``k < 1`` or ``max_tokens < 1``.
    """

    every: int = 0
    k: int = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.every < 0 or self.k < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ConfigError(
                "EvalSchedule: need every >= 0 (0: before and after RL only), k >= 1 and "
                f"max_tokens >= 1 (or null), got every={self.every}, k={self.k}, "
                f"max_tokens={self.max_tokens}."
            )

    def budget(self, max_tokens: int) -> int:
        """A held-out completion's budget in a run whose samples get ``max_tokens``."""
        return self.max_tokens if self.max_tokens is not None else max_tokens
