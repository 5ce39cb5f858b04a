"""Progress display for long work (tqdm on stderr, so stdout stays machine-readable)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress_bar(iterable: Iterable[T], desc: str, enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr; ``enabled=False`` keeps the same interface but draws nothing."""
    return tqdm(iterable, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True, **kw)
