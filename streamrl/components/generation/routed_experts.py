"""The experts a mixture-of-experts generator chose, per running sequence and cache column
(rollout routing replay: ``streamrl.policy.routing``).

``HFStreamGenerator`` runs its forwards over cache rows of different lengths; ``RoutedExperts``
takes what the routers chose in each forward (``RoutingRecorder``, over the forward's flattened
``[rows, width]`` input) and files it under each sequence's cache columns, the latest forward's
winning (a partial rollout's recomputation, a rejected draft fed again). A finished sequence's
experts are one ``int16`` array ``[prompt + generated tokens, layers, k]``: the columns no forward
of this generator computed (an episode's kept prefix; the last token, never fed) are
``NOT_RECORDED``, which the trainer's routers choose for themselves.

vLLM records them itself (``enable_return_routed_experts``); ``from_engine`` brings its rows to
the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from streamrl.components.generation.slot_sequence import SlotSequence
from streamrl.policy.routing import NOT_RECORDED, RoutingRecorder, is_moe


class RoutedExperts:
    """Files each forward's expert choices under its sequences' columns."""

    def __init__(self, model: nn.Module) -> None:
        self.recorder = RoutingRecorder(model).__enter__()  # on for the generator's life
        self._by_row: dict[int, dict[int, np.ndarray]] = {}

    @staticmethod
    def of(model: nn.Module) -> RoutedExperts | None:
        """A recorder for a mixture-of-experts ``model``; ``None`` for a dense one."""
        return RoutedExperts(model) if is_moe(model) else None

    def file(self, placed: Sequence[tuple[SlotSequence, range]], width: int) -> None:
        """After one forward over ``[len(placed), width]`` inputs: row ``i`` of it fed its
        sequence's cache columns ``placed[i][1]``, left-aligned."""
        chosen = self.recorder.take().numpy()  # [rows * width, layers, k]
        for i, (row, columns) in enumerate(placed):
            mine = self._by_row.setdefault(id(row), {})
            for j, column in enumerate(columns):
                mine[column] = chosen[i * width + j]

    def finish(self, row: SlotSequence) -> np.ndarray:
        """The experts of a finished sequence, ``[prompt + generated, layers, k]``, and forget
        it."""
        mine = self._by_row.pop(id(row), {})
        length = len(row.request.prompt_ids) + len(row.token_ids)
        layers, k = len(self.recorder.routers), int(self.recorder.routers[0].top_k)
        out = np.full((length, layers, k), NOT_RECORDED, dtype=np.int16)
        for column, experts in mine.items():
            if column < length:
                out[column] = experts
        return out

    def forget(self, row: SlotSequence) -> None:
        """Drop what a sequence that left unfinished (moved, released) holds."""
        self._by_row.pop(id(row), None)


def from_engine(rows: np.ndarray | None, length: int) -> np.ndarray | None:
    """vLLM's ``routed_experts`` of a finished request as ``Sample.routed_experts``.

    vLLM returns one row per token its forwards computed, ``[tokens, layers, k]``: the prompt
    and every generated token but the last (never fed). They become ``int16``
    ``[length, layers, k]``, ``NOT_RECORDED`` past them.

    Args:
        rows: the completion's ``routed_experts``; ``None`` (not asked for) stays ``None``.
        length: the sample's prompt plus generated tokens.

    Raises:
        ValueError: more rows than tokens, or not three dimensions (another vLLM layout).
    """
    if rows is None:
        return None
    rows = np.asarray(rows)
    if rows.ndim != 3 or len(rows) > length:
        raise ValueError(
            f"vLLM returned routed experts of shape {rows.shape} for a sample of {length} "
            "tokens; expected [at most that many tokens, layers, k] (vLLM 0.32's layout)."
        )
    out = np.full((length, *rows.shape[1:]), NOT_RECORDED, dtype=np.int16)
    out[: len(rows)] = rows
    return out
