"""What every bench takes in, checked before any work: lengths files and a model with the context
they need.

A user may hand any bench any lengths file. Its longest length plus the longest prompt must fit
the model's context: a built-in model (``"tiny"``, ``"qwen2-0.5b"``) is then built with that
context; a model directory with a shorter one is refused with a ``ConfigError`` that says what to
change, before a generator starts (not a generator crash, replacement and crash again).
"""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.errors import ConfigError

#: Built-in random-init models a benchmark can name instead of a directory.
BUILT_IN = {"tiny": "demo", "qwen2-0.5b": "0.5b"}
#: The context a built-in model gets when its inputs need no more.
DEFAULT_CONTEXT = {"tiny": 256, "qwen2-0.5b": 4096}


def load_lengths(path: str | Path, flag: str = "--lengths") -> list[int]:
    """Output lengths from a JSON list or a JSONL file with a ``length`` field.

    Args:
        path: the file.
        flag: the option that named it, for the error message.

    Returns:
        The lengths, each a positive int (tokens).

    Raises:
        ConfigError: no such file, neither format, an entry that is not a positive integer, or
            no lengths at all.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag}: no lengths file at {str(path)!r}.")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line)["length"] for line in text.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(
                f"{flag} {path}: not a JSON list of lengths nor JSONL rows with a 'length' "
                f"field ({err}); write e.g. [12, 40, 7]."
            ) from err
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{flag} {path}: need a non-empty JSON list of lengths, e.g. [12, 40].")
    for index, value in enumerate(data):
        # bool is an int subclass; 3.0 is accepted, 3.5 is not (a length is a token count).
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not integral or value < 1:
            raise ConfigError(
                f"{flag} {path}: entry {index} is {value!r}; every length must be a positive "
                "integer (output tokens)."
            )
    return [int(v) for v in data]


def load_predictions(path: str | Path, count: int) -> list[float]:
    """Predicted lengths (non-negative numbers, one per prompt) from a JSON list file.

    Raises:
        ConfigError: no such file, not a JSON list of numbers, or fewer than ``count``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--predicted: no file at {str(path)!r}.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--predicted {path}: not JSON ({err.msg}).") from err
    ok = isinstance(data, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in data
    )
    if not ok:
        raise ConfigError(f"--predicted {path}: need a JSON list of non-negative numbers.")
    if len(data) < count:
        raise ConfigError(f"--predicted {path}: {len(data)} predictions; need {count}.")
    return [float(x) for x in data[:count]]


def tokenizer_for(model: str):
    """The tokenizer of a built-in model name or of a model directory."""
    from streamrl.policy.models import build_tokenizer, load_tokenizer

    if model in BUILT_IN:
        return build_tokenizer()
    _require_model_dir(Path(model))
    return load_tokenizer(model)


def model_dir_for(model: str, scratch: Path, seed: int = 0, context: int = 0) -> Path:
    """The model directory a benchmark runs, with at least ``context`` positions.

    Args:
        model: ``"tiny"`` (the ~1M-parameter demo shape), ``"qwen2-0.5b"`` (Qwen2.5-0.5B's
            shapes, for GPU runs), both random-init and saved under ``scratch``, or a directory.
        scratch: where a built-in model is saved.
        seed: initialisation seed of a built-in model.
        context: tokens the longest prompt plus its output need (0: no requirement).

    Raises:
        ConfigError: ``model`` is a directory whose context is shorter than ``context``, or no
            model directory.
    """
    if model not in BUILT_IN:
        check_context(model, context)
        return Path(model)
    from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy

    tokenizer = build_tokenizer()
    positions = max(DEFAULT_CONTEXT[model], context)  # rotary: the weights do not change
    built = build_tiny_model(tokenizer, BUILT_IN[model], max_positions=positions, seed=seed)
    return save_policy(built, tokenizer, scratch / model)


def check_context(model_dir: str | Path, needed: int) -> None:
    """Raise a ``ConfigError`` if ``model_dir``'s context is shorter than ``needed`` tokens."""
    path = Path(model_dir)
    _require_model_dir(path)
    context = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    if context is not None and needed > int(context):
        raise ConfigError(
            f"--model {path}: the inputs need {needed} tokens of context (longest prompt plus "
            f"longest output) but the model has max_position_embeddings={context}. Use shorter "
            "lengths (--lengths / --max-tokens), a model with a longer context, or a built-in "
            "model ('tiny'), which is built with the context the inputs need."
        )


def _require_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--model: no model directory at {str(path)!r} (no config.json there); pass a "
            "directory written by save_pretrained or a built-in name: " + ", ".join(BUILT_IN)
        )
