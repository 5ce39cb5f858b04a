"""RL algorithms as small classes with hooks that follow RL timing (docs/algorithms.md)."""

from __future__ import annotations

from typing import Any

from streamrl.algorithms.base import Algorithm, LossInputs, RunFacts, TokenLoss
from streamrl.algorithms.grpo import DAPO, GRPO
from streamrl.algorithms.ppo import PPO
from streamrl.algorithms.reinforce_pp import ReinforcePlusPlus, ReinforcePlusPlusBaseline
from streamrl.algorithms.rloo import RLOO
from streamrl.errors import ConfigError, RewardError, unknown_name

#: Algorithms selectable by name from a config (``rl.algorithm``). ``build_algorithm`` builds
#: each with its ``from_run``, which takes what the algorithm needs from the run's facts.
ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": GRPO,
    "rloo": RLOO,
    "reinforce++": ReinforcePlusPlus,
    "reinforce++-baseline": ReinforcePlusPlusBaseline,
    "ppo": PPO,
    "dapo": DAPO,
}


def build_algorithm(algorithm: str | type[Algorithm], run: RunFacts, **options: Any) -> Algorithm:
    """Build an algorithm for a run: ``cls.from_run(run, **options)``.

    Each algorithm takes from ``run`` what it needs (``Algorithm.from_run``); nothing here depends
    on which one it is.

    Args:
        algorithm: a key of ``ALGORITHMS`` (a config's ``rl.algorithm``) or an ``Algorithm``
            subclass.
        run: the run's facts (group size, generation budget, hidden size, prompts per
            iteration).
        **options: further constructor arguments of the algorithm.

    Raises:
        ConfigError: unknown name (with a "did you mean").
        TypeError: ``algorithm`` is neither a name nor an ``Algorithm`` subclass.
        ValueError: the algorithm rejects the run's facts (e.g. GRPO with ``group_size`` 1).

    Examples:
        >>> run = RunFacts(group_size=4, max_tokens=64, hidden_size=32, prompts_per_iteration=8)
        >>> build_algorithm("dapo", run).max_tokens
        64
        >>> build_algorithm(ReinforcePlusPlus, run).moments.decay  # 1 - 1 / 32
        0.96875
    """
    if isinstance(algorithm, str):
        if algorithm not in ALGORITHMS:
            raise ConfigError(unknown_name("algorithm", algorithm, ALGORITHMS))
        cls = ALGORITHMS[algorithm]
    elif isinstance(algorithm, type) and issubclass(algorithm, Algorithm):
        cls = algorithm
    else:
        raise TypeError(
            f"{algorithm!r} is not a subclass of streamrl.algorithms.Algorithm nor a name of "
            "ALGORITHMS; subclass it and override the hooks you change (docs/algorithms.md)."
        )
    return cls.from_run(run, **options)


__all__ = [
    "ALGORITHMS",
    "DAPO",
    "GRPO",
    "PPO",
    "RLOO",
    "Algorithm",
    "LossInputs",
    "ReinforcePlusPlus",
    "ReinforcePlusPlusBaseline",
    "RewardError",
    "RunFacts",
    "TokenLoss",
    "build_algorithm",
]
