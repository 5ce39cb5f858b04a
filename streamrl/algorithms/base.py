"""Algorithm hooks that follow RL timing, and the contract the base enforces.

The task reward of each sample arrives from the run's reward functions; ``score_sample`` may shape
it. A prompt's group is scored once all its samples are in (``score_group``: advantages;
``keep_group``: train on it or not), and a micro-batch when the trainer reaches it
(``token_loss``, with per-token values from ``token_values`` for algorithms with a critic). A
new algorithm overrides only the hooks it changes, in tens of lines; see docs/algorithms.md.

Algorithms *declare* what they need and the base applies what no algorithm may forget:

- ``__init__`` checks ``group_size`` against the class's ``min_group_size``, ``clip_eps > 0`` and
  ``kl_coef >= 0``;
- ``from_run`` is how an algorithm picks what it needs from the run's ``RunFacts`` (the value head's
  hidden size, the generation budget), so that builders never branch on its name;
- ``needs_reference`` and ``shardable`` tell the builder whether to keep a frozen reference policy
  and whether the algorithm can be trained under FSDP;
- ``loss`` is final: it weights the importance-weighted terms of ``token_loss`` by the off-policy
  token weights, adds the other terms and averages over the real tokens (``reduce_token_loss``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from streamrl.records import Sample


@dataclass
class LossInputs:
    """Tensors of one micro-batch, all ``[batch, completion_len]`` unless noted.

    Attributes:
        logprobs: log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: behaviour log-probs recorded by the generator.
        advantages: one per sample, ``[batch]``: what ``score_group`` returned (for PPO, the
            sequence reward, which GAE turns into token advantages inside ``token_loss``).
        mask: 1 for real completion tokens, 0 for padding.
        ref_logprobs: log-probs under the frozen reference policy, or ``None`` without KL.
        values: the critic's value of the state before each completion token (with grad), from
            ``Algorithm.token_values``; ``None`` for algorithms without a critic.
        token_weights: truncated importance weights of stale samples' tokens in async mode
            (``streamrl.components.training.off_policy``); ``None`` when every sample is fresh.
            ``Algorithm.loss`` applies them; an algorithm's ``token_loss`` never needs to.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None


@dataclass
class TokenLoss:
    """What ``Algorithm.token_loss`` returns: per-token loss terms, ``[batch, seq]`` each.

    Attributes:
        policy: the policy-gradient term; ``Algorithm.loss`` multiplies it by the off-policy
            token weights (``LossInputs.token_weights``) when there are any.
        auxiliary: terms that are not importance-weighted (a KL penalty, a value loss), already
            scaled by their coefficients; ``None`` when there are none.
    """

    policy: torch.Tensor
    auxiliary: torch.Tensor | None = None


@dataclass(frozen=True)
class RunFacts:
    """What a run knows that an algorithm may need; ``Algorithm.from_run`` picks from it.

    Attributes:
        group_size: samples per prompt (``rl.group_size``).
        max_tokens: the generation budget per completion (``rl.rollouts.max_tokens``).
        hidden_size: the policy's hidden size (``policy.config.hidden_size``).
        prompts_per_iteration: prompts per training iteration (``rl.prompts_per_iteration``).

    Examples:
        >>> facts = RunFacts(group_size=4, max_tokens=64, hidden_size=32,
        ...                  prompts_per_iteration=8)
        >>> facts.samples_per_iteration
        32
    """

    group_size: int
    max_tokens: int
    hidden_size: int
    prompts_per_iteration: int

    @property
    def samples_per_iteration(self) -> int:
        """Samples the trainer takes per iteration: prompts x group size."""
        return self.prompts_per_iteration * self.group_size


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


def reduce_token_loss(
    terms: TokenLoss, batch: LossInputs, token_norm: float | None = None
) -> torch.Tensor:
    """Per-sample loss ``[batch]`` from per-token terms: what ``Algorithm.loss`` computes.

    ``policy x token_weights`` (the off-policy correction, when ``batch.token_weights`` is set)
    ``+ auxiliary``, masked and aggregated by ``per_sample(..., batch.mask, token_norm)``.
    """
    per_token = terms.policy
    if batch.token_weights is not None:  # off-policy correction of stale samples
        per_token = per_token * batch.token_weights
    if terms.auxiliary is not None:
        per_token = per_token + terms.auxiliary
    return per_sample(per_token, batch.mask, token_norm)


class Algorithm:
    """Base class: the task reward unchanged, no advantage, no loss. Subclasses fill in the hooks.

    Args:
        group_size: samples per prompt; at least the class's ``min_group_size``.
        clip_eps: PPO clip range, > 0 (used by the algorithms with a clipped surrogate).
        kl_coef: weight of the KL penalty to a frozen reference policy, >= 0; 0 disables it (and
            the reference policy: see ``needs_reference``).

    Raises:
        ValueError: ``group_size``, ``clip_eps`` or ``kl_coef`` out of range; the message names
            the algorithm and the fix.
    """

    #: Fewest samples per prompt the algorithm learns from; ``__init__`` checks ``group_size``.
    min_group_size: ClassVar[int] = 1
    #: Why ``min_group_size`` (completes the error message: "GRPO needs group_size >= 2 ...").
    group_size_reason: ClassVar[str] = ""
    #: The algorithm's name in messages; a subclass that does not set it gets its class name.
    display_name: ClassVar[str] = "Algorithm"
    #: Whether a sharded (FSDP) trainer can train it; ``False`` when it owns parameters that are
    #: not sharded yet (PPO's value head). The config check reads this.
    shardable: ClassVar[bool] = True
    #: ``None``: each sample's token losses are averaged; a number: each sample's token sum is
    #: divided by it (token-level aggregation, see ``per_sample``).
    token_norm: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "display_name" not in cls.__dict__:
            cls.display_name = cls.__name__
        if "loss" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} defines loss(); override token_loss() instead: "
                "Algorithm.loss applies the off-policy token weights and the mask to what "
                "token_loss returns, and no algorithm may skip that."
            )

    def __init__(
        self,
        *,
        group_size: int = 1,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
    ) -> None:
        name = self.display_name
        need = type(self).min_group_size
        if group_size < need:
            why = f" {self.group_size_reason}" if self.group_size_reason else ""
            raise ValueError(
                f"{name} needs group_size >= {need}{why}, got {group_size}: set group_size "
                f"(rl.group_size in a config) to {need} or more."
            )
        if not clip_eps > 0:
            raise ValueError(f"{name}: clip_eps (the PPO clip range) must be > 0, got {clip_eps}.")
        if not kl_coef >= 0:
            raise ValueError(
                f"{name}: kl_coef must be >= 0 (0 disables the KL penalty), got {kl_coef}."
            )
        self.group_size, self.clip_eps, self.kl_coef = group_size, clip_eps, kl_coef

    @classmethod
    def from_run(cls, run: RunFacts, **options: Any) -> Algorithm:
        """Build the algorithm for a run.

        This is how an algorithm declares what it needs from the run: the default passes
        ``group_size``, ``clip_eps`` and ``kl_coef``; a subclass that needs more (PPO the
        policy's hidden size, DAPO the generation budget) overrides this and picks it from
        ``run``. Builders call ``from_run`` and never branch on the algorithm's name.

        Args:
            run: the run's facts.
            **options: further constructor arguments; they win over what is taken from ``run``.
        """
        return cls(**{"group_size": run.group_size, **options})

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must keep a frozen reference policy (only with a KL penalty)."""
        return self.kl_coef > 0

    def score_sample(self, sample: Sample, reward: float) -> float:
        """Shape the task reward of one finished sample, on arrival; default: ``reward`` unchanged.

        Args:
            sample: the finished sample (its ``length``, ``prompt_id``, ...).
            reward: its task reward, already computed by the run's reward functions and checked
                to be finite.

        Returns:
            The reward the algorithm scores the group with (DAPO subtracts its overlong penalty).
        """
        del sample
        return reward

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        """Advantages of one prompt's samples, given their rewards (same order)."""
        raise NotImplementedError

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Whether a complete group is trained on; ``False`` filters it out (the rollout then
        asks the stream for another prompt). Default: keep every group."""
        del rewards
        return True

    def token_loss(self, batch: LossInputs) -> TokenLoss:
        """Per-token loss terms of a micro-batch (see ``TokenLoss``); what subclasses override.

        Return the policy-gradient term as ``policy`` and the terms that are not
        importance-weighted (KL penalty, value loss) as ``auxiliary``. Do not apply
        ``batch.token_weights`` nor the mask: ``loss`` does.
        """
        raise NotImplementedError

    def loss(self, batch: LossInputs) -> torch.Tensor:
        """Per-sample loss, ``[batch]``; the trainer sums it and divides by the iteration's
        samples (``RolloutStream.samples_per_iteration``).

        ``token_loss``'s ``policy`` term times ``batch.token_weights`` (when given: the off-policy
        correction of stale samples), plus its ``auxiliary`` terms, aggregated over each sample's
        real tokens with ``per_sample(..., batch.mask, self.token_norm)``. Subclasses cannot
        override it (``TypeError`` at class creation).
        """
        return reduce_token_loss(self.token_loss(batch), batch, self.token_norm)

    def token_values(
        self,
        policy: torch.nn.Module,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        starts: torch.Tensor,
        width: int,
    ) -> torch.Tensor | None:
        """Critic values of each completion position, ``[batch, width]``, or ``None`` (default).

        Called by the trainer on every micro-batch, with the padded rows it feeds the policy.

        Args:
            policy: the policy being trained.
            input_ids: ``[batch, seq]``, each row ``prompt + completion + padding``.
            attention: ``[batch, seq]``, the attention mask of ``input_ids``.
            starts: ``[batch]``, where each row's completion starts.
            width: completion positions wanted.
        """
        del policy, input_ids, attention, starts, width
        return None

    @property
    def has_critic(self) -> bool:
        """Whether the algorithm computes critic values (it overrides ``token_values``): the
        trainer then gives that hook the micro-batch as padded rows."""
        return type(self).token_values is not Algorithm.token_values

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the algorithm owns (a value head) that the optimizer must update with the
        policy's. Default: none."""
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state
