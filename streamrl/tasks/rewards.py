"""Rule-based rewards on decoded completions (the paper trains with a rule-based reward, §7)."""

from __future__ import annotations

from typing import Literal

from streamrl.errors import ConfigError, unknown_name
from streamrl.protocols import RewardFn  # defined once there; re-exported for streamrl.tasks

RewardName = Literal["exact", "partial"]


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer exactly, else 0.0.

    Examples:
        >>> exact_match("1 2 3", "1 2 3"), exact_match("1 2 3 ", "1 2 3")
        (1.0, 0.0)
    """
    return 1.0 if completion == answer else 0.0


def partial_credit(completion: str, answer: str) -> float:
    """Share of positions that match, over the longer of the two strings.

    Too long and too short are both penalised, so the reward also teaches the right length.

    Examples:
        >>> partial_credit("abcd", "abxd"), partial_credit("ab", "abcd"), partial_credit("", "")
        (0.75, 0.5, 1.0)
    """
    longest = max(len(completion), len(answer))
    if longest == 0:
        return 1.0
    hits = sum(c == a for c, a in zip(completion, answer))
    return hits / longest


#: Built-in rewards by config name (``rl.reward``); each returns a float in [0, 1].
REWARDS: dict[str, RewardFn] = {"exact": exact_match, "partial": partial_credit}


def get_reward(name: str) -> RewardFn:
    """Look up a built-in reward by name.

    Raises:
        ConfigError: unknown name; the message lists the known ones.
    """
    if name not in REWARDS:
        raise ConfigError(unknown_name("reward", name, REWARDS))
    return REWARDS[name]
