"""The distributional length head's pieces: grouped targets, loss, calibration and its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.components.skewness.calibration import SpreadCalibration
from streamrl.components.skewness.length_head import (
    LogLengths,
    head_loss,
    spread,
    widen_point_head,
)
from streamrl.components.skewness.ranking_metrics import coverage, mean_crps
from streamrl.records import LengthDistribution


def test_log_lengths_group_a_prompt_s_samples_into_one_row():
    prompts, targets = LogLengths.group(["a", "b", "a", "a"], [1, 10, 7, 0])
    assert prompts == ["a", "b"] and len(targets) == 2
    # "a": log 1 = 0, log 7, and 0 tokens counted as 1 (log 1 = 0).
    logs_a = [0.0, math.log(7), 0.0]
    assert targets.logs[0] == pytest.approx(logs_a) and targets.count.tolist() == [3, 1]
    assert targets.mean[0].item() == pytest.approx(sum(logs_a) / 3)
    assert targets.var[1].item() == 0.0
    assert targets.take([1]).logs == ((math.log(10),),)


def test_head_loss_is_the_likelihood_of_every_sample():
    # One prompt, samples at log lengths 1 and 3 (mean 2, variance 1); the head says mu = 2,
    # raw spread 0 -> sigma = 0.02 + log 2. Squared error per sample: (0 + 1) = 1; the NLL per
    # sample: log sigma + 1 / (2 sigma^2); no pairs to rank.
    target = LogLengths.of([[1.0, 3.0]])
    out = torch.tensor([[2.0, 0.0]])
    sigma = 0.02 + math.log(2)
    expected = 1.0 + math.log(sigma) + 1 / (2 * sigma**2)
    assert head_loss(out, target, rank_weight=1.0).item() == pytest.approx(expected, rel=1e-5)
    assert spread(torch.tensor([0.0])).item() == pytest.approx(sigma)


def test_head_loss_ranks_pairs_by_the_location():
    target = LogLengths.of([[1.0], [3.0]])
    right = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # the same fit, in the right order
    wrong = torch.tensor([[3.0, 0.0], [1.0, 0.0]])
    base = head_loss(right, target, rank_weight=0.0)
    # softplus(-(3 - 1)) = log(1 + e^-2) for the ordered pair, softplus(2) when reversed.
    assert head_loss(right, target, 1.0).item() == pytest.approx(
        base.item() + math.log1p(math.exp(-2)), rel=1e-5
    )
    assert head_loss(wrong, target, 0.0).item() > base.item()
    assert head_loss(wrong, target, 1.0) - head_loss(wrong, target, 0.0) == pytest.approx(
        math.log1p(math.exp(2)), rel=1e-5
    )


def test_spread_calibration_is_split_conformal():
    calibration = SpreadCalibration(coverage=0.9)
    # 10 residuals 1..10 (sigma 1 around mu 0): k = ceil((10 + 1) * 0.9) = 10 -> the 10th
    # smallest, 10, must sit at the calibrated P90: scale = 10 / 1.2816 (without the + 1 for
    # the new length it would be the 9th).
    calibration.observe([0.0], [1.0], [[float(z) for z in range(1, 11)]])
    assert calibration.scale == pytest.approx(10 / 1.2815516, rel=1e-6)
    # Under sigma 2 the same lengths are residuals of half the size: half the scale.
    other = SpreadCalibration(coverage=0.9)
    other.observe([0.0], [2.0], [[float(z) for z in range(1, 11)]])
    assert other.scale == pytest.approx(calibration.scale / 2)
    (d,) = calibration.apply([math.log(100)], [0.1])
    assert d.sigma == pytest.approx(0.1 * calibration.scale) and d.mu == math.log(100)
    # A head that overshoots every length (negative residuals) keeps a small positive spread.
    low = SpreadCalibration()
    low.observe([5.0], [1.0], [[1.0, 2.0]])
    assert 0 < low.scale < 0.05
    copy = SpreadCalibration()
    copy.load_state_dict(calibration.state_dict())
    assert copy.scale == calibration.scale and list(copy.residuals) == list(calibration.residuals)
    calibration.reset()
    assert calibration.scale == 1.0 and not calibration.residuals
    with pytest.raises(ValueError, match=r"coverage 1\.5"):
        SpreadCalibration(coverage=1.5)


def test_widen_point_head_keeps_the_location_and_adds_a_flat_spread():
    weight, bias = torch.tensor([[1.0, 2.0]]), torch.tensor([0.5])
    wide_w, wide_b = widen_point_head(weight, bias)
    assert wide_w.tolist() == [[1.0, 2.0], [0.0, 0.0]] and wide_b.tolist() == [0.5, 0.0]


def test_coverage_and_crps_with_hand_computed_values():
    d = LengthDistribution(math.log(100), 0.5)  # P90 = 100 e^(0.5 * 1.2816) = 189.7
    assert coverage([d] * 5, [10, 100, 189, 190, 1000]) == 3 / 5
    assert coverage([d] * 2, [100, 150], q=0.5) == 0.5  # the median: 100 <= 100, 150 above
    # A length at its quantile is covered (exp(log 32) is exactly 32.0).
    assert coverage([LengthDistribution.point(32)] * 2, [32, 33]) == 0.5
    # N(mu, 1) at its own mu (z = 0): 2 phi(0) - 1 / sqrt(pi) = 0.797885 - 0.564190.
    at_mu = LengthDistribution(math.log(50), 1.0)
    assert mean_crps([at_mu], [50]) == pytest.approx(0.233695, abs=1e-6)
    # A point scores its absolute log error; a wider spread at the same error scores less.
    point = LengthDistribution.point(50)
    assert mean_crps([point], [500]) == pytest.approx(math.log(10))
    assert mean_crps([at_mu], [500]) < mean_crps([point], [500])
    with pytest.raises(ValueError, match="one distribution per length"):
        coverage([d], [1, 2])


def test_older_batches_of_residuals_weigh_less():
    def scale(decay: float) -> float:
        calibration = SpreadCalibration(coverage=0.9, decay=decay)
        calibration.observe([0.0], [1.0], [[10.0] * 10])  # an older, worse ranker's batch
        calibration.observe([0.0], [1.0], [[1.0] * 30])
        return calibration.scale * 1.2815516  # z*, the residual at the calibrated P90

    # decay 1: plain split conformal, the ceil(41 * 0.9) = 37th smallest of 40 residuals: 10.
    assert scale(1.0) == pytest.approx(10.0, rel=1e-6)
    # decay 0.1: weight 10 x 0.1 + 30 x 1 = 31; the P90 needs 0.9 x (31 + 1) = 28.8, reached
    # within the newer batch's residuals of 1.
    assert scale(0.1) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError, match="decay 0"):
        SpreadCalibration(decay=0)
