"""A user's local prompt dataset (JSONL, JSON, CSV, TSV, Parquet or a ``save_to_disk`` directory).

Every row leaves with the columns ``prompt_id, task, prompt, answer, answer_len`` first, then every
other column of the file as it was, mapped ones included under their own names (a reward function
receives the whole row: ``row["solution"]`` still works after ``answer_column="solution"``).
Nothing touches the network: files go through ``datasets``' packaged readers, directories
through ``datasets.load_from_disk``.

Examples:
    >>> train = load_prompt_dataset("gsm8k.jsonl", prompt_column="question")  # doctest: +SKIP
    >>> train, heldout = split_heldout(train, heldout_fraction=0.05)  # doctest: +SKIP
    >>> train[0]["prompt_id"], train[0]["task"]  # doctest: +SKIP
    ('gsm8k-3f1c2a9b0e', 'gsm8k')
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import datasets

from streamrl.errors import ConfigError, unknown_name
from streamrl.tasks.prompt_sets import COLUMNS
from streamrl.tasks.text_files import check_utf8

#: File suffix -> ``datasets`` packaged builder.
READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
#: With no held-out option given, ``split_heldout`` holds out this fraction of the rows ...
DEFAULT_HELDOUT_FRACTION = 0.1
#: ... but at least one and at most this many rows (evaluation cost grows with it).
MAX_DEFAULT_HELDOUT = 500


def load_prompt_dataset(
    path: str | Path,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    id_column: str | None = None,
    task_column: str | None = None,
    split: str | None = None,
    require_prompt: bool = True,
) -> datasets.Dataset:
    """Load a prompt dataset and give it the row contract.

    Mapped columns are copied to ``prompt`` / ``answer`` / ``prompt_id`` / ``task`` and also
    kept under their own names; a ``prompt_id`` or ``task`` column is used when no other is
    mapped. Without ids, a row's id is
    ``f"{stem}-{sha1(prompt, answer)[:10]}"`` (``-2``, ``-3`` for repeats of an identical row), so
    ids survive reruns and reordering of the file. ``answer_len`` is always recomputed.

    Args:
        path: a ``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet`` file, or a directory written by
            ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``.
        prompt_column: column with the prompt: a string or a list of ``{"role", "content"}``.
        answer_column: column with the reference answer (made a string); None gives every row "".
        id_column: column of unique prompt ids (made strings); default ``prompt_id`` if present.
        task_column: column naming each row's source; default ``task`` if present, else the file
            stem (directory name).
        split: which split of a ``DatasetDict`` directory (default "train"); a file or a plain
            ``Dataset`` directory has only "train".
        require_prompt: ``False`` (an episode run: the environment's ``reset`` gives the first
            prompt) loads rows without a ``prompt`` column as they are, their ids derived from
            the whole row; a ``prompt_column`` other than ``"prompt"`` must still exist.

    Returns:
        A ``datasets.Dataset`` with ``prompt_id, task, prompt, answer, answer_len`` then the rest
        (``prompt`` only when the rows have one, with ``require_prompt=False``).

    Raises:
        ConfigError: missing path, unsupported suffix, unknown split or column, conflicting
            columns, no rows, or a row with a bad prompt, answer or id (the message names it).
    """
    path = Path(path)
    raw, stem, id_prefix = _read(
        path, split, [prompt_column, answer_column, id_column, task_column]
    )
    where = repr(str(path)) + (f" (split {split!r})" if split and path.is_dir() else "")
    if len(raw) == 0:
        raise ConfigError(f"Prompt dataset {where} has no rows; add rows with a {prompt_column!r}.")
    id_column = id_column or ("prompt_id" if "prompt_id" in raw.column_names else None)
    task_column = task_column or ("task" if "task" in raw.column_names else None)
    if not require_prompt and prompt_column == "prompt" and "prompt" not in raw.column_names:
        return _without_prompts(raw, stem, id_prefix, answer_column, id_column, task_column, where)
    mapping = {"prompt": prompt_column, "answer": answer_column, "prompt_id": id_column}
    _check_mapping(raw.column_names, {**mapping, "task": task_column}, where)
    answers = [""] * len(raw)
    if answer_column:
        answers = [_text(a, "answer", i, where) for i, a in enumerate(raw[answer_column])]
    ids = _column_ids(raw[id_column], where) if id_column else None
    prompts = list(raw[prompt_column])
    for i, prompt in enumerate(prompts):
        if problem := _prompt_problem(prompt):
            name = f", prompt_id {ids[i]!r}" if ids else ""
            raise ConfigError(
                f"Prompt dataset {where}, row {i} (0-based{name}): the prompt {problem}; give a "
                "non-empty string or a list of {'role': str, 'content': str} messages."
            )
    tasks = [stem] * len(raw)
    if task_column:
        tasks = [_text(t, "task", i, where) for i, t in enumerate(raw[task_column])]
    # The contract's columns are (re)built from their sources; the sources stay as they were.
    out = raw.remove_columns(sorted(set(COLUMNS) - {"prompt"} & set(raw.column_names)))
    if prompt_column != "prompt":
        out = out.add_column("prompt", prompts, feature=raw.features[prompt_column])
    out = out.add_column("prompt_id", ids or _content_ids(prompts, answers, id_prefix))
    out = out.add_column("answer", answers).add_column("task", tasks)
    out = out.add_column("answer_len", [len(a) for a in answers])
    return out.select_columns([*COLUMNS, *(c for c in out.column_names if c not in COLUMNS)])


def _without_prompts(
    raw: datasets.Dataset,
    stem: str,
    id_prefix: str,
    answer_column: str | None,
    id_column: str | None,
    task_column: str | None,
    where: str,
) -> datasets.Dataset:
    """The row contract without ``prompt`` (an episode run's rows, ``load_prompt_dataset``):
    ids from the whole row's content when no column holds them."""
    mapping = {"answer": answer_column, "prompt_id": id_column, "task": task_column}
    _check_mapping(raw.column_names, mapping, where)
    answers = [""] * len(raw)
    if answer_column:
        answers = [_text(a, "answer", i, where) for i, a in enumerate(raw[answer_column])]
    ids = _column_ids(raw[id_column], where) if id_column else None
    tasks = [stem] * len(raw)
    if task_column:
        tasks = [_text(t, "task", i, where) for i, t in enumerate(raw[task_column])]
    out = raw.remove_columns(sorted(set(COLUMNS) & set(raw.column_names)))
    rows = [json.dumps(row, sort_keys=True, ensure_ascii=False, default=str) for row in raw]
    out = out.add_column("prompt_id", ids or _content_ids(rows, answers, id_prefix))
    out = out.add_column("answer", answers).add_column("task", tasks)
    out = out.add_column("answer_len", [len(a) for a in answers])
    head = [c for c in COLUMNS if c != "prompt"]
    return out.select_columns([*head, *(c for c in out.column_names if c not in head)])


def _check_mapping(columns: list[str], mapping: dict[str, str | None], where: str) -> None:
    """Each mapped column exists and does not replace another column of the contract name."""
    for target, source in mapping.items():
        param = ("id" if target == "prompt_id" else target) + "_column"
        if source is not None and source not in columns:
            hint = " (or answer_column=None if it has no answers)" if target == "answer" else ""
            raise ConfigError(
                f"Prompt dataset {where}: {unknown_name('column', source, columns)} "
                f"Pass {param}= one of its columns{hint}."
            )
        if source != target and target in columns:
            raise ConfigError(
                f"Prompt dataset {where}: {param}={source!r} would replace its existing "
                f"{target!r} column; rename or drop one of the two columns first."
            )


def split_heldout(
    dataset: datasets.Dataset,
    *,
    heldout_path: str | Path | None = None,
    heldout_fraction: float | None = None,
    heldout_split: str | None = None,
    n_heldout: int | None = None,
    seed: int = 0,
    **load_kwargs: Any,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split off a held-out set, in exactly one way (none given: ``DEFAULT_HELDOUT_FRACTION`` of
    the rows, at least 1 and at most ``MAX_DEFAULT_HELDOUT``).

    Args:
        dataset: rows from ``load_prompt_dataset``.
        heldout_path: a second file or directory, loaded with ``load_kwargs`` (the same column
            mapping); ``dataset`` comes back unchanged.
        heldout_fraction: this share of ``dataset``'s rows moves to the held-out set.
        heldout_split: with ``heldout_path`` a ``DatasetDict`` directory (often the training one),
            the split to hold out, e.g. "test".
        n_heldout: this many of ``dataset``'s rows move to the held-out set.
        seed: which rows move; they are chosen by a seeded hash of ``prompt_id``, so the choice
            does not depend on the file's row order.
        **load_kwargs: ``load_prompt_dataset`` keywords for ``heldout_path``.

    Returns:
        ``(train, heldout)``, sharing no ``prompt_id``.

    Raises:
        ConfigError: several ways given, a bad fraction, a split that ends up empty, or a
            held-out file whose ids also name training rows.
    """
    ways = dict(heldout_path=heldout_path, heldout_fraction=heldout_fraction, n_heldout=n_heldout)
    given = [name for name, value in ways.items() if value is not None]
    if len(given) > 1:
        raise ConfigError(f"split_heldout: choose one of {', '.join(given)}, not several.")
    if heldout_split is not None and heldout_path is None:
        raise ConfigError(
            f"split_heldout: heldout_split={heldout_split!r} needs heldout_path= the DatasetDict "
            "directory (usually the same path as the training split)."
        )
    if load_kwargs and heldout_path is None:
        raise ConfigError(
            f"split_heldout: {sorted(load_kwargs)} only apply with heldout_path; drop them."
        )
    if heldout_path is not None:
        if heldout_split is not None:
            load_kwargs["split"] = heldout_split
        heldout = load_prompt_dataset(heldout_path, **load_kwargs)
        shared = sorted(set(dataset["prompt_id"]) & set(heldout["prompt_id"]))
        if shared:
            raise ConfigError(
                f"split_heldout: {len(shared)} held-out prompt ids also name training rows (e.g. "
                f"{shared[:3]}); make the ids unique across both sets or remove the repeats."
            )
        return dataset, heldout
    n = len(dataset)
    if n_heldout is None:
        fraction = DEFAULT_HELDOUT_FRACTION if heldout_fraction is None else heldout_fraction
        if not 0 < fraction < 1:
            raise ConfigError(f"split_heldout: heldout_fraction must be in (0, 1), got {fraction}.")
        n_heldout = round(fraction * n)
        if heldout_fraction is None:
            n_heldout = min(max(1, n_heldout), MAX_DEFAULT_HELDOUT)
    if not 0 < n_heldout < n:
        empty = "held-out" if n_heldout < 1 else "training"
        raise ConfigError(
            f"split_heldout: holding out {n_heldout} of {n} rows leaves the {empty} set empty; "
            "hold out between 1 and n - 1 rows, or pass heldout_path= a second file."
        )
    ids = dataset["prompt_id"]
    order = sorted(range(n), key=lambda i: hashlib.sha1(f"{seed}:{ids[i]}".encode()).digest())
    held = set(order[:n_heldout])
    return dataset.select([i for i in range(n) if i not in held]), dataset.select(sorted(held))


def check_enough_rows(dataset: datasets.Dataset, needed: int, what: str) -> None:
    """Check ``dataset`` holds the ``needed`` prompts one iteration deals.

    Args:
        dataset: the training rows.
        needed: ``rl.prompts_per_iteration``.
        what: the dataset's name in the message, e.g. ``"'train.jsonl'"``.

    Raises:
        ConfigError: fewer rows than ``needed``; says how to fix it.
    """
    if len(dataset) < needed:
        raise ConfigError(
            f"Dataset {what} has {len(dataset)} rows; one iteration needs {needed} "
            f"(rl.prompts_per_iteration = {needed}). Lower rl.prompts_per_iteration to at most "
            f"{len(dataset)} or add rows."
        )


def _read(
    path: Path, split: str | None, text_columns: list[str | None]
) -> tuple[datasets.Dataset, str, str]:
    """The raw rows, the default task name and the id prefix."""
    if not path.exists():
        raise ConfigError(f"Prompt dataset {str(path)!r} does not exist (cwd is {Path.cwd()}).")
    if path.is_dir():
        return _read_saved(path, split)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(
            f"Prompt dataset {str(path)!r}: unsupported suffix {path.suffix!r}; use one of "
            f"{', '.join(READERS)} or a directory written by Dataset.save_to_disk."
        )
    if split not in (None, "train"):
        raise ConfigError(f"{str(path)!r} is a single file (split 'train'); drop split={split!r}.")
    if path.stat().st_size <= 4096 and not path.read_bytes().strip():  # datasets can't say why
        raise ConfigError(f"Prompt dataset {str(path)!r} is empty; add rows with a prompt.")
    if reader != "parquet":
        check_utf8(path)
    kwargs: dict[str, Any] = {}
    if reader == "csv":
        # Read the contract columns as text: "007" must stay "007", and "3" must not become 3.0.
        keep = {c for c in (*text_columns, "prompt_id", "task") if c}
        sep = "\t" if path.suffix.lower() == ".tsv" else ","
        kwargs = {"sep": sep, "converters": {c: str for c in keep}}
    try:
        raw = datasets.load_dataset(reader, data_files=str(path), split="train", **kwargs)
    except datasets.exceptions.DatasetGenerationError as err:
        raise ConfigError(
            f"Could not read {str(path)!r} as {reader}: {err.__cause__ or err}. Fix the file."
        ) from err
    return raw, path.stem, path.stem


def _read_saved(path: Path, split: str | None) -> tuple[datasets.Dataset, str, str]:
    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ConfigError(
            f"{str(path)!r} is a directory but not one written by save_to_disk; pass a data file "
            f"({', '.join(READERS)}) or a save_to_disk directory."
        ) from err
    if isinstance(saved, datasets.Dataset):
        if split not in (None, "train"):
            raise ConfigError(f"{str(path)!r} holds one Dataset (no splits); drop split={split!r}.")
        return saved, path.name, path.name
    split = split or "train"
    if split not in saved:
        raise ConfigError(f"{str(path)!r}: {unknown_name('split', split, saved)} Pass split=.")
    # Splits of one source share its task name, but not ids: a row repeated in train and test
    # stays two prompts.
    return saved[split], path.name, f"{path.name}-{split}"


def _text(value: Any, what: str, row: int, where: str) -> str:
    """An answer, id or task as a string; whole floats lose their ".0" (JSON reads 3 as 3.0 when
    another row has 2.5)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value).strip():
        return str(value)
    fix = "; or pass answer_column=None if there are no answers" if what == "answer" else ""
    raise ConfigError(
        f"Prompt dataset {where}, row {row} (0-based): {what} is {value!r}, not a non-empty string "
        f"or number; fill it in{fix}."
    )


def _column_ids(values: Any, where: str) -> list[str]:
    ids: list[str] = []
    first_row: dict[str, int] = {}
    for i, value in enumerate(values):
        prompt_id = _text(value, "prompt_id", i, where)
        if prompt_id in first_row:
            raise ConfigError(
                f"Prompt dataset {where}: rows {first_row[prompt_id]} and {i} (0-based) share "
                f"prompt_id {prompt_id!r}; ids must be unique (or leave id_column unset)."
            )
        first_row[prompt_id] = i
        ids.append(prompt_id)
    return ids


def _content_ids(prompts: list[Any], answers: list[str], prefix: str) -> list[str]:
    """Ids from the row's content, so they survive reruns and reshuffles of the file."""
    ids, seen = [], dict[str, int]()
    for prompt, answer in zip(prompts, answers):
        content = json.dumps([prompt, answer], sort_keys=True, ensure_ascii=False)
        base = f"{prefix}-{hashlib.sha1(content.encode()).hexdigest()[:10]}"
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return ids


def _prompt_problem(prompt: Any) -> str | None:
    """What is wrong with a prompt, or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is empty"
    if not isinstance(prompt, list):
        return f"is {prompt!r}"
    if not prompt:
        return "is an empty list of messages"
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not all(
            isinstance(message.get(key), str) for key in ("role", "content")
        ):
            return f"has message {j} = {message!r}, not {{'role': str, 'content': str}}"
    return None
