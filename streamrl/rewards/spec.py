"""A run's reward: one function or several with weights, each seeing the prompt's whole row.

A reward is a plain function ``fn(completion: str, row: dict) -> float``; ``row`` holds every
column of the prompt's dataset row (``prompt_id``, ``prompt``, ``answer``, ``task`` and your own).
Three other forms work too, so a slow verifier need not be rewritten:

- **answer form**: ``fn(completion, answer)``, when the second parameter is named ``answer``
  (the built-in ``exact`` and ``partial``); it gets ``row["answer"]``;
- **batched**: a callable with ``batched = True`` taking ``(completions, rows)`` and returning a
  list of floats (a reward model scores a whole batch in one forward pass);
- **async**: ``async def fn(completion, row)`` (or batched), awaited concurrently over a batch.

A class (e.g. ``RewardModel``) is constructed with its options first. In YAML::

    rl:
      reward: my_lab.rewards:score                  # one function
      reward:                                       # or several, with weights
        - {name: math, weight: 1.0}
        - {name: my_lab.rewards:brevity, weight: 0.1}
        - {name: reward_model, path: /models/rm, weight: 0.5}

Each reward is logged on its own (``reward/<name>``) next to their weighted sum, the reward the
algorithm trains on. ``RewardPool`` (``streamrl.rewards.pool``) runs them off the trainer's
critical path.

Examples:
    >>> def brevity(completion: str, row: dict) -> float:
    ...     return 1.0 / (1 + len(completion))
    >>> rewards = load_rewards([RewardSpec("exact"), RewardSpec(brevity, weight=0.5)])
    >>> totals, parts = rewards.score(["42"], [{"prompt_id": "p0", "answer": "42"}])
    >>> totals, parts
    ([1.1666666666666667], {'exact': [1.0], 'brevity': [0.3333333333333333]})
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamrl.errors import ConfigError, RewardError
from streamrl.runtime.references import check_callable, construct, resolve

#: Built-in rewards by the short name a config uses (imported only when used).
BUILTIN_REWARDS: dict[str, str] = {
    "exact": "streamrl.tasks.rewards:exact_match",
    "partial": "streamrl.tasks.rewards:partial_credit",
    "math": "streamrl.rewards.verifiers:math_answer",
    "reward_model": "streamrl.rewards.reward_model:RewardModel",
    "reasoning_gym": "streamrl.tasks.reasoning_gym:reasoning_gym_reward",
}

#: What a built-in reward imports that streamrl does not install by default, and how to get it.
BUILTIN_NEEDS: dict[str, tuple[str, str]] = {
    "math": ("math_verify", "pip install 'math-verify>=0.9' (or streamrl[tasks])"),
    "reasoning_gym": ("reasoning_gym", "pip install 'reasoning-gym>=0.1.25' (or streamrl[tasks])"),
}

BatchReward = Callable[[list[str], list[dict]], list[float]]


def check_reward_packages(specs: Sequence[RewardSpec]) -> None:
    """Every package the built-in rewards of ``specs`` import is installed.

    Raises:
        ConfigError: one is missing (checked before any work: the reward would fail at its
            first call, after the warm start); the message gives the install command.
    """
    for spec in specs:
        if isinstance(spec.reward, str) and spec.reward in BUILTIN_NEEDS:
            module, install = BUILTIN_NEEDS[spec.reward]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(
                    f"rl.reward: {spec.reward!r} needs the {module!r} package, not installed "
                    f"here: {install}."
                )


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a run: what to call, with which options, and its weight.

    It is what travels to reward worker processes (each builds its own function from it), so
    it holds a name or reference rather than a loaded model.

    Attributes:
        reward: a built-in name (``BUILTIN_REWARDS``), ``"package.module:name"``, or the
            function or object itself (picklable to run in worker processes: defined in a
            module, not in a notebook cell).
        weight: its weight in the total reward.
        options: keyword arguments of a class reward (``{"path": ...}`` of ``reward_model``).
        name: its name in logs (``log_as`` in YAML); defaults to the function's or class's
            name.
    """

    reward: str | Callable[..., Any]
    weight: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if isinstance(self.reward, str):
            return self.reward.rpartition(":")[2]
        return getattr(self.reward, "__name__", type(self.reward).__name__)

    @classmethod
    def from_config(cls, value: Any, where: str = "rl.reward") -> list[RewardSpec]:
        """Specs from a config value: a name, ``{name: ..., weight: ..., option: ...}``, or a
        list of those.

        Raises:
            ConfigError: a mapping without ``name``, a weight that is not a number, an empty
                list, or two rewards logged under the same name.
        """
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ConfigError(f"{where} is an empty list; give at least one reward.")
        specs = []
        for i, item in enumerate(items):
            at = f"{where}[{i}]" if isinstance(value, list) else where
            if isinstance(item, Mapping):
                if "name" not in item:
                    raise ConfigError(
                        f"{at}: a mapping needs 'name' (a built-in or package.module:name), "
                        f"got {dict(item)!r}."
                    )
                options = {k: v for k, v in item.items() if k not in ("name", "weight", "log_as")}
                weight = item.get("weight", 1.0)
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    raise ConfigError(f"{at}: weight must be a number, got {weight!r}.")
                specs.append(cls(item["name"], float(weight), options, item.get("log_as")))
            elif isinstance(item, str) or callable(item):
                specs.append(cls(item))
            else:
                raise ConfigError(
                    f"{at}: {item!r} is not a reward; give a name, package.module:name, or "
                    "{name: ..., weight: ...}."
                )
        labels = [s.label for s in specs]
        if len(set(labels)) != len(labels):
            raise ConfigError(
                f"{where}: two rewards are logged as the same name ({labels}); give one of them "
                "another with 'log_as'."
            )
        return specs


def as_batch_reward(fn: Any, where: str = "rl.reward") -> BatchReward:
    """``fn`` in any of the four forms, as one synchronous ``(completions, rows) -> list``.

    Raises:
        ConfigError: ``fn`` cannot be called with two arguments.
    """
    what = "fn(completion, row) -> float (or batched / async, see streamrl.rewards.spec)"
    check_callable(fn, positional=2, where=where, what=what)
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    is_async = inspect.iscoroutinefunction(call)
    if getattr(fn, "batched", False):
        if is_async:
            return lambda completions, rows: asyncio.run(fn(completions, rows))
        return fn
    takes_answer = _second_parameter(fn) == "answer"

    def one(completion: str, row: dict) -> Any:
        try:
            return fn(completion, row["answer"] if takes_answer else row)
        except Exception as err:
            raise _RowFailure(row, err) from err

    if is_async:

        async def gather(completions: list[str], rows: list[dict]) -> list[Any]:
            return await asyncio.gather(*(one(c, r) for c, r in zip(completions, rows)))

        return lambda completions, rows: asyncio.run(gather(completions, rows))
    return lambda completions, rows: [one(c, r) for c, r in zip(completions, rows)]


class _RowFailure(Exception):
    """A per-sample reward raised on ``row`` (so the error can name that prompt)."""

    def __init__(self, row: dict, err: Exception) -> None:
        super().__init__(repr(err))
        self.row = row


def _second_parameter(fn: Any) -> str | None:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[1] if len(names) > 1 else None


def build_reward(spec: RewardSpec, where: str = "rl.reward") -> BatchReward:
    """The callable ``spec`` names (a class is constructed with its options), as a batch
    reward. Runs in each reward worker, and once in the trainer to check the spec.

    Raises:
        ConfigError: an unknown name, a module that does not import, an option the class does
            not take, or a wrong signature.
    """
    target = spec.reward
    if isinstance(target, str):
        ref = BUILTIN_REWARDS.get(target, target)  # a built-in is its module:name
        target = resolve(ref, kind="reward", builtins=BUILTIN_REWARDS, where=where)
    if isinstance(target, type):  # a reward class: its options configure one instance
        target = construct(target, provided={}, options=spec.options, where=where)
    elif spec.options:
        raise ConfigError(
            f"{where}: {spec.label} is a function and takes no options "
            f"{sorted(spec.options)}; only a reward class (e.g. reward_model) does."
        )
    return as_batch_reward(target, where)


@dataclass
class WeightedRewards:
    """Several batch rewards and their weights: ``score`` returns the weighted totals and each
    reward's own values, checked to be finite numbers."""

    labels: list[str]
    weights: list[float]
    functions: list[BatchReward]

    def score(
        self, completions: Sequence[str], rows: Sequence[dict]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """``(totals, {label: values})`` for a batch.

        Raises:
            RewardError: a reward raised, returned a list of the wrong length, or a value that
                is not a finite number; the message names the reward and the prompt.
        """
        completions, rows = list(completions), list(rows)
        parts: dict[str, list[float]] = {}
        for label, fn in zip(self.labels, self.functions):
            try:
                values = fn(completions, rows)
            except Exception as err:
                failed = [err.row] if isinstance(err, _RowFailure) else rows
                cause = err.__cause__ if isinstance(err, _RowFailure) else err
                if isinstance(cause, ConfigError):  # a setup problem (a missing package)
                    raise cause from None
                prompts = sorted({str(r.get("prompt_id")) for r in failed})
                raise RewardError(
                    f"Reward {label!r} raised {cause!r} on prompt(s) {prompts}; fix the reward "
                    "function (it is called as fn(completion, row))."
                ) from err
            parts[label] = _checked_values(label, values, rows)
        totals = [
            sum(w * parts[label][i] for label, w in zip(self.labels, self.weights))
            for i in range(len(rows))
        ]
        return totals, parts


def _checked_values(label: str, values: Any, rows: list[dict]) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != len(rows):
        raise RewardError(
            f"Reward {label!r} returned {type(values).__name__} of "
            f"{len(values) if hasattr(values, '__len__') else '?'} values for {len(rows)} "
            "completions; a batched reward returns one float per completion."
        )
    checked = []
    for value, row in zip(values, rows):
        try:  # text is refused, even "0.5": float() would take it, and "1" vs "yes" is a bug
            number = math.nan if isinstance(value, (str, bytes)) else float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise RewardError(
                f"Reward {label!r} returned {value!r} for prompt {row.get('prompt_id')!r}; "
                "rewards must be finite numbers (a float, int or bool; not text, NaN or "
                "None): return float(...) of your score."
            )
        checked.append(number)
    return checked


def load_rewards(specs: Sequence[RewardSpec]) -> WeightedRewards:
    """Build every reward of ``specs`` (see ``build_reward``)."""
    where = "rl.reward"
    return WeightedRewards(
        labels=[s.label for s in specs],
        weights=[s.weight for s in specs],
        functions=[build_reward(s, where) for s in specs],
    )
