"""Token losses shared by the policy-gradient algorithms (GRPO, RLOO, REINFORCE++, DAPO, PPO).

``clipped_surrogate`` is PPO's clipped objective (Schulman et al. 2017, Eq. 7) with the
generator's behaviour log-probs as the old policy; ``k3_kl`` is the non-negative KL estimator
GRPO adds to its loss (DeepSeekMath 2024, Eq. 4); ``per_sample`` turns token losses into the
per-sample loss the trainer sums (``StreamRLModule`` divides the sum by the samples per
iteration).
"""

from __future__ import annotations

import torch

from streamrl.algorithms.base import LossInputs


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


def per_sample(
    per_token: torch.Tensor, mask: torch.Tensor, token_norm: float | None = None
) -> torch.Tensor:
    """Aggregate ``[batch, seq]`` token losses into ``[batch]``.

    Args:
        per_token: token losses.
        mask: 1 for real completion tokens.
        token_norm: ``None`` averages each sample's tokens (GRPO: every sample weighs the same).
            A number divides each sample's token sum by that constant, so every token of the
            iteration weighs the same (token-level aggregation, DAPO §3.3). DAPO divides by the
            batch's total tokens, which is known only once the last sample lands: a batch
            barrier a streaming trainer does not have. A constant (the generation budget, as Dr.
            GRPO does, Liu et al. 2025) gives the same per-token weighting; the update is scaled
            by ``mean_length / token_norm`` relative to DAPO's.
    """
    mask = mask.to(per_token.dtype)
    summed = (per_token * mask).sum(1)  # [batch]
    if token_norm is None:
        return summed / mask.sum(1).clamp(min=1)
    return summed / token_norm


def policy_loss(
    batch: LossInputs,
    eps_low: float,
    eps_high: float | None = None,
    kl_coef: float = 0.0,
    token_norm: float | None = None,
) -> torch.Tensor:
    """Clipped surrogate plus ``kl_coef`` x k3 KL (when reference log-probs are given), per sample.

    Returns:
        ``[batch]``, see ``per_sample`` for ``token_norm``.
    """
    per_token = clipped_surrogate(
        batch.logprobs, batch.old_logprobs, batch.advantages, eps_low, eps_high
    )
    if batch.token_weights is not None:  # off-policy correction of stale samples
        per_token = per_token * batch.token_weights
    if kl_coef > 0 and batch.ref_logprobs is not None:
        per_token = per_token + kl_coef * k3_kl(batch.logprobs, batch.ref_logprobs)
    return per_sample(per_token, batch.mask, token_norm)
