"""Settings shared by the notebooks in ``notebooks/``: their budget and where figures go."""

from __future__ import annotations

import os
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
