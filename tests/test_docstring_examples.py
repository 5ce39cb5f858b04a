"""Every ``Examples:`` block in streamrl's docstrings runs and prints what it says.

A docstring's example is the first code a reader copies; one that names a module that moved or a
model size that was renamed teaches the wrong call. Each module with a ``>>>`` line runs here as
``python -m doctest`` would (``+SKIP`` marks the few that need a GPU or a cluster).
"""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "streamrl").rglob("*.py")
    if ">>> " in path.read_text(encoding="utf-8")
)


def test_the_package_has_docstring_examples() -> None:
    assert len(MODULES) >= 50, f"found only {len(MODULES)} modules with examples: a bad glob?"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name.removesuffix(".__init__"))
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
