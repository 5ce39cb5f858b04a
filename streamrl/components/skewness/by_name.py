"""Dispatchers and admission schedulers by the names a config uses (StreamRL §5.3).

A run (``rl.dispatcher``, ``rl.scheduler``) and the simulator (``SimConfig.dispatch`` and
``admission``, ``streamrl simulate --run_config``) build them here, from the same values: a
built-in's short name, ``package.module.Name`` for your own class, or ``{class_path: ...,
init_args: {option: value}}`` that adds constructor arguments. So a dispatcher of yours runs in
the simulator with no edit.

Each is built by ``build_from_run`` (``streamrl.components.run_context``): ``from_run(run,
**options)`` where the class defines it (``SkewAwareDispatcher`` takes the run's batch size and
``PTL(BS)`` there, ``RandomDispatcher`` its seed), else ``Cls(**options)``.

Examples:
    >>> type(build_dispatcher("round_robin", RunContext(max_batch_size=8))).__name__
    'RoundRobinDispatcher'
    >>> type(scheduler_factory({"class_path": "lpt"})()).__name__
    'LPTScheduler'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from streamrl.components.run_context import RunContext, build_from_run
from streamrl.components.skewness.adaptive import AdaptiveDispatcher
from streamrl.components.skewness.dispatch import RandomDispatcher, RoundRobinDispatcher
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.protocols import AdmissionScheduler, Dispatcher
from streamrl.runtime.references import checked, construct, pick

#: Built-ins by the short name a config uses.
DISPATCHERS: dict[str, type] = {
    "skew": SkewAwareDispatcher,
    "adaptive": AdaptiveDispatcher,
    "round_robin": RoundRobinDispatcher,
    "random": RandomDispatcher,
}
SCHEDULERS: dict[str, type] = {"lpt": LPTScheduler, "fifo": FIFOScheduler}

#: A config value naming one: a short name, ``package.module.Name``, or ``{class_path, init_args}``.
ComponentName = str | Mapping[str, Any]


def build_dispatcher(
    value: ComponentName, run: RunContext, where: str = "rl.dispatcher"
) -> Dispatcher:
    """The dispatcher ``value`` names, built for ``run``.

    Raises:
        ConfigError: an unknown name, an option it does not take, or an object that is not a
            ``Dispatcher``.
    """
    factory, options = pick(value, kind="dispatcher", builtins=DISPATCHERS, where=where)
    return checked(build_from_run(factory, run, options, where=where), Dispatcher, where)


def scheduler_factory(
    value: ComponentName, where: str = "rl.scheduler"
) -> Callable[[], AdmissionScheduler]:
    """What makes each instance's admission queue (one per instance), checked on one queue.

    Raises:
        ConfigError: an unknown name, an option it does not take, or a queue that is not an
            ``AdmissionScheduler``.
    """
    factory, options = pick(value, kind="scheduler", builtins=SCHEDULERS, where=where)
    checked(
        construct(factory, provided={}, options=options, where=where), AdmissionScheduler, where
    )
    return partial(factory, **options)
