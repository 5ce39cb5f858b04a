"""The prompt stream of a run: ``batch_size`` rows per iteration, reshuffled every epoch, resumable.

``PromptSource`` walks the prompt set with a ``torchdata`` ``StatefulDataLoader``, one row at a
time, so a run's position in its prompt stream is the loader's own ``state_dict()`` (plus the
epoch) and a resumed run deals exactly the rows the uninterrupted run would have dealt.

Each epoch's order is a permutation drawn from a generator seeded with ``(seed, epoch)`` alone:
it does not depend on how many epochs the process has seen before, so a resume that crosses an
epoch boundary draws the same next order as the run that never stopped. (Left to itself, the
loader's generator also draws each new iterator's worker base seed after the permutation, which a
restored iterator does not, so the order after a resumed epoch would differ.)

Examples:
    >>> rows = [{"prompt_id": f"p{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    >>> source = PromptSource(rows, 2, seed=0)
    >>> len(source.next_batch()), source.epoch
    (2, 0)
    >>> state = source.state_dict()
    >>> later = [source.next_row()["prompt_id"] for _ in range(6)]
    >>> resumed = PromptSource(rows, 2, seed=0)
    >>> resumed.load_state_dict(state)
    >>> [resumed.next_row()["prompt_id"] for _ in range(6)] == later
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader


def _plain_row(row: Mapping[str, Any]) -> dict:
    """The loader's collate function: a row as a plain ``dict`` of its columns, untouched (the
    default would turn arrays into tensors)."""
    return dict(row)


class PromptSource:
    """Deals ``batch_size`` prompt rows per call, reshuffled every epoch; resumable.

    Rows come one at a time from a ``StatefulDataLoader`` (``batch_size=None``, shuffled, no
    worker processes: a row is a cheap look-up, and the loader's multiprocess iterator would draw
    a different order from the same seed). Its ``state_dict()`` and the epoch are the source's
    state, stored in the run's checkpoint.

    Args:
        dataset: a map-style prompt set (a ``datasets.Dataset``, a list of dicts...) whose rows
            have ``prompt_id``, ``prompt`` and ``answer``; other columns pass through.
        batch_size: prompts per iteration.
        seed: shuffling seed; the same seed deals the same rows in the same order.

    Raises:
        ValueError: the dataset has no rows.
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]],
        batch_size: int,
        *,
        seed: int = 0,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("PromptSource: the prompt set is empty; give it at least one row.")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self._generator = torch.Generator()
        with warnings.catch_warnings():  # torchdata 0.11 on torch >= 2.9; says nothing of ours
            warnings.filterwarnings("ignore", message=".*'set_vital' is deprecated")
            self._loader = StatefulDataLoader(
                dataset,
                batch_size=None,
                shuffle=True,
                generator=self._generator,
                collate_fn=_plain_row,
            )
        self.epoch = 0
        self._rows = self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> Iterator[dict]:
        """A fresh pass over the loader, shuffled by a generator seeded with (seed, epoch)."""
        self.epoch = epoch
        words = np.random.SeedSequence([self.seed % 2**64, epoch]).generate_state(2, np.uint32)
        self._generator.manual_seed((int(words[0]) << 32 | int(words[1])) & (2**63 - 1))
        return iter(self._loader)

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows (wrapping into a new epoch when needed)."""
        return [self.next_row() for _ in range(self.batch_size)]

    def next_row(self) -> dict:
        """The next row (wrapping into a new epoch when needed)."""
        try:
            return next(self._rows)
        except StopIteration:
            self._rows = self._start_epoch(self.epoch + 1)
            return next(self._rows)

    def state_dict(self) -> dict:
        """``{"epoch": int, "loader": the loader's state_dict()}``; plain values and tensors only
        (checkpoints load with ``torch.load(weights_only=True)``)."""
        return {"epoch": self.epoch, "loader": self._loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken (on a source built on the same prompt set).

        Raises:
            ValueError: ``state`` is not a ``PromptSource.state_dict()`` of this version (a
                checkpoint written before the source ran on ``StatefulDataLoader``).
        """
        if "loader" not in state:
            raise ValueError(
                f"PromptSource.load_state_dict: a state with keys {sorted(state)}, not "
                "{'epoch', 'loader'}; it was written by an older streamrl whose prompt order "
                "cannot be reproduced. Start the run afresh or resume it with that version."
            )
        self.epoch = int(state["epoch"])
        self._loader.load_state_dict(state["loader"])
        self._rows = iter(self._loader)
