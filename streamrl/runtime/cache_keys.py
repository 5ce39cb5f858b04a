"""What a cached warm start is keyed by: the contents and the code it was made from.

A warm start keyed by names (the environment's, the demonstrations' function's, the rows' ids)
is silently reused after the user edits the demonstrations or the rows. These digests key it by
what it learned from instead: every row's content, the source of the modules that make the
environment and the demonstrations, plus the settings; a reuse is announced on stderr with the
parts of its key, and ``sft.cache: false`` (``streamrl fit --no-cache``) trains afresh.

Examples:
    >>> row = {"prompt": "a", "answer": "1"}
    >>> rows_digest([row]) == rows_digest([{"answer": "1", "prompt": "a"}])
    True
    >>> rows_digest([row]) == rows_digest([{**row, "answer": "2"}])
    False
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import marshal
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["announce_reuse", "code_digest", "rows_digest"]


def rows_digest(rows: Iterable[Mapping[str, Any]]) -> str:
    """A digest of every row's content (all columns; row order does not matter)."""
    lines = sorted(json.dumps(dict(row), sort_keys=True, default=str) for row in rows)
    return _digest("\n".join(lines).encode())


def code_digest(obj: Any) -> str:
    """A digest of the code behind ``obj`` (a function, a class, a ``functools.partial`` of
    either): the source of its whole module, so an edit anywhere in it counts; the compiled
    function when there is no source file (a notebook cell); else its qualified name."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    module = inspect.getmodule(obj)
    try:
        return _digest(inspect.getsource(module if module is not None else obj).encode())
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        if code is not None:
            return _digest(marshal.dumps(code))
        return _digest(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', obj)}")


def announce_reuse(target: Path, parts: Mapping[str, Any]) -> None:
    """Say on stderr that the warm start at ``target`` is reused, and what its key is made of."""
    key = ", ".join(f"{name} {value}" for name, value in parts.items())
    print(
        f"warm start: reusing {target} (cached for {key}); --no-cache trains it afresh",
        file=sys.stderr,
    )


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:12]
