"""RL algorithms as small classes with hooks that follow RL timing (docs/algorithms.md)."""

from __future__ import annotations

from collections.abc import Callable

from streamrl.algorithms.base import Algorithm, LossInputs, RewardError
from streamrl.algorithms.grpo import GRPO, dapo
from streamrl.algorithms.ppo import PPO
from streamrl.algorithms.reinforce_pp import ReinforcePlusPlus, reinforce_pp_baseline
from streamrl.algorithms.rloo import RLOO
from streamrl.errors import ConfigError, unknown_name
from streamrl.tasks.rewards import RewardFn

#: Algorithms selectable by name from a config (``rl.algorithm``). Each is called as
#: ``(reward_fn, group_size=..., clip_eps=..., kl_coef=..., **extra)``; ``build_algorithm`` knows
#: the extras.
ALGORITHMS: dict[str, Callable[..., Algorithm]] = {
    "grpo": GRPO,
    "rloo": RLOO,
    "reinforce++": ReinforcePlusPlus,
    "reinforce++-baseline": reinforce_pp_baseline,
    "ppo": PPO,
    "dapo": dapo,
}


def build_algorithm(
    name: str,
    reward_fn: RewardFn,
    *,
    group_size: int,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    max_tokens: int,
    hidden_size: int,
    samples_per_iteration: int,
) -> Algorithm:
    """Build the algorithm a config names, giving each the run facts it needs.

    Args:
        name: a key of ``ALGORITHMS``.
        reward_fn: rule-based reward.
        group_size: samples per prompt (shared by every algorithm).
        clip_eps: PPO clip range (shared by every algorithm).
        kl_coef: weight of the KL penalty (shared by every algorithm).
        max_tokens: the generation budget (DAPO's token-level loss and overlong penalty).
        hidden_size: the policy's hidden size (PPO's value head).
        samples_per_iteration: prompts x group size (REINFORCE++'s normalisation window).

    Raises:
        ConfigError: unknown name (with a "did you mean").
    """
    if name not in ALGORITHMS:
        raise ConfigError(unknown_name("algorithm", name, ALGORITHMS))
    extra: dict[str, int] = {
        "dapo": {"max_tokens": max_tokens},
        "ppo": {"hidden_size": hidden_size},
        "reinforce++": {"norm_window": samples_per_iteration},
        "reinforce++-baseline": {"norm_window": samples_per_iteration},
    }.get(name, {})
    return ALGORITHMS[name](
        reward_fn, group_size=group_size, clip_eps=clip_eps, kl_coef=kl_coef, **extra
    )


__all__ = [
    "ALGORITHMS",
    "GRPO",
    "PPO",
    "RLOO",
    "Algorithm",
    "LossInputs",
    "ReinforcePlusPlus",
    "RewardError",
    "build_algorithm",
    "dapo",
    "reinforce_pp_baseline",
]
