"""What a run gives the components it builds from a config: ``RunContext`` and ``from_run``.

A component named in a config (``rl.dispatcher``, ``rl.length_predictor``, ``rl.engine``, and
the simulator's ``dispatch``) is built by ``build_from_run``: ``Cls.from_run(run, **options)``
when its class defines that classmethod, else ``Cls(**options)``. ``from_run`` is the one place
a component takes what it needs from the run, as ``Algorithm.from_run`` does for algorithms: the
skewness-aware dispatcher asks for the instances' ``PTL(BS)`` (``run.latency()``, which is what
makes the run measure it), the ranker for a seed and the policy's tokenizer, the HF engine for
the run's LoRA adapters. Your own class does the same, or takes only its options.

Examples:
    >>> class Fixed:
    ...     def __init__(self, size: int) -> None:
    ...         self.size = size
    ...     @classmethod
    ...     def from_run(cls, run: RunContext, **options) -> "Fixed":
    ...         return cls(run.max_batch_size, **options)
    >>> build_from_run(Fixed, RunContext(max_batch_size=8), {}, where="rl.dispatcher").size
    8
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamrl.components.skewness.latency import LatencyModel
from streamrl.errors import ConfigError
from streamrl.policy.lora import LoRASpec
from streamrl.runtime.references import check_options, construct


@dataclass
class RunContext:
    """What a run can give a component it builds.

    Attributes:
        max_batch_size: sequences an instance decodes at once (``rl.generation.max_batch_size``).
        seed: the run's seed.
        instances: generator instances at the start.
        elastic: whether instances may be added during the run (§4.2).
        tokenizer: the policy's tokenizer, where a component may read prompts in its tokens
            (``None``: none to give).
        lora: the run's LoRA adapters (``rl.lora``), which an engine must carry, or
            ``None``.
        latency_model: the ``PTL(BS)`` to hand out (the simulator's preset); ``None``: a run
            makes one on the first ``latency()`` call, which its instances then measure.
    """

    max_batch_size: int
    seed: int = 0
    instances: int = 1
    elastic: bool = False
    tokenizer: Any = None
    lora: LoRASpec | None = None
    latency_model: LatencyModel | None = field(default=None)

    @property
    def several_instances(self) -> bool:
        """Whether requests may be split over more than one instance during the run."""
        return self.instances > 1 or self.elastic

    def latency(self) -> LatencyModel:
        """The instances' ``PTL(BS)`` (§5.1, Eq. 1). Asking for it is what makes a run measure
        it: each instance profiles its own engine at start, before anything is dispatched."""
        if self.latency_model is None:
            self.latency_model = LatencyModel([1], [float("nan")])
        return self.latency_model


def build_from_run(
    factory: Callable[..., Any], run: RunContext, options: Mapping[str, Any], *, where: str
) -> Any:
    """``factory.from_run(run, **options)`` if it defines ``from_run``, else
    ``factory(**options)``.

    Raises:
        ConfigError: an option the factory does not take, or a required parameter missing,
            named with the factory's signature.
    """
    if inspect.getattr_static(factory, "from_run", None) is None:
        return construct(factory, provided={}, options=options, where=where)
    try:
        inspect.signature(factory.from_run).bind(run, **options)
    except TypeError as err:
        known = [*inspect.signature(factory.from_run).parameters, *_parameters(factory)]
        close = [difflib.get_close_matches(str(k), known, n=1) for k in options]
        hints = [f"{k!r}: did you mean {c[0]!r}?" for k, c in zip(options, close) if c]
        raise ConfigError(
            f"{where}: {getattr(factory, '__qualname__', factory)}.from_run(run, **options) "
            f"does not take the options {dict(options)}: {err}{' (' if hints else ''}"
            f"{'; '.join(hints)}{')' if hints else ''}."
        ) from None
    # ``from_run`` passes the options on to the constructor: an unknown one fails here, by name.
    check_options(factory, options, where=where)
    return factory.from_run(run, **options)


def _parameters(factory: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(factory).parameters)
    except ValueError:  # no signature to read
        return []
