"""Calibration of a length ranker's predicted spread (issue 34).

A head trained on the policy's lengths reads its own training prompts too well: its raw spread
is too narrow for prompts it has not seen. ``SpreadCalibration`` scales every spread so that the
predicted P90 (``coverage``) covers that share of lengths the head had not learned from: a
held-out slice at a fit, then each new batch of finished samples, scored before an online refresh
learns it. The scale is a split-conformal quantile (Vovk et al. 2005; Lei et al. 2018), with
older batches weighed down (Barber et al. 2023, "Conformal prediction beyond exchangeability"):
the ranker that made an old residual was a worse one, and the policy's lengths drift.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from statistics import NormalDist

from streamrl.components.skewness.length_head import SIGMA_FLOOR
from streamrl.records import LengthDistribution


class SpreadCalibration:
    """Conformal scale of a head's spreads, so its ``coverage`` quantile covers that share of
    held-out lengths.

    It keeps the last ``window`` standardised residuals ``z = (log length - mu) / sigma`` of
    lengths the head had not learned from, each weighed ``decay ** age`` (``age``: how many
    ``observe`` calls ago it came), and scales every ``sigma`` by ``s = z* / Phi^-1(q)``, where
    ``z*`` is the smallest residual whose weight and the weight of those below it reach
    ``q (W + 1)`` (``W``: all the weight; the ``1`` is the new length's own). With ``decay`` 1
    that is the ``ceil((n + 1) q)``-th smallest of ``n`` residuals: split conformal prediction,
    whose calibrated q-quantile covers at least a share ``q`` of exchangeable new lengths.

    Args:
        coverage: the quantile calibrated, ``q`` (the P90 by default).
        window: residuals kept (the oldest drop first).
        decay: weight of a batch's residuals against the next batch's, in (0, 1].

    Raises:
        ValueError: ``coverage`` outside (0.5, 1), ``window`` below 1 or ``decay`` outside
            (0, 1].

    Examples:
        >>> calibration = SpreadCalibration(coverage=0.9)
        >>> calibration.observe([0.0] * 10, [1.0] * 10, [[z / 5] for z in range(-4, 6)])
        >>> round(calibration.scale, 3)  # the 10th smallest of 10 residuals, 1.0, / 1.2816
        0.78
    """

    def __init__(self, coverage: float = 0.9, window: int = 4096, decay: float = 0.5) -> None:
        if not 0.5 < coverage < 1:
            raise ValueError(f"SpreadCalibration: coverage {coverage}; need 0.5 < coverage < 1.")
        if window < 1:
            raise ValueError(f"SpreadCalibration: window {window}; need at least 1 residual.")
        if not 0 < decay <= 1:
            raise ValueError(f"SpreadCalibration: decay {decay}; need 0 < decay <= 1.")
        self.coverage, self.decay = coverage, decay
        #: ``(residual, batch)``: ``batch`` counts ``observe`` calls.
        self.residuals: deque[tuple[float, int]] = deque(maxlen=window)
        self.batches = 0
        self.scale = 1.0

    def reset(self) -> None:
        """Forget every residual (a fit from scratch is a new head); the scale returns to 1."""
        self.residuals.clear()
        self.batches, self.scale = 0, 1.0

    def observe(
        self, mu: Sequence[float], sigma: Sequence[float], logs: Sequence[Sequence[float]]
    ) -> None:
        """Add one batch of held-out log lengths (``logs[i]``: prompt ``i``'s samples) under the
        head's raw ``mu`` and ``sigma``, and update the scale."""
        self.batches += 1
        for m, s, row in zip(mu, sigma, logs):
            self.residuals.extend(((v - m) / s, self.batches) for v in row)
        if self.residuals:
            self.scale = max(self._quantile() / NormalDist().inv_cdf(self.coverage), SIGMA_FLOOR)

    def _quantile(self) -> float:
        """The weighted conformal quantile ``z*`` of the residuals."""
        weighted = sorted((z, self.decay ** (self.batches - batch)) for z, batch in self.residuals)
        needed = self.coverage * (sum(w for _, w in weighted) + 1.0)
        reached = 0.0
        for z, weight in weighted:
            reached += weight
            if reached >= needed - 1e-12:
                return z
        return weighted[-1][0]  # too few residuals for the quantile: the largest

    def apply(self, mu: Sequence[float], sigma: Sequence[float]) -> list[LengthDistribution]:
        """Calibrated distributions of the head's raw ``mu`` and ``sigma``. A residual quantile
        at or below 0 (the head overshoots) leaves the smallest spread, which covers."""
        return [LengthDistribution(m, s * self.scale) for m, s in zip(mu, sigma)]

    def state_dict(self) -> dict:
        return {
            "coverage": self.coverage,
            "decay": self.decay,
            "residuals": list(self.residuals),
            "batches": self.batches,
            "scale": self.scale,
        }

    def load_state_dict(self, state: dict) -> None:
        self.coverage, self.decay, self.scale = state["coverage"], state["decay"], state["scale"]
        self.batches = state["batches"]
        self.residuals.clear()
        self.residuals.extend((z, batch) for z, batch in state["residuals"])
