"""An episode task from a run's config: its environment factory, rows and demonstrations.

``env.name`` is a built-in (``ENVIRONMENTS``: the environment, a row maker, a demonstrator) or
``package.module:Name`` for your environment, whose rows then come from ``data.path`` (every
column reaches ``reset``) and whose demonstrations, for the tiny policy's warm start, from
``env.demonstrations``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamrl.errors import ConfigError
from streamrl.protocols import Environment
from streamrl.run.config import RunConfig
from streamrl.runtime.references import check_callable, construct, resolve

#: Built-in environments: (environment, rows(n, seed, prefix), demonstration(row)).
ENVIRONMENTS: dict[str, tuple[str, str, str]] = {
    "calculator": (
        "streamrl.envs.tool_tasks:CalculatorEnv",
        "streamrl.envs.tool_tasks:calculator_rows",
        "streamrl.envs.tool_tasks:calculator_demonstration",
    ),
    "blackjack": (
        "streamrl.tasks.text_games:BlackjackText",
        "streamrl.tasks.text_games:blackjack_rows",
        "streamrl.tasks.text_games:blackjack_demonstration",
    ),
}


@dataclass
class EpisodeTask:
    """What an episode run needs besides the policy.

    Attributes:
        make_env: makes one episode's environment.
        train / heldout: the rows (``prompt_id`` plus whatever ``reset`` reads).
        demonstrate: a good episode's turns for a row, or ``None`` (no warm start on episodes).
    """

    make_env: Callable[[], Environment]
    train: list[dict]
    heldout: list[dict]
    demonstrate: Callable[[Mapping[str, Any]], Sequence[str]] | None


def episode_task(config: RunConfig) -> EpisodeTask:
    """The task ``config.env`` names, checked (one environment is made and closed).

    Raises:
        ConfigError: an unknown environment, options it does not take, a custom environment
            without ``data.path`` rows, or demonstrations that are not ``fn(row)``.
    """
    env = config.env
    ref = ENVIRONMENTS[env.name][0] if env.name in ENVIRONMENTS else env.name
    factory = resolve(ref, kind="environment", builtins=ENVIRONMENTS, where="env.name")
    construct(factory, provided={}, options=env.options, where="env.options", call=False)
    make_env = functools.partial(factory, **env.options)
    demonstrate = None
    if env.name in ENVIRONMENTS:
        _, rows_ref, demo_ref = ENVIRONMENTS[env.name]
        make_rows = resolve(rows_ref, kind="rows", builtins={}, where="env.name")
        train = make_rows(env.n_train, seed=config.seed, prefix="train")
        heldout = make_rows(env.n_heldout, seed=config.seed + 10**6, prefix="heldout")
        demonstrate = resolve(demo_ref, kind="demonstrations", builtins={}, where="env.name")
    elif config.data.path:
        from streamrl.run.prepare import dataset_splits

        splits = dataset_splits(config)
        train, heldout = (list(split) for split in splits)
    else:
        raise ConfigError(
            f"env.name: {env.name!r} is your environment, so its rows come from your data: set "
            "data.path (each row's columns reach reset(row))."
        )
    if env.demonstrations is not None:
        demonstrate = resolve(
            env.demonstrations, kind="demonstrations", builtins={}, where="env.demonstrations"
        )
        check_callable(
            demonstrate, positional=1, where="env.demonstrations", what="fn(row) -> [turn, ...]"
        )
    probe = make_env()
    if not isinstance(probe, Environment):
        raise ConfigError(
            f"env.name: {env.name!r} made {type(probe).__name__}, which lacks reset/step/close "
            "(streamrl.protocols.Environment)."
        )
    probe.close()
    return EpisodeTask(make_env, train, heldout, demonstrate)
