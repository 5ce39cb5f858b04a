"""Verifiable RL tasks with long-tailed, prompt-determined output lengths, and their rewards."""

from streamrl.tasks.families import FAMILIES, TaskFamily
from streamrl.tasks.prompt_sets import (
    check_tasks,
    load_prompt_file,
    long_tail_lengths,
    make_prompt_set,
    make_splits,
)
from streamrl.tasks.rewards import REWARDS, RewardFn, exact_match, get_reward, partial_credit

__all__ = [
    "FAMILIES",
    "REWARDS",
    "RewardFn",
    "TaskFamily",
    "check_tasks",
    "exact_match",
    "get_reward",
    "load_prompt_file",
    "long_tail_lengths",
    "make_prompt_set",
    "make_splits",
    "partial_credit",
]
