"""Long-tailed prompt sets as ``datasets.Dataset``s.

StreamRL's skewness bubbles come from long-tailed output lengths (§2, §5): most answers are short
and a few are very long. ``make_prompt_set`` draws each prompt's target answer length from a
log-normal whose ``tail`` (its sigma) sets how heavy that tail is, then lets a task family build a
prompt with about that answer length.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import datasets

from streamrl.errors import ConfigError, unknown_name
from streamrl.tasks.families import FAMILIES
from streamrl.tasks.text_files import check_utf8

#: Columns of every prompt set.
COLUMNS = ("prompt_id", "task", "prompt", "answer", "answer_len")


def long_tail_lengths(
    n: int, rng: random.Random, median_len: int = 8, tail: float = 0.8, max_len: int = 96
) -> list[int]:
    """Draw ``n`` answer lengths from a log-normal clipped to ``[1, max_len]``.

    Args:
        n: how many lengths.
        rng: the random source.
        median_len: the distribution's median, in characters.
        tail: the log-normal sigma; 0 gives every prompt ``median_len``, 0.8 puts p90 near 2.8x
            the median and p99 near 6x, 1.2 makes the tail heavier still.
        max_len: hard cap (keeps prompt + answer inside the model's context).
    """
    if median_len < 1 or max_len < median_len or tail < 0:
        raise ConfigError(
            f"long_tail_lengths: need 1 <= median_len <= max_len and tail >= 0, got "
            f"median_len={median_len}, max_len={max_len}, tail={tail}."
        )
    mu = math.log(median_len)
    return [min(max_len, max(1, round(math.exp(rng.gauss(mu, tail))))) for _ in range(n)]


def check_tasks(tasks: Sequence[str]) -> None:
    """Raise a ``ConfigError`` naming the first unknown task (with a "did you mean")."""
    if not tasks:
        raise ConfigError(f"No tasks given; choose from {sorted(FAMILIES)}.")
    for task in tasks:
        if task not in FAMILIES:
            raise ConfigError(unknown_name("task", task, FAMILIES))


def make_prompt_set(
    n: int,
    tasks: Sequence[str] = tuple(FAMILIES),
    *,
    median_len: int = 8,
    tail: float = 0.8,
    max_len: int = 96,
    seed: int = 0,
    id_prefix: str = "p",
    exclude: set[str] | None = None,
) -> datasets.Dataset:
    """Build ``n`` distinct prompts with long-tailed answer lengths, tasks drawn uniformly.

    Args:
        n: number of prompts (distinct prompt strings).
        tasks: task family names (see ``streamrl.tasks.FAMILIES``).
        median_len: median answer length (see ``long_tail_lengths``).
        tail: spread of the answer-length distribution (see ``long_tail_lengths``).
        max_len: longest answer (see ``long_tail_lengths``).
        seed: makes the set reproducible.
        id_prefix: prefix of the ``prompt_id`` column (ids are unique within the set).
        exclude: prompt strings to leave out, e.g. the training set when building a held-out set.

    Returns:
        A ``datasets.Dataset`` with columns ``prompt_id, task, prompt, answer, answer_len``.

    Examples:
        >>> ds = make_prompt_set(4, ["count"], seed=1)
        >>> ds[0]["prompt"], ds[0]["answer"]  # doctest: +SKIP
        ('count 17 20=', '17 18 19 20')
    """
    check_tasks(tasks)
    if n < 1:
        raise ConfigError(f"make_prompt_set: n must be >= 1, got {n}.")
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ConfigError(
                f"make_prompt_set: only {len(rows)} distinct prompts found for n={n}; raise "
                "median_len/tail or add tasks so that more distinct prompts exist."
            )
        family = FAMILIES[tasks[rng.randrange(len(tasks))]]
        target = long_tail_lengths(1, rng, median_len, tail, max_len)[0]
        prompt, answer = family.make(rng, target)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append(
            dict(
                prompt_id=f"{id_prefix}{len(rows):06d}",
                task=family.name,
                prompt=prompt,
                answer=answer,
                answer_len=len(answer),
            )
        )
    return datasets.Dataset.from_list(rows)


def make_splits(
    n_train: int, n_heldout: int, tasks: Sequence[str] = tuple(FAMILIES), *, seed: int = 0, **kw
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A training set and a held-out set that shares no prompt string with it."""
    train = make_prompt_set(n_train, tasks, seed=seed, id_prefix="train-", **kw)
    heldout = make_prompt_set(
        n_heldout,
        tasks,
        seed=seed + 1_000_003,
        id_prefix="heldout-",
        exclude=set(train["prompt"]),
        **kw,
    )
    return train, heldout


def load_prompt_file(path: str | Path) -> datasets.Dataset:
    """Load prompts from a JSONL file with ``prompt`` and ``answer`` fields (``task`` and
    ``prompt_id`` optional; every other field is kept, after the contract's columns).

    Raises:
        ConfigError: missing file, empty file, a byte that is not UTF-8, a row without
            ``prompt``/``answer``, or duplicate prompt ids; the message names the line.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Prompt file {str(path)!r} does not exist.")
    check_utf8(path)
    rows = []
    seen: dict[str, int] = {}  # prompt id -> line
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{line_no}: not valid JSON ({err.msg}).") from err
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise ConfigError(f"{path}:{line_no}: each row needs 'prompt' and 'answer' fields.")
        answer = str(row["answer"])
        prompt_id = str(row.get("prompt_id", f"{path.stem}-{len(rows):06d}"))
        if prompt_id in seen:
            raise ConfigError(
                f"{path}:{line_no}: duplicate prompt_id {prompt_id!r} (first on line "
                f"{seen[prompt_id]}); prompt ids must be unique."
            )
        seen[prompt_id] = line_no
        rows.append(
            dict(
                prompt_id=prompt_id,
                task=str(row.get("task", "custom")),
                prompt=str(row["prompt"]),
                answer=answer,
                answer_len=len(answer),
                **{k: v for k, v in row.items() if k not in COLUMNS},  # a reward may read them
            )
        )
    if not rows:
        raise ConfigError(f"Prompt file {str(path)!r} has no rows; add JSONL rows with a prompt.")
    return datasets.Dataset.from_list(rows)
