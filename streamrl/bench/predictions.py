"""What ``bench dispatch``'s skew policy may know before generation (StreamRL §5.2, §5.3).

Algorithm 2 needs two things a real system has before it generates a batch: the P50/P90 of
*recent* output lengths (its distribution ``D``) and a predicted length per prompt. Neither may
come from the batch being dispatched. Here both come from an **earlier iteration**:

- The lengths file stands for the policy's output-length distribution. The batch's true
  lengths are the file's (cycled to ``--prompts``); the earlier iteration is a fresh draw of
  ``history`` lengths from the same file (sampled with replacement, its own seed), as a
  stationary policy would produce. Its lengths are ``D``.
- Prompts carry signal about length the way task prompts do, partially. Each prompt is a
  built-in task (``streamrl.tasks``: copy / rev / sort, whose prompt grows with the answer, and
  count, whose short prompt hides a long answer in its numbers) built for the prompt's
  *expected* length; the sample actually generated differs from it by a log-normal factor
  (``sample_sigma``), as sampled answers to one prompt differ in length. So no predictor, however
  good, ranks perfectly, and text is all it has.
- ``ranker``: the library's ``LengthRanker`` is trained on the earlier iteration's
  ``(prompt, length)`` pairs (prompts disjoint from the batch's) and predicts the batch from its
  text alone. This is the headline.
- ``noisy``: the true lengths times log-normal noise (``ranker_noise``): not a ranker but a
  stand-in with a chosen quality, shown beside the ranker and labelled so.
- ``file``: predictions a user computed elsewhere (``--predicted``).

Only the ``oracle`` policy sees the batch's true lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from streamrl.bench.inputs import load_predictions
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.records import LengthDistribution
from streamrl.tasks.families import FAMILIES

Source = Literal["ranker", "noisy", "file"]
SOURCES: tuple[str, ...] = ("ranker", "noisy", "file")


@dataclass
class Batch:
    """Prompts (text) and the output length each one's sample will have (tokens)."""

    prompts: list[str]
    lengths: list[int]


@dataclass
class Predictions:
    """One source's predicted lengths for the batch, and how they were made."""

    source: str
    lengths: list[float]
    info: dict = field(default_factory=dict)
    #: Each prompt's calibrated length distribution (the ranker's; ``None``: point predictions).
    distributions: list[LengthDistribution] | None = None


def task_prompts(lengths: list[int], sample_sigma: float, seed: int, avoid: set[str]) -> list[str]:
    """One task prompt per length, built for an expected length ``length * exp(N(0, sigma))``.

    Args:
        lengths: the lengths the samples will have.
        sample_sigma: log-normal spread of a sample's length around its prompt's expectation.
        seed: draws the tasks, their text and the spread.
        avoid: prompt strings not to produce (the batch's, when drawing the earlier iteration).
    """
    rng = random.Random(seed)
    families = [FAMILIES[name] for name in sorted(FAMILIES)]
    prompts = []
    for length in lengths:
        expected = max(1, round(length * math.exp(rng.gauss(0.0, sample_sigma))))
        family = rng.choice(families)
        prompt, _ = family.make(rng, expected)
        for _ in range(100):  # a short count prompt may repeat one of the batch's: redraw
            if prompt not in avoid:
                break
            prompt, _ = family.make(rng, expected)
        prompts.append(prompt)
    return prompts


def batch_and_history(
    table: list[int], prompts: int, history: int, sample_sigma: float, seed: int
) -> tuple[Batch, Batch]:
    """The batch to dispatch (the file's lengths, cycled) and an earlier iteration drawn from
    the same file with other prompts."""
    true = [table[i % len(table)] for i in range(prompts)]
    batch = Batch(task_prompts(true, sample_sigma, seed, set()), true)
    earlier = random.Random(seed + 1).choices(table, k=history)
    avoid = set(batch.prompts)
    return batch, Batch(task_prompts(earlier, sample_sigma, seed + 2, avoid), earlier)


def predict(
    source: str,
    batch: Batch,
    earlier: Batch,
    *,
    ranker_noise: float,
    seed: int,
    predicted_file: str | None = None,
) -> Predictions:
    """Predicted lengths of ``batch`` from ``source`` (see the module docstring).

    ``ranker`` reads ``batch.prompts`` only; ``noisy`` is derived from ``batch.lengths`` by
    design and labelled so.
    """
    if source == "ranker":
        ranker = LengthRanker(seed=seed)
        ranker.fit(earlier.prompts, earlier.lengths)
        info = {"trained_on": len(earlier.prompts), "train_s": round(ranker.train_s, 2)}
        dists = ranker.predict_distribution(batch.prompts)
        return Predictions("ranker", [d.median for d in dists], info, dists)
    if source == "noisy":
        noise = np.random.default_rng(seed).lognormal(0.0, ranker_noise, len(batch.lengths))
        lengths = (np.asarray(batch.lengths, dtype=float) * noise).tolist()
        return Predictions("noisy", lengths, {"sigma": ranker_noise})
    if source == "file":
        return Predictions("file", load_predictions(predicted_file, len(batch.lengths)))
    raise ValueError(f"unknown predictions source {source!r}; choose from {SOURCES}.")
