"""How a length ranker predicts and learns online from the policy's finished samples (§5.2).

A ranker predicts each prompt's length as a log-normal (``LengthDistribution``): its own model
gives the location and spread of the log length (``_raw``), and ``SpreadCalibration`` scales the
spread so that its quantiles cover what the policy really generates; ``predict`` is the median.

The policy's output lengths drift during RL, so its ranker keeps learning: ``RolloutStream``
hands ``learn`` the finished samples; while the ranker is not ``ready`` it fits from scratch
(once it has two pairs or more), afterwards it first calibrates its predicted spread on them
(they are lengths it has not learned from: ``calibration.SpreadCalibration``), then adds them
to its bounded recent buffer and refreshes on that. Both rankers (``LengthRanker``,
``BackboneLengthRanker``) predict and follow this schedule alike; they differ only in the model
``_raw`` runs and what ``fit`` and ``refresh`` train.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from streamrl.components.skewness.calibration import SpreadCalibration
from streamrl.components.skewness.length_head import LogLengths
from streamrl.records import LengthDistribution


class Refittable(Protocol):
    """What ``OnlineLearning`` uses of the ranker that takes it on."""

    #: Finished ``(prompt, output length)`` pairs, the most recent ones (bounded).
    recent: deque[tuple[str, int]]
    #: Epochs of the fit from scratch that ``learn`` runs while not ``ready``.
    learn_epochs: int
    #: Epochs of the refresh over ``recent`` that each ``learn`` runs once ``ready``.
    refresh_epochs: int
    #: Scales the model's spread to the coverage the policy's samples show.
    calibration: SpreadCalibration

    @property
    def net(self) -> torch.nn.Module | None:
        """The trained model; ``None`` until fitted."""
        ...

    @property
    def ready(self) -> bool: ...

    def fit(
        self, prompts: Sequence[str], lengths: Sequence[int], epochs: int | None = None
    ) -> None:
        """Train from scratch on the pairs and add them to ``recent``."""
        ...

    def refresh(self, epochs: int) -> None:
        """Fine-tune on ``recent``."""
        ...

    def _raw(self, prompts: Sequence[str]) -> tuple[list[float], list[float]]:
        """The model's location and (uncalibrated) spread of each prompt's log length.

        Raises:
            RuntimeError: not ready.
        """
        ...


class OnlineLearning:
    """The ``LengthPredictor`` verbs (``ready``, ``predict``, ``predict_distribution``,
    ``learn``) of a ranker that provides what ``Refittable`` lists (its ``net``, ``recent``
    buffer, epochs, ``calibration``, ``fit``, ``refresh`` and ``_raw``)."""

    @property
    def ready(self: Refittable) -> bool:
        """Whether it has been fitted (``predict`` works)."""
        return self.net is not None

    def predict(self: Refittable, prompts: Sequence[str]) -> list[float]:
        """Predicted median output lengths (tokens) of ``prompts``; their order is what matters."""
        return [math.exp(mu) for mu in self._raw(prompts)[0]]

    def predict_distribution(self: Refittable, prompts: Sequence[str]) -> list[LengthDistribution]:
        """Each prompt's length distribution (one sample's length), its spread calibrated.

        Args:
            prompts: prompt texts, as ``predict`` takes them.

        Returns:
            ``LengthDistribution(mu, sigma)`` per prompt: ``exp(mu)`` is ``predict``'s median,
            ``sigma`` the model's spread times ``calibration.scale`` (``SpreadCalibration``).

        Raises:
            RuntimeError: not ready (call ``learn`` or ``fit`` first).
        """
        return self.calibration.apply(*self._raw(prompts))

    def observe_held_out(self: Refittable, prompts: Sequence[str], lengths: Sequence[int]) -> None:
        """Calibrate the spread on finished samples not learned from yet (``learn`` calls this
        before it refreshes on them); nothing while not ``ready``.

        Args:
            prompts: the samples' prompt texts (a prompt may repeat: its group's samples).
            lengths: their output lengths, in tokens.
        """
        if self.ready:
            distinct, targets = LogLengths.group(prompts, lengths)
            self.calibration.observe(*self._raw(distinct), targets.logs)

    def learn(self: Refittable, prompts: Sequence[str], lengths: Sequence[int]) -> None:
        """Learn from the policy's finished samples (``LengthPredictor``).

        While not ``ready``, fits from scratch for ``learn_epochs`` on these pairs and any kept
        from earlier calls (fewer than two pairs in all are kept for the next call); once
        ``ready``, calibrates on them (before it has learned them), adds them to the recent
        buffer and refreshes for ``refresh_epochs``.

        Raises:
            ValueError: ``prompts`` and ``lengths`` differ in length.
        """
        if len(prompts) != len(lengths):
            raise ValueError(
                f"{type(self).__name__}.learn: {len(prompts)} prompts but {len(lengths)} lengths."
            )
        pairs = list(zip(prompts, (int(n) for n in lengths)))
        if self.ready:
            self.observe_held_out(prompts, lengths)
            self.recent.extend(pairs)
            self.refresh(epochs=self.refresh_epochs)
        elif len(self.recent) + len(pairs) < 2:
            self.recent.extend(pairs)  # too few to fit: kept for the next call
        else:
            fit_afresh(self, [*self.recent, *pairs], self.learn_epochs)


def fit_afresh(ranker: Refittable, pairs: list[tuple[str, int]], epochs: int | None) -> None:
    """Fit ``ranker`` from scratch on ``pairs``, which replace its recent buffer (``fit`` adds
    them); on failure the buffer is as it was.

    Raises:
        ValueError: fewer than two pairs.
    """
    if len(pairs) < 2:
        raise ValueError(
            f"{type(ranker).__name__}: {len(pairs)} finished samples to fit on; need >= 2. "
            "Call learn() or fit() with more."
        )
    kept = list(ranker.recent)
    ranker.recent.clear()
    try:
        ranker.fit([p for p, _ in pairs], [n for _, n in pairs], epochs=epochs)
    except BaseException:
        ranker.recent.clear()
        ranker.recent.extend(kept)
        raise
