"""Files and folders a reader (an operator, ``scripts/chaos.py``, a resumed run) sees whole or
not at all, even when the writer is killed half-way: written beside, then renamed into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["fsync_dir", "point_link_at", "write_text_atomic"]


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a sibling file and one ``os.replace``. The sibling is
    this process's own, so writers racing to one path (generator instances caching the same
    profile) each replace it whole: the last one wins, none leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_link_at(link: Path, folder: Path) -> None:
    """Make ``link`` a relative symbolic link to ``folder`` (its sibling) in one ``os.replace``,
    then delete the other ``.<link name>.*`` siblings (earlier targets, half-written ones). A
    real folder at ``link`` (written before links were used) is set aside first, then deleted."""
    staged = link.with_name(f".{link.name}.link")
    staged.unlink(missing_ok=True)
    staged.symlink_to(folder.name, target_is_directory=True)
    if link.is_dir() and not link.is_symlink():
        link.rename(link.with_name(f".{link.name}.folder"))
    os.replace(staged, link)
    fsync_dir(link.parent)
    for stale in link.parent.glob(f".{link.name}.*"):
        if stale == folder:
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink()
