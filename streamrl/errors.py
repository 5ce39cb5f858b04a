"""Errors that say what was wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration or input problem found before any work starts."""


class NonFiniteLossError(FloatingPointError):
    """A micro-batch's loss was NaN or infinite; names the iteration and the samples. The run
    stops before the optimizer step, so the weights (and any checkpoint) stay finite."""


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> str:
    """A message for an unknown name, with a "did you mean" when one is close.

    Examples:
        >>> unknown_name("task", "cnt", ["copy", "count"])
        "Unknown task 'cnt' (did you mean 'count'?). Known: copy, count."
    """
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"Unknown {kind} {name!r}{hint}. Known: {', '.join(choices)}."


class RewardError(ValueError):
    """A reward function failed, hung or returned something that is not a finite number; the
    message names the reward and the prompt."""


class EnvError(RuntimeError):
    """An environment broke its contract (a malformed step, a reset that raised); the message
    names the environment, the prompt and what it must return."""


class TrainerRankError(RuntimeError):
    """A trainer rank died (killed, out of memory, crashed): the whole run stopped, every child
    process with it; it resumes from its last checkpoint."""
