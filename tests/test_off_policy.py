"""Off-policy correction of stale samples (async mode), hand-computed."""

from __future__ import annotations

import math

import torch

from streamrl.algorithms import GRPO
from streamrl.algorithms.base import LossInputs
from streamrl.components.training.off_policy import correct_stale


def test_stale_rows_get_proximal_old_logprobs_and_truncated_weights():
    current = torch.log(torch.tensor([[0.5, 0.4], [0.3, 0.6]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.25, 0.4], [0.3, 0.1]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    fix = correct_stale(current, behaviour, mask, torch.tensor([True, False]), cap=1.5)
    # Row 0 is stale: ratios pi_prox / pi_behaviour = 2.0 (truncated to 1.5) and 1.0.
    assert fix.weights.tolist() == [[1.5, 1.0], [1.0, 1.0]]
    assert torch.equal(fix.old_logprobs[0], current.detach()[0])  # proximal: current, detached
    assert torch.equal(fix.old_logprobs[1], behaviour[1])  # fresh row untouched
    assert math.isclose(fix.ratio_mean, 1.5) and math.isclose(fix.ratio_max, 2.0)
    assert fix.truncated_frac == 0.5 and fix.stale_samples == 1
    fresh = correct_stale(current, behaviour, mask, torch.tensor([False, False]), cap=1.5)
    assert fresh.weights is None and fresh.old_logprobs is behaviour


def test_weights_scale_the_surrogate_and_its_gradient():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    fix = correct_stale(
        logprobs,
        torch.log(torch.tensor([[0.5, 2.0]])),
        torch.ones(1, 2),
        torch.tensor([True]),
        cap=1.5,
    )
    batch = LossInputs(
        logprobs, fix.old_logprobs, torch.tensor([1.0]), torch.ones(1, 2), token_weights=fix.weights
    )
    loss = GRPO(group_size=2, clip_eps=0.2).loss(batch)  # the base applies them
    # Ratio to the proximal policy is 1 (value), so the loss is -A x weight, averaged: weights
    # min(2, 1.5) = 1.5 and 0.5 -> -(1.5 + 0.5) / 2 = -1.0; d/dlogprob = -weight / 2.
    assert loss.item() == -1.0
    loss.backward()
    assert logprobs.grad.tolist() == [[-0.75, -0.25]]
