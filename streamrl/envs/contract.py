"""What an environment's ``reset`` and ``step`` must return, checked the same way wherever they
run: the RL episodes (``EpisodeRunner``) and the warm start's demonstrated ones (``demo_tokens``).

``reset`` gives the first prompt: a non-blank string, or chat messages (``{"role": ...,
"content": ...}``) with some non-blank text besides the system's. ``step`` gives a ``Step`` with
a finite reward and, unless ``done``, a string observation. Anything else is an ``EnvError``
naming the environment, the method, the prompt, what came back and what is expected.

Examples:
    >>> check_reset(object(), "Guess the word.", "q1")
    'Guess the word.'
    >>> check_reset(object(), "  ", "q1")
    Traceback (most recent call last):
    ...
    streamrl.errors.EnvError: object.reset returned an empty first prompt '  ' for prompt 'q1'; \
return the first prompt, a non-blank string or chat messages with some text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from streamrl.errors import EnvError
from streamrl.records import Step

#: What ``reset`` must return, as the errors say it.
RESET_EXPECTED = "return the first prompt, a non-blank string or chat messages with some text."
#: What ``step`` must return, as the errors say it.
STEP_EXPECTED = (
    "return streamrl.Step(observation: str, reward: float, done: bool) (an observation is "
    "needed unless done)."
)


def env_name(env: object) -> str:
    """The environment's class name, as errors give it (a ``RemoteEnv``'s is its own)."""
    return getattr(env, "env_name", None) or type(env).__name__


def check_reset(env: object, prompt: Any, prompt_id: Any) -> str | list[dict]:
    """``prompt``, what ``env.reset`` returned for ``prompt_id``, if it is a first prompt.

    Raises:
        EnvError: it is not a string or chat messages, or it has no text (blank).
    """
    problem = _reset_problem(prompt)
    if problem is not None:
        raise EnvError(
            f"{env_name(env)}.reset {problem} for prompt {prompt_id!r}; {RESET_EXPECTED}"
        )
    return prompt


def check_step(env: object, step: Any, prompt_id: Any) -> Step:
    """``step``, what ``env.step`` returned in an episode of ``prompt_id``, if it is a valid
    ``Step``.

    Raises:
        EnvError: it is not a ``Step``, its reward is not a finite number, or it has no string
            observation while not done.
    """
    problem = None
    if not isinstance(step, Step):
        problem = f"returned {type(step).__name__} {short_repr(step)}"
    elif not isinstance(step.reward, int | float) or not math.isfinite(step.reward):
        problem = f"returned the reward {step.reward!r}"
    elif not step.done and not isinstance(step.observation, str):
        problem = f"returned done=False with the observation {step.observation!r}"
    if problem is not None:
        raise EnvError(f"{env_name(env)}.step {problem} on prompt {prompt_id!r}; {STEP_EXPECTED}")
    return step


def _reset_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else f"returned an empty first prompt {prompt!r}"
    if not isinstance(prompt, list):
        return f"returned {type(prompt).__name__} {short_repr(prompt)}"
    if not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt):
        return f"returned a list that is not chat messages ({short_repr(prompt)})"
    texts = [m["content"] for m in prompt if m["role"] != "system"]
    if not any(not isinstance(text, str) or text.strip() for text in texts):
        return f"returned chat messages without text besides the system's ({short_repr(prompt)})"
    return None


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (for one-line errors)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
