"""RL algorithms as small classes with hooks that follow RL timing."""

from streamrl.algorithms.base import Algorithm, LossInputs, RewardError
from streamrl.algorithms.grpo import GRPO

#: Algorithms selectable by name from a config.
ALGORITHMS = {"grpo": GRPO}

__all__ = ["ALGORITHMS", "GRPO", "Algorithm", "LossInputs", "RewardError"]
