"""Token losses shared by the policy-gradient algorithms (GRPO, RLOO, REINFORCE++, DAPO, PPO).

``clipped_surrogate`` is PPO's clipped objective (Schulman et al. 2017, Eq. 7) with the
generator's behaviour log-probs as the old policy; ``k3_kl`` is the non-negative KL estimator
GRPO adds to its loss (DeepSeekMath 2024, Eq. 4); ``policy_token_loss`` is the two together, as
the ``TokenLoss`` that GRPO, RLOO and REINFORCE++ return from ``token_loss``. ``per_sample``
(defined in ``base``, where ``Algorithm.loss`` uses it) turns token losses into the per-sample
loss the trainer sums (``StreamRLModule`` divides the sum by the samples per iteration).
"""

from __future__ import annotations

import torch

from streamrl.algorithms.base import LossInputs, TokenLoss, per_sample


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float | None = None,
) -> torch.Tensor:
    """Per-token ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``.

    Args:
        logprobs: ``[batch, seq]``; the ratio is ``exp(logprobs - old_logprobs)``.
        old_logprobs: ``[batch, seq]``.
        advantages: ``[batch]`` (one per sample, broadcast over its tokens) or ``[batch, seq]``.
        eps_low: lower clip range.
        eps_high: upper clip range; ``None`` uses ``eps_low`` (symmetric, as in PPO). DAPO's
            clip-higher sets it larger so that low-probability tokens can grow (Yu et al. 2025).

    Returns:
        ``[batch, seq]``; mask padding yourself.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [batch, seq]
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [batch, 1 or seq]
    high = eps_low if eps_high is None else eps_high
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + high)
    return -torch.minimum(ratio * adv, clipped * adv)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate ``exp(ref - cur) - (ref - cur) - 1`` (>= 0), ``[batch, seq]``."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def policy_token_loss(
    batch: LossInputs, eps_low: float, eps_high: float | None = None, kl_coef: float = 0.0
) -> TokenLoss:
    """Clipped surrogate as the policy term, ``kl_coef`` x k3 KL as the auxiliary term.

    The KL term is there only when ``kl_coef > 0`` and the batch has reference log-probs.

    Args:
        batch: the micro-batch.
        eps_low: lower clip range.
        eps_high: upper clip range; ``None``: ``eps_low`` (see ``clipped_surrogate``).
        kl_coef: weight of the k3 KL penalty to the reference policy.
    """
    policy = clipped_surrogate(
        batch.logprobs, batch.old_logprobs, batch.advantages, eps_low, eps_high
    )
    auxiliary = None
    if kl_coef > 0 and batch.ref_logprobs is not None:
        auxiliary = kl_coef * k3_kl(batch.logprobs, batch.ref_logprobs)
    return TokenLoss(policy, auxiliary)


__all__ = [
    "clipped_surrogate",
    "k3_kl",
    "per_sample",
    "policy_token_loss",
]
