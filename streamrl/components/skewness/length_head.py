"""A length ranker's distributional head, its loss and its calibration (issue 34).

Both rankers (``LengthRanker``, ``BackboneLengthRanker``) end in a head of two outputs per
prompt: the location ``mu`` and the spread ``sigma`` of its log output length, so a prompt whose
length the policy varies more, or that the ranker reads less surely, gets a wider
``LengthDistribution``. Planners weigh the tail with it (TIE, arXiv 2604.00499: schedule on a
tail-aware expectation, not a point); the order of ``mu`` stays the ranker's ranking (§5.2).

- ``LogLengths``: finished lengths grouped by prompt (the ``G`` samples of a group share one
  row: mean and variance of their logs), so the loss reads each prompt once.
- ``head_loss``: the Gaussian negative log-likelihood of every sample's log length (exact from
  the grouped mean and variance) plus the pairwise ranking term on ``mu``: order matters more
  than the value (§5.2).
- ``widen_point_head``: a head saved before the spread existed, as a two-output head.

Its spread is calibrated by ``calibration.SpreadCalibration``.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Smallest spread the head predicts (log units): the likelihood of a prompt whose samples all
#: had one length must not run off to infinity.
SIGMA_FLOOR = 0.02
#: A fit holds out a calibration slice only when it has at least this many prompts to spare.
MIN_CALIBRATION_PROMPTS = 10


@dataclass(frozen=True)
class LogLengths:
    """Finished lengths of distinct prompts, as the head's targets.

    Attributes:
        mean: per prompt, the mean log length of its samples. ``[n]``
        var: their variance (0 for one sample). ``[n]``
        count: samples per prompt. ``[n]``
        logs: every sample's log length, per prompt (calibration reads them one by one).
    """

    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor
    logs: tuple[tuple[float, ...], ...]

    @staticmethod
    def group(prompts: Sequence[str], lengths: Sequence[int]) -> tuple[list[str], LogLengths]:
        """Distinct prompts in first-seen order, and their lengths (at least 1 token each)."""
        by_prompt: dict[str, list[float]] = defaultdict(list)
        for prompt, length in zip(prompts, lengths):
            by_prompt[prompt].append(math.log(max(int(length), 1)))
        return list(by_prompt), LogLengths.of(list(by_prompt.values()))

    @staticmethod
    def of(logs: Sequence[Sequence[float]]) -> LogLengths:
        values = [torch.tensor(row, dtype=torch.float64) for row in logs]
        mean = torch.stack([v.mean() for v in values])
        var = torch.stack([v.var(correction=0) for v in values])
        count = torch.tensor([len(v) for v in values], dtype=torch.float64)
        return LogLengths(mean.float(), var.float(), count.float(), tuple(map(tuple, logs)))

    def __len__(self) -> int:
        return len(self.logs)

    def take(self, index: Sequence[int]) -> LogLengths:
        return LogLengths.of([self.logs[i] for i in index])

    def standardised(self, shift: float, scale: float) -> LogLengths:
        """The same lengths in units of ``(log length - shift) / scale``."""
        logs = [tuple((v - shift) / scale for v in row) for row in self.logs]
        return LogLengths.of(logs)


def calibration_split(
    prompts: list[str], targets: LogLengths, share: float, seed: int
) -> tuple[list[int], list[int]]:
    """Seeded (train, held-out) indices of distinct prompts: ``share`` of them held out for
    calibration, or none when that would be fewer than ``MIN_CALIBRATION_PROMPTS``."""
    order = list(range(len(prompts)))
    held = int(share * len(order))
    if held < MIN_CALIBRATION_PROMPTS:
        return order, []
    random.Random(seed).shuffle(order)
    return sorted(order[held:]), sorted(order[:held])


def spread(raw: torch.Tensor) -> torch.Tensor:
    """The head's second output as a spread: positive, at least ``SIGMA_FLOOR``."""
    return SIGMA_FLOOR + torch.nn.functional.softplus(raw)


def head_loss(
    out: torch.Tensor,
    target: LogLengths,
    rank_weight: float,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gaussian NLL of every sample's log length + ``rank_weight`` x pairwise ranking on ``mu``.

    Args:
        out: the head's outputs, ``[n, 2]``: ``mu`` and the raw spread (``spread``).
        target: the ``n`` prompts' lengths, in the head's units.
        rank_weight: weight of the ranking term.
        pairs: index pairs ``(i, j)`` to rank (each ``[m]``); ``None``: every pair of the ``n``.

    Returns:
        The scalar loss. The NLL of a prompt's ``c`` samples, from their mean ``m`` and variance
        ``v``, is ``c (log sigma + ((m - mu)^2 + v) / (2 sigma^2))``; it is averaged per sample.
    """
    mu, sigma = out[:, 0], spread(out[:, 1])  # [n], [n]
    mean, var, count = target.mean.to(out), target.var.to(out), target.count.to(out)
    squared = (mean - mu) ** 2 + var  # [n]: mean squared error of the prompt's samples
    # The location learns by squared error, the spread by likelihood around a location it
    # cannot move: a likelihood gradient on mu (scaled by 1 / sigma^2) would chase the prompts
    # already fitted well and rank the rest worse (Seitzer et al. 2022, "pitfalls of NLL").
    nll = sigma.log() + squared.detach() / (2 * sigma**2)
    loss = (count * (squared + nll)).sum() / count.sum()
    if pairs is None:
        i, j = torch.triu_indices(len(mu), len(mu), offset=1, device=mu.device)
    else:
        i, j = pairs
    sign = torch.sign(mean[i] - mean[j])  # ties give 0: no order to learn
    if len(i) and rank_weight:
        ranked = torch.nn.functional.softplus(-sign * (mu[i] - mu[j]))[sign != 0]
        loss = loss + rank_weight * (ranked.mean() if len(ranked) else 0.0)
    return loss


def widen_point_head(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A point head's last linear layer (``[1, h]``, ``[1]``: saved before issue 34) as a
    two-output head: the same location, and a spread of ``spread(0)`` for every prompt."""
    return (
        torch.cat([weight, torch.zeros_like(weight)]),
        torch.cat([bias, torch.zeros_like(bias)]),
    )
