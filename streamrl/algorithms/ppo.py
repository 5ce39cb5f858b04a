"""PPO with a value head and GAE (Schulman et al. 2017; GAE: Schulman et al. 2016).

PPO is the algorithm StreamRL evaluates with (§7: actor, critic and reference, a rule-based
verifier as the reward). Here the critic is a linear value head on the policy's last hidden state
rather than a separate model of the policy's size: the same algorithm at a fraction of the cost,
and a separate critic needs only a different ``token_values``.

The rule-based reward is given at the last completion token; GAE(gamma, lambda) spreads it over the
completion's tokens with the critic's values as baselines. Each sample is trained on once (one
pass, as samples stream in, §4.1), so the "old" values of the value clip are the critic's current
values and the clip is inactive; ``clipped_value_loss`` clips whenever old values differ (several
epochs, or values recorded at generation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from streamrl.algorithms.base import Algorithm, LossInputs, RunFacts, TokenLoss
from streamrl.algorithms.losses import clipped_surrogate


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, Eq. 16) over completion tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V = 0`` after the last real token, and
    ``A_t = delta_t + gamma * lam * A_{t+1}``; returns ``A_t + V_t`` are the value targets.

    Args:
        rewards: ``[batch, seq]`` per-token rewards.
        values: ``[batch, seq]`` critic values.
        mask: ``[batch, seq]``; 1 on each row's real tokens (a prefix).
        gamma: discount.
        lam: GAE lambda (1: Monte-Carlo returns minus V; 0: one-step TD).

    Returns:
        ``(advantages, returns)``, both ``[batch, seq]``, 0 on padding.
    """
    mask = mask.to(values.dtype)
    values = values * mask  # V after the last real token is 0: the episode ended
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # [batch]
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """PPO's clipped value loss, per token: ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``.

    Returns:
        ``[batch, seq]``; mask padding yourself.
    """
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's sequence reward on its last real token, 0 elsewhere.

    Args:
        rewards: ``[batch]``.
        mask: ``[batch, seq]``, 1 on each row's real tokens.

    Returns:
        ``[batch, seq]``.
    """
    lengths = mask.sum(1).long()  # [batch]
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    last = (lengths - 1).clamp(min=0)[:, None]  # [batch, 1]
    return out.scatter(1, last, (rewards * (lengths > 0))[:, None])


class PPO(Algorithm):
    """Proximal Policy Optimization with a linear value head and GAE.

    Args:
        hidden_size: the policy's hidden size (``policy.config.hidden_size``), the value head's
            input; ``from_run`` passes ``run.hidden_size``.
        group_size: samples per prompt; PPO needs no groups (1, as the paper's §7 runs).
        clip_eps: policy ratio clip range.
        kl_coef: KL penalty to the reference policy, subtracted from each token's reward as
            ``kl_coef * (log pi_old - log pi_ref)`` (Ouyang et al. 2022); 0 disables it.
        gamma: GAE discount.
        lam: GAE lambda.
        value_coef: weight of the value loss in the total loss.
        value_clip_eps: clip range of the value loss.
        train_trunk: let the value loss train the policy's transformer too (a shared
            actor-critic). ``False`` (default): the head learns on the policy's features, which
            are computed without grad (cheaper, and the policy sees only the policy loss).

    The value head's parameters are in ``trainable_parameters()``: the trainer's optimizer must
    include them. ``token_values`` runs the policy's transformer once more per micro-batch. The
    head is not sharded by FSDP yet: ``shardable`` is ``False``.

    Examples:
        >>> ppo = PPO(hidden_size=64)
        >>> ppo.score_group([0.5])  # the sequence reward; GAE makes token advantages later
        [0.5]
    """

    shardable: ClassVar[bool] = False  # the value head is not sharded by FSDP yet

    def __init__(
        self,
        hidden_size: int,
        *,
        group_size: int = 1,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        gamma: float = 1.0,
        lam: float = 0.95,
        value_coef: float = 0.5,
        value_clip_eps: float = 0.2,
        train_trunk: bool = False,
    ) -> None:
        super().__init__(group_size=group_size, clip_eps=clip_eps, kl_coef=kl_coef)
        if hidden_size < 1:
            raise ValueError(
                f"PPO needs hidden_size >= 1 (policy.config.hidden_size, the value head's input), "
                f"got {hidden_size}."
            )
        if not (0 <= gamma <= 1 and 0 <= lam <= 1):
            raise ValueError(f"PPO: gamma and lam must be in [0, 1], got {gamma} and {lam}.")
        self.gamma, self.lam, self.value_coef = gamma, lam, value_coef
        self.value_clip_eps, self.train_trunk = value_clip_eps, train_trunk
        self.value_head = torch.nn.Linear(hidden_size, 1)
        # Zero init: V = 0 at the start, so the first advantages are the discounted reward.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_run(cls, run: RunFacts, **options: Any) -> Algorithm:
        """Needs the policy's hidden size (``run.hidden_size``) for its value head."""
        options.setdefault("hidden_size", run.hidden_size)
        return super().from_run(run, **options)

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        return [float(r) for r in rewards]

    def token_values(
        self,
        policy: torch.nn.Module,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        starts: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        trunk = getattr(policy, "base_model", policy)  # a Hugging Face model without its LM head
        with torch.set_grad_enabled(self.train_trunk and torch.is_grad_enabled()):
            out = trunk(input_ids=input_ids, attention_mask=attention, use_cache=False)
        hidden = out.last_hidden_state  # [batch, seq, hidden]
        # Token t is chosen in the state after position start + t - 1, like its logits.
        offsets = torch.arange(width, device=input_ids.device) - 1
        positions = (starts[:, None] + offsets).clamp(0, input_ids.shape[1] - 1)  # [batch, width]
        states = hidden.gather(1, positions[:, :, None].expand(-1, -1, hidden.shape[-1]))
        if self.value_head.weight.device != states.device:  # before the first step: no Adam state
            self.value_head.to(states.device)
        return self.value_head(states.float()).squeeze(-1)  # [batch, width]

    def token_loss(self, batch: LossInputs) -> TokenLoss:
        """The clipped surrogate on GAE advantages (importance-weighted when samples are stale)
        and ``value_coef`` x the clipped value loss (auxiliary: never importance-weighted)."""
        if batch.values is None:
            raise ValueError(
                "PPO.loss needs LossInputs.values (per-token critic values): the trainer fills "
                "them from PPO.token_values; pass values=... when building LossInputs yourself."
            )
        mask = batch.mask.to(batch.values.dtype)
        old_values = batch.values.detach()  # one pass: the critic has not moved since
        rewards = terminal_rewards(batch.advantages.to(mask.dtype), mask)  # [batch, seq]
        if self.kl_coef > 0 and batch.ref_logprobs is not None:
            rewards = rewards - self.kl_coef * (batch.old_logprobs - batch.ref_logprobs) * mask
        advantages, returns = gae(rewards, old_values, mask, self.gamma, self.lam)
        policy = clipped_surrogate(batch.logprobs, batch.old_logprobs, advantages, self.clip_eps)
        value = clipped_value_loss(batch.values, old_values, returns, self.value_clip_eps)
        return TokenLoss(policy, self.value_coef * value)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.value_head.parameters())

    def state_dict(self) -> dict:
        return {"value_head": self.value_head.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.value_head.load_state_dict(state["value_head"])
