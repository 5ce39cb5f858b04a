"""The run's swappable parts by config key: the built-ins each takes by short name, and the one
spelling a config holds them in.

``rl.algorithm``, ``rl.engine``, ``rl.cluster``, ``rl.dispatcher``, ``rl.scheduler``,
``rl.length_predictor`` and ``rl.elastic`` each take a built-in's short name, your class's
import path (``package.module.Name`` or ``package.module:Name``), or LightningCLI's form with
its constructor's arguments::

    rl:
      dispatcher:
        class_path: my_lab.dispatch.TailFirst     # or a built-in: skew
        init_args: {tail_share: 0.2}

``RLConfig`` holds every one of them as ``{class_path: <full import path>, init_args: {...}}``
(``canonical``), so two spellings of one part are one config, and ``streamrl fit
--print_config`` writes what runs. The parts are built from these values in
``streamrl.run.parts``; the simulator builds its dispatcher and scheduler from the same values
(``streamrl.components.skewness.by_name``).

Examples:
    >>> canonical("scheduler", "lpt")
    {'class_path': 'streamrl.components.skewness.schedulers.LPTScheduler', 'init_args': {}}
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from streamrl.algorithms import ALGORITHMS
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.clusters import CLUSTERS
from streamrl.components.generation.engines import ENGINES
from streamrl.components.skewness.by_name import DISPATCHERS, SCHEDULERS
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.runtime.references import as_class_path, pick

#: Each swappable part of ``rl``: (what it is, for messages; its built-ins by short name).
SWAPPABLE: dict[str, tuple[str, Mapping[str, Any]]] = {
    "algorithm": ("algorithm", ALGORITHMS),
    "engine": ("engine", ENGINES),
    "cluster": ("cluster", CLUSTERS),
    "dispatcher": ("dispatcher", DISPATCHERS),
    "scheduler": ("scheduler", SCHEDULERS),
    "length_predictor": ("length predictor", {"ranker": LengthRanker}),
    "elastic": ("elastic controller", {"controller": ElasticController}),
}


#: The parts only the process running the recipe builds (rank 0, or every trainer rank for the
#: algorithm), which may therefore be a class of your script or notebook (``__main__.Name``);
#: the scheduler and the engine are built in the generator processes, which cannot import it.
MAIN_PROCESS_PARTS = ("algorithm", "dispatcher", "length_predictor", "elastic")


def canonical(key: str, value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``rl.<key>``'s ``value`` as ``{class_path, init_args}``; ``None`` stays ``None``.

    Raises:
        ConfigError: an unknown name, a reference that does not import, a malformed mapping,
            or a class of ``__main__`` for a part another process builds.
    """
    if value is None:
        return None
    kind, builtins = SWAPPABLE[key]
    main_ok = key in MAIN_PROCESS_PARTS
    return as_class_path(value, kind=kind, builtins=builtins, where=f"rl.{key}", main_ok=main_ok)


def factory_and_args(key: str, value: str | Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The class (or function) ``rl.<key>`` names and its constructor's arguments."""
    kind, builtins = SWAPPABLE[key]
    return pick(value, kind=kind, builtins=builtins, where=f"rl.{key}")


def init_arg(key: str, value: str | Mapping[str, Any], name: str) -> Any:
    """Argument ``name`` of ``rl.<key>``'s constructor as the run will build it: its
    ``init_args`` value, else the constructor's default (``None`` where it has none), e.g. the
    algorithm's ``kl_coef``, which says whether a reference policy is kept."""
    factory, args = factory_and_args(key, value)
    return args[name] if name in args else default_of(factory, name)


def default_of(factory: Any, name: str) -> Any:
    """The default of ``factory``'s argument ``name`` (``None`` where it has none): the one
    place a section's unset argument is read from."""
    parameter = inspect.signature(factory).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default
