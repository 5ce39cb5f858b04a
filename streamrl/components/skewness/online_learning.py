"""When a length ranker trains, and on what: its online schedule (§5.2).

A ranker predicts each prompt's length as a log-normal (``LengthDistribution``): its own model
gives the location and spread of the log length (``RankerModel.raw``), and ``SpreadCalibration``
scales the spread so that its quantiles cover what the policy really generates; ``predict`` is
the median.

The policy's output lengths drift during RL, so its ranker keeps learning. ``OnlineSchedule``,
which each ranker holds (``ranker.online``), owns what that needs: the bounded buffer of recent
``(prompt, length)`` pairs, the epochs, the calibration. ``RolloutStream`` hands the ranker's
``learn`` the finished samples; while the model is not ``ready`` the schedule fits it from
scratch (once it has two pairs or more), afterwards it first calibrates the predicted spread on
them (lengths the model has not learned from: ``calibration.SpreadCalibration``), then adds
them to the buffer and refreshes the model on that. Both rankers (``LengthRanker``,
``BackboneLengthRanker``) follow this schedule alike; they differ only in the model: what
``RankerModel`` lists.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from streamrl.components.skewness.calibration import SpreadCalibration
from streamrl.components.skewness.length_head import LogLengths, calibration_split
from streamrl.errors import ConfigError
from streamrl.records import LengthDistribution


class RankerModel(Protocol):
    """What ``OnlineSchedule`` trains and asks: a ranker's own model."""

    online: OnlineSchedule

    @property
    def ready(self) -> bool:
        """Whether it has been trained (``raw`` works)."""
        ...

    def fit(
        self, prompts: Sequence[str], lengths: Sequence[int], epochs: int | None = None
    ) -> None:
        """Train from scratch on the pairs (the ranker's own preparation, then
        ``OnlineSchedule.fit``)."""
        ...

    def train_afresh(self, prompts: list[str], targets: LogLengths, epochs: int | None) -> None:
        """New models trained from scratch on distinct ``prompts`` (``epochs``: the ranker's
        own default when ``None``)."""
        ...

    def train_more(self, prompts: list[str], targets: LogLengths, epochs: int) -> None:
        """The models trained further on distinct ``prompts``."""
        ...

    def raw(self, prompts: Sequence[str]) -> tuple[list[float], list[float]]:
        """The model's location and (uncalibrated) spread of each prompt's log length.

        Raises:
            RuntimeError: not ready.
        """
        ...


class OnlineRanker:
    """The ``LengthPredictor`` verbs of a ranker whose model learns on the ``OnlineSchedule``
    it holds (``online``); the ranker provides the model (``RankerModel``)."""

    def __init__(self, **schedule: Any) -> None:
        """``schedule``: ``OnlineSchedule``'s arguments.

        Raises:
            ConfigError: one of them out of range.
        """
        try:
            #: When the model trains and on what; the recent buffer and the calibration.
            self.online = OnlineSchedule(**schedule)
        except ValueError as err:
            raise ConfigError(f"{type(self).__name__}: {err}") from err

    def learn(self: RankerModel, prompts: Sequence[str], lengths: Sequence[int]) -> None:
        """Learn from the policy's finished samples (``OnlineSchedule.learn``).

        Raises:
            ValueError: ``prompts`` and ``lengths`` differ in length.
        """
        self.online.learn(self, prompts, lengths)

    def predict(self: RankerModel, prompts: Sequence[str]) -> list[float]:
        """Predicted median output lengths (tokens) of ``prompts``; their order is what matters."""
        return [math.exp(mu) for mu in self.raw(prompts)[0]]

    def predict_distribution(self: RankerModel, prompts: Sequence[str]) -> list[LengthDistribution]:
        """Each prompt's length distribution, its spread calibrated
        (``OnlineSchedule.predict_distribution``).

        Raises:
            RuntimeError: not ready (call ``learn`` or ``fit`` first).
        """
        return self.online.predict_distribution(self, prompts)


class OnlineSchedule:
    """A ranker's training schedule and the state it keeps: the recent buffer, the epochs and
    the spread's calibration.

    Args:
        buffer: finished ``(prompt, length)`` pairs kept for online refresh.
        learn_epochs: epochs of the fit from scratch that ``learn`` runs while not ready.
        refresh_epochs: epochs of the refresh over the buffer that each ``learn`` runs once
            ready.
        calibration_share: share of a fit's distinct prompts a first model is trained without,
            to calibrate the spread on (0: calibrate only on later ``learn`` calls).
        coverage: the quantile the calibration makes right (0.9: the P90).
        seed: the calibration split's seed.

    Raises:
        ValueError: ``calibration_share`` outside [0, 1).
    """

    def __init__(
        self,
        *,
        buffer: int = 8192,
        learn_epochs: int = 100,
        refresh_epochs: int = 10,
        calibration_share: float = 0.2,
        coverage: float = 0.9,
        seed: int = 0,
    ) -> None:
        if not 0 <= calibration_share < 1:
            raise ValueError(
                f"calibration_share {calibration_share}; need 0 <= share < 1 (0: calibrate only "
                "on later learn() calls)."
            )
        self.learn_epochs, self.refresh_epochs = learn_epochs, refresh_epochs
        self.calibration_share, self.seed = calibration_share, seed
        #: Scales the model's spread to the coverage the policy's samples show.
        self.calibration = SpreadCalibration(coverage)
        #: Finished ``(prompt, output length)`` pairs, the most recent ones.
        self.recent: deque[tuple[str, int]] = deque(maxlen=buffer)

    def predict_distribution(
        self, model: RankerModel, prompts: Sequence[str]
    ) -> list[LengthDistribution]:
        """Each prompt's length distribution: ``LengthDistribution(mu, sigma)``, ``sigma`` the
        model's spread times ``calibration.scale``."""
        return self.calibration.apply(*model.raw(prompts))

    def fit(
        self,
        model: RankerModel,
        prompts: Sequence[str],
        lengths: Sequence[int],
        epochs: int | None = None,
    ) -> None:
        """Train ``model`` from scratch on ``(prompt, length)`` pairs (a prompt may come with
        several) and add them to the buffer.

        With enough prompts, a first model trains without a held-out ``calibration_share`` of
        them and calibrates the spread on those (split conformal); then the model is trained
        again on all of them (its spread scaled as the first one's needed).

        Raises:
            ValueError: fewer than two pairs, or not one length per prompt.
        """
        if len(prompts) != len(lengths) or len(prompts) < 2:
            raise ValueError(
                f"{type(model).__name__}.fit: need >= 2 prompts and one length per prompt."
            )
        distinct, targets = LogLengths.group(prompts, lengths)
        train, held = calibration_split(distinct, targets, self.calibration_share, self.seed)
        self.calibration.reset()
        if held:
            model.train_afresh([distinct[i] for i in train], targets.take(train), epochs)
            held_logs = targets.take(held).logs
            self.calibration.observe(*model.raw([distinct[i] for i in held]), held_logs)
        model.train_afresh(distinct, targets, epochs)
        self.recent.extend(zip(prompts, (int(n) for n in lengths)))

    def learn(self, model: RankerModel, prompts: Sequence[str], lengths: Sequence[int]) -> None:
        """Learn from the policy's finished samples (``LengthPredictor.learn``).

        While ``model`` is not ready, fits it from scratch for ``learn_epochs`` on these pairs
        and any kept from earlier calls (fewer than two pairs in all are kept for the next
        call); once ready, calibrates on them (before it has learned them), adds them to the
        buffer and refreshes for ``refresh_epochs``.

        Raises:
            ValueError: ``prompts`` and ``lengths`` differ in length.
        """
        if len(prompts) != len(lengths):
            raise ValueError(
                f"{type(model).__name__}.learn: {len(prompts)} prompts but {len(lengths)} lengths."
            )
        pairs = list(zip(prompts, (int(n) for n in lengths)))
        if model.ready:
            self.observe_held_out(model, prompts, lengths)
            self.recent.extend(pairs)
            self.refresh(model, self.refresh_epochs)
        elif len(self.recent) + len(pairs) < 2:
            self.recent.extend(pairs)  # too few to fit: kept for the next call
        else:
            self._fit_afresh(model, [*self.recent, *pairs], self.learn_epochs)

    def update(self, model: RankerModel, pairs: list[tuple[str, int]], epochs: int) -> None:
        """Calibrate on finished ``(prompt, length)`` pairs, add them to the buffer and refresh
        for ``epochs``."""
        self.observe_held_out(model, [p for p, _ in pairs], [n for _, n in pairs])
        self.recent.extend(pairs)
        self.refresh(model, epochs)

    def observe_held_out(
        self, model: RankerModel, prompts: Sequence[str], lengths: Sequence[int]
    ) -> None:
        """Calibrate the spread on finished samples not learned from yet; nothing while
        ``model`` is not ready.

        Args:
            model: the ranker's model.
            prompts: the samples' prompt texts (a prompt may repeat: its group's samples).
            lengths: their output lengths, in tokens.
        """
        if model.ready:
            distinct, targets = LogLengths.group(prompts, lengths)
            self.calibration.observe(*model.raw(distinct), targets.logs)

    def refresh(self, model: RankerModel, epochs: int) -> None:
        """Train ``model`` further on the buffer (or fit it from scratch if never trained)."""
        if not model.ready:
            self._fit_afresh(model, list(self.recent), None)
            return
        distinct, targets = LogLengths.group(*zip(*self.recent))
        model.train_more(distinct, targets, epochs)

    def _fit_afresh(
        self, model: RankerModel, pairs: list[tuple[str, int]], epochs: int | None
    ) -> None:
        """Fit ``model`` from scratch on ``pairs``, which replace the buffer (``fit`` adds
        them); on failure the buffer is as it was.

        Raises:
            ValueError: fewer than two pairs.
        """
        if len(pairs) < 2:
            raise ValueError(
                f"{type(model).__name__}: {len(pairs)} finished samples to fit on; need >= 2. "
                "Call learn() or fit() with more."
            )
        kept = list(self.recent)
        self.recent.clear()
        try:
            model.fit([p for p, _ in pairs], [n for _, n in pairs], epochs=epochs)
        except BaseException:
            self.recent.clear()
            self.recent.extend(kept)
            raise

    def state_dict(self) -> dict:
        """The buffer and the calibration (the ranker adds its model's)."""
        return {"recent": list(self.recent), "calibration": self.calibration.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore from a ranker's saved state; one saved before calibration has none yet."""
        self.recent.clear()
        self.recent.extend(state["recent"])
        self.calibration.reset()
        if "calibration" in state:
            self.calibration.load_state_dict(state["calibration"])
