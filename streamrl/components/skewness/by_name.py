"""Dispatchers and admission schedulers by the names a config uses (StreamRL §5.3).

A run (``rl.dispatcher``, ``rl.scheduler``) and the simulator (``SimConfig.dispatch`` and
``admission``, ``streamrl simulate --run_config``) build them here, from the same values: a
built-in's short name, ``package.module:Name`` for your own class, or a mapping
``{name: ..., option: value}`` that adds constructor options. So a dispatcher of yours runs in
the simulator with no edit.

A dispatcher is given what it names among its constructor's parameters: ``latency`` (the
``PTL(BS)`` model, Eq. 1), ``max_batch_size`` and ``seed``.

Examples:
    >>> type(build_dispatcher("round_robin", latency=None, max_batch_size=8, seed=0)).__name__
    'RoundRobinDispatcher'
    >>> type(scheduler_factory({"name": "lpt"})()).__name__
    'LPTScheduler'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from streamrl.components.skewness.dispatch import RandomDispatcher, RoundRobinDispatcher
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.schedulers import FIFOScheduler, LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.protocols import AdmissionScheduler, Dispatcher
from streamrl.runtime.references import checked, construct, pick

#: Built-ins by the short name a config uses.
DISPATCHERS: dict[str, type] = {
    "skew": SkewAwareDispatcher,
    "round_robin": RoundRobinDispatcher,
    "random": RandomDispatcher,
}
SCHEDULERS: dict[str, type] = {"lpt": LPTScheduler, "fifo": FIFOScheduler}

#: A config value naming one: a short name, ``package.module:Name``, or ``{name: ..., **options}``.
ComponentName = str | Mapping[str, Any]


def build_dispatcher(
    value: ComponentName,
    *,
    latency: LatencyModel | None,
    max_batch_size: int,
    seed: int,
    where: str = "rl.dispatcher",
    call: bool = True,
) -> Dispatcher | None:
    """The dispatcher ``value`` names, given what its constructor asks for; ``call=False`` only
    checks that it resolves and that its constructor would bind (returns ``None``).

    Raises:
        ConfigError: an unknown name, an option it does not take, or an object that is not a
            ``Dispatcher``.
    """
    factory, options = pick(value, kind="dispatcher", builtins=DISPATCHERS, where=where)
    provided = dict(latency=latency, max_batch_size=max_batch_size, seed=seed)
    dispatcher = construct(factory, provided=provided, options=options, where=where, call=call)
    return checked(dispatcher, Dispatcher, where) if call else None


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
