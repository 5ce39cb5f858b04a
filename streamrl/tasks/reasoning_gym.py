"""Reasoning-gym tasks as a prompt dataset in our row contract, and their verifier as a reward.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates procedural reasoning
tasks, each with its own ``score_answer`` verifier in [0, 1] (some give partial credit). Rows leave
with ``prompt_id, task, prompt, answer, answer_len`` like every prompt set, plus ``entry`` (the
generated entry as JSON, which ``score_answer`` reads back) and ``task_config`` (the task's
config kwargs as JSON: a few verifiers read their dataset's config). ``reasoning_gym`` is an
optional dependency, imported on first use.

Examples:
    >>> train = reasoning_gym_dataset({"spell_backward": {"max_word_len": 5}}, size=4, seed=0)
    >>> row = train[0]
    >>> row["prompt_id"], reasoning_gym_reward(row["answer"], row)  # doctest: +SKIP
    ('spell_backward-0-0', 1.0)
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Mapping, Sequence
from functools import cache
from typing import Any

import datasets

from streamrl.errors import ConfigError, unknown_name

#: Keys the adapter sets itself; a task config must not hold them.
_RESERVED_KEYS = ("size", "seed")
#: Entries drawn per requested row before giving up on filling a set (exclusions, tiny spaces).
_MAX_DRAWS_PER_ROW = 20


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:  # an optional dependency: say how to get it
        raise ConfigError(
            "reasoning-gym tasks need the reasoning_gym package: pip install reasoning-gym."
        ) from err
    return reasoning_gym


def _task_configs(tasks: Sequence[str] | Mapping[str, dict]) -> dict[str, dict]:
    configs = {t: {} for t in tasks} if not isinstance(tasks, Mapping) else dict(tasks)
    if not configs:
        raise ConfigError("reasoning_gym_dataset: no tasks given; name at least one task.")
    known = _rg().factory.DATASETS
    for name, config in configs.items():
        if name not in known:
            raise ConfigError(unknown_name("reasoning-gym task", name, known))
        clash = sorted(set(config or {}) & set(_RESERVED_KEYS))
        if clash:
            raise ConfigError(
                f"reasoning-gym task {name!r}: its config sets {clash}; pass size and seed to "
                "reasoning_gym_dataset instead, they are set per call."
            )
    return {name: dict(config or {}) for name, config in configs.items()}


def _counts(names: list[str], size: int, weights: Sequence[float] | None) -> dict[str, int]:
    """Rows per task, proportional to ``weights`` (largest remainder, so they sum to ``size``)."""
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"reasoning_gym_dataset: weights {weights} must be one non-negative number per task "
            f"({len(names)}: {names}) with a positive sum."
        )
    shares = [size * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(names)), key=lambda i: counts[i] - shares[i])
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return dict(zip(names, counts))


def _draw(name: str, config: dict, count: int, seed: int, exclude: Collection[str]) -> list[dict]:
    """``count`` rows of one task: entries ``0, 1, ...`` of its dataset, skipping ``exclude``."""
    limit = max(count * _MAX_DRAWS_PER_ROW, 100)
    try:
        data = _rg().create_dataset(name, size=limit, seed=seed, **config)
    except (TypeError, AssertionError, ValueError) as err:
        raise ConfigError(f"reasoning-gym task {name!r}: bad config {config}: {err}") from err
    rows: list[dict] = []
    for index in range(limit):
        if len(rows) == count:
            break
        entry = data[index]
        if entry["question"] in exclude:
            continue
        answer = str(entry["answer"])
        rows.append(
            dict(
                prompt_id=f"{name}-{seed}-{index}",
                task=name,
                prompt=entry["question"],
                answer=answer,
                answer_len=len(answer),
                # JSON keeps metadata of any shape out of Arrow's typing; tuples come back lists.
                entry=json.dumps(entry, default=str),
                task_config=json.dumps(config, sort_keys=True),
            )
        )
    if len(rows) < count:
        raise ConfigError(
            f"reasoning-gym task {name!r} gave only {len(rows)} of {count} prompts outside the "
            f"excluded ones in {limit} draws; its config {config} allows too few distinct "
            "questions: widen the config or ask for fewer rows."
        )
    return rows


def reasoning_gym_dataset(
    tasks: Sequence[str] | Mapping[str, dict],
    *,
    size: int,
    seed: int,
    weights: Sequence[float] | None = None,
    exclude_prompts: Collection[str] = (),
) -> datasets.Dataset:
    """Generate a (mixed) reasoning-gym prompt set.

    Args:
        tasks: task names (default configs), or ``{name: config kwargs}`` without size and
            seed, e.g. ``{"chain_sum": {"max_terms": 2, "max_digits": 2}}``.
        size: rows in all; each task gets a share proportional to its weight.
        seed: reasoning-gym's seed. It seeds entry ``i`` with ``seed + i``, so nearby seeds
            share most questions: draw a held-out set at a far seed (``seed + 10**6``) and
            with ``exclude_prompts``.
        weights: one per task, in ``tasks``' order; equal when None.
        exclude_prompts: questions to leave out (pass the train prompts when drawing a
            held-out set: small configs repeat questions across seeds).

    Returns:
        A shuffled ``datasets.Dataset`` with ``prompt_id`` (``f"{task}-{seed}-{index}"``,
        ``index`` being the entry's reasoning-gym index), ``task``, ``prompt``, ``answer``,
        ``answer_len``, ``entry`` (JSON) and ``task_config`` (JSON).

    Raises:
        ConfigError: an unknown task (with a did-you-mean), a config reasoning-gym rejects or
            that sets size/seed, bad weights, or too few distinct questions to fill the set.
    """
    configs = _task_configs(tasks)
    counts = _counts(list(configs), size, weights)
    exclude = set(exclude_prompts)
    rows = [row for n, c in configs.items() for row in _draw(n, c, counts[n], seed, exclude)]
    random.Random(seed).shuffle(rows)
    return datasets.Dataset.from_list(rows)


@cache
def _verifier(name: str, config_json: str) -> Any:
    # One dataset object per task and config: score_answer is a method of the task's dataset
    # class, and a few (puzzle24, polynomial_equations) read its config.
    return _rg().create_dataset(name, size=1, seed=0, **json.loads(config_json))


def reasoning_gym_reward(completion: str, row: Mapping[str, Any]) -> float:
    """Score ``completion`` with the row's task verifier (reasoning-gym's ``score_answer``).

    Args:
        completion: the decoded completion, passed to ``score_answer`` unchanged (strip any
            chat or thinking format first).
        row: a row of ``reasoning_gym_dataset`` (``task``, ``entry``, optional ``task_config``).

    Returns:
        The verifier's score in [0, 1].
    """
    verifier = _verifier(row["task"], row.get("task_config") or "{}")
    return float(verifier.score_answer(completion, json.loads(row["entry"])))
