"""Metrics of output-length prediction: ranking (StreamRL §5.2, Table 4), and of predicted
distributions, their coverage and a proper score (issue 34)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from streamrl.records import LengthDistribution

_NORMAL = NormalDist()


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


def coverage(
    distributions: Sequence[LengthDistribution], lengths: Sequence[float], q: float = 0.9
) -> float:
    """Share of ``lengths`` at or below their predicted ``q``-quantile (a calibrated P90 covers
    about 0.9 of held-out lengths; issue 34).

    Examples:
        >>> d = LengthDistribution(math.log(100), 0.5)  # P90 ~190
        >>> coverage([d] * 4, [50, 150, 189, 400])
        0.75
    """
    if len(distributions) != len(lengths) or not len(lengths):
        raise ValueError("coverage: need one distribution per length, and at least one.")
    return sum(n <= d.quantile(q) for d, n in zip(distributions, lengths)) / len(lengths)


def mean_crps(distributions: Sequence[LengthDistribution], lengths: Sequence[float]) -> float:
    """Mean continuous ranked probability score of the log lengths (lower is better; a proper
    score: it rewards a spread that is right, not only a location). For ``N(mu, sigma)`` and
    ``z = (log n - mu) / sigma``: ``sigma (z (2 Phi(z) - 1) + 2 phi(z) - 1 / sqrt(pi))``; a point
    (``sigma`` 0) scores its absolute error.

    Examples:
        >>> round(mean_crps([LengthDistribution.point(100)], [1000]), 4)  # |log 1000 - log 100|
        2.3026
    """
    if len(distributions) != len(lengths) or not len(lengths):
        raise ValueError("mean_crps: need one distribution per length, and at least one.")
    total = 0.0
    for d, n in zip(distributions, lengths):
        error = math.log(max(n, 1)) - d.mu
        if d.sigma == 0:
            total += abs(error)
            continue
        z = error / d.sigma
        total += d.sigma * (
            z * (2 * _NORMAL.cdf(z) - 1) + 2 * _NORMAL.pdf(z) - 1 / math.sqrt(math.pi)
        )
    return total / len(lengths)
