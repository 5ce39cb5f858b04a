"""Progress display for long work (tqdm on stderr, so stdout stays machine-readable)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress_bar(iterable: Iterable[T], desc: str, enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr; ``enabled=False`` keeps the same interface but draws nothing.

    Redrawn at most every 0.5 s on a terminal and every 15 s into a log file or pipe, so logs
    stay readable.
    """
    interval = 0.5 if sys.stderr.isatty() else 15.0
    return tqdm(
        iterable,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=interval,
        **kw,
    )
