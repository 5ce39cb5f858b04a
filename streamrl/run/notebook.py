"""Settings shared by the notebooks in ``notebooks/``: their budget and where figures go."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def notebook_settings() -> tuple[bool, Path]:
    """``(small, out)`` from the environment.

    ``STREAMRL_NOTEBOOK_BUDGET``: ``"small"`` is the quick run the tests use, ``"full"`` (default)
    shows real learning. ``STREAMRL_NOTEBOOK_OUT``: where figures go (created); by default
    ``out/`` when Jupyter runs a notebook from its own folder, ``notebooks/out/`` from the
    repository root.
    """
    budget = os.environ.get("STREAMRL_NOTEBOOK_BUDGET", "full")
    if budget not in ("small", "full"):
        raise ValueError(f"STREAMRL_NOTEBOOK_BUDGET must be 'small' or 'full', got {budget!r}.")
    default = "out" if Path.cwd().name == "notebooks" else "notebooks/out"
    out = Path(os.environ.get("STREAMRL_NOTEBOOK_OUT", default))
    out.mkdir(parents=True, exist_ok=True)
    return budget == "small", out


def repo_file(relative: str) -> Path:
    """``relative`` (e.g. ``"configs/demo.yaml"``) in the checkout that holds the notebooks.

    Looked up from the running script's folder (``python notebooks/07_reasoning_gym.py``) and
    from the working directory, and their parents: a notebook in Jupyter has no ``__file__``, but
    Jupyter runs it from its own folder.

    Raises:
        FileNotFoundError: none of those folders holds ``relative``.
    """
    script = getattr(sys.modules["__main__"], "__file__", None)
    starts = [Path(script).resolve().parent] if script else []
    for folder in [p for start in [*starts, Path.cwd()] for p in [start, *start.parents]]:
        if (folder / relative).exists():
            return folder / relative
    raise FileNotFoundError(
        f"{relative} not found from {Path.cwd()} or its parents; run the notebook from a "
        "checkout of the streamrl repository (its root or notebooks/)."
    )
