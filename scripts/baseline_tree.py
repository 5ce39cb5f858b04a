"""Another revision's code beside this tree's, for the scripts that measure both in one run."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(revision: str) -> Path:
    """A git worktree of ``revision`` (made once, under the temporary directory): put it first
    on ``PYTHONPATH`` to run that revision's ``streamrl``."""
    path = Path(tempfile.gettempdir()) / f"streamrl-baseline-{revision}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), revision],
            check=True,
            capture_output=True,
        )
    return path
