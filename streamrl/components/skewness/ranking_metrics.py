"""Ranking metrics for output-length prediction (StreamRL §5.2, Table 4)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def recall_at_k(predicted: Sequence[float], true: Sequence[float], fraction: float) -> float:
    """|predicted top-k ∩ true top-k| / |true top-k|, with k = ``fraction`` of the items.

    Ties in ``true`` are broken by position, so the true top-k has exactly k items.

    Examples:
        >>> recall_at_k([5, 4, 3, 2, 1], [9, 1, 8, 2, 0], 0.4)  # top-2: {0, 1} vs {0, 2}
        0.5
    """
    if len(predicted) != len(true) or not len(true):
        raise ValueError("recall_at_k: need equally long, non-empty sequences.")
    k = max(1, round(fraction * len(true)))
    top_true = set(np.argsort(-np.asarray(true, dtype=float), kind="stable")[:k].tolist())
    top_pred = set(np.argsort(-np.asarray(predicted, dtype=float), kind="stable")[:k].tolist())
    return len(top_true & top_pred) / k


def kendall_tau(predicted: Sequence[float], true: Sequence[float]) -> float:
    """Kendall's tau-b between two scorings (1: same order, -1: reversed; ties handled).

    Examples:
        >>> kendall_tau([1, 2, 3, 4], [10, 20, 40, 30])  # one discordant pair of six
        0.6666666666666666
    """
    x, y = np.asarray(predicted, dtype=float), np.asarray(true, dtype=float)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("kendall_tau: need equally long sequences of at least 2 items.")
    concordance, ties_x, ties_y, pairs = 0, 0, 0, 0
    for i in range(len(x) - 1):  # row by row: O(n) memory for any n
        dx, dy = np.sign(x[i + 1 :] - x[i]), np.sign(y[i + 1 :] - y[i])
        concordance += int((dx * dy).sum())
        ties_x, ties_y = ties_x + int((dx == 0).sum()), ties_y + int((dy == 0).sum())
        pairs += len(dx)
    denominator = ((pairs - ties_x) * (pairs - ties_y)) ** 0.5
    return concordance / denominator if denominator else 0.0
