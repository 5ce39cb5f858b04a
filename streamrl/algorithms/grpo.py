"""GRPO (DeepSeekMath, Shao et al. 2024) and its DAPO options (Yu et al. 2025).

GRPO: group-relative advantages and a clipped policy-gradient loss. DAPO adds four switches,
each off by default here and all on in ``dapo()``: clip-higher, token-level loss aggregation,
an overlong reward penalty and dynamic sampling (zero-variance groups are filtered out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamrl.algorithms.base import Algorithm, LossInputs
from streamrl.algorithms.losses import policy_loss
from streamrl.records import Sample
from streamrl.tasks.rewards import RewardFn


class GRPO(Algorithm):
    """Group Relative Policy Optimization, with DAPO's options.

    Each prompt is sampled ``group_size`` times; a sample's advantage is its reward minus the
    group mean, over the group standard deviation. The loss is PPO's clipped surrogate with the
    generator's behaviour log-probs as the old policy, averaged over each sample's tokens, plus an
    optional KL penalty to a reference policy (the k3 estimator).

    Args:
        reward_fn: rule-based reward.
        group_size: samples per prompt.
        clip_eps: PPO clip range (the lower one when ``clip_eps_high`` is set).
        kl_coef: weight of the KL penalty; 0 disables it (and the reference model).
        clip_eps_high: DAPO clip-higher (§3.1): upper clip range, e.g. 0.28 with
            ``clip_eps=0.2``; ``None`` clips symmetrically.
        token_level: DAPO token-level loss (§3.3): every token of the iteration weighs the
            same, so long completions are not down-weighted. Each sample's token sum is divided
            by ``max_tokens`` (see ``losses.per_sample`` for why a constant, not the batch's
            total tokens, in a streaming trainer).
        max_tokens: the generation budget; needed by ``token_level`` and ``overlong_buffer``.
        overlong_buffer: DAPO overlong reward shaping (§3.4): completions longer than
            ``max_tokens - overlong_buffer`` get a penalty growing linearly to
            ``overlong_penalty`` at ``max_tokens``; 0 disables it.
        overlong_penalty: the penalty at ``max_tokens``.
        dynamic_sampling: DAPO dynamic sampling (§3.2): ``keep_group`` is ``False`` for groups
            whose rewards are all equal (no learning signal).

    Examples:
        >>> from streamrl.tasks import partial_credit
        >>> [round(a, 4) for a in GRPO(partial_credit, group_size=2).score_group([1.0, 0.0])]
        [1.0, -1.0]
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        group_size: int = 8,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        *,
        clip_eps_high: float | None = None,
        token_level: bool = False,
        max_tokens: int | None = None,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        dynamic_sampling: bool = False,
    ) -> None:
        super().__init__(reward_fn)
        if group_size < 2:
            raise ValueError(f"GRPO needs group_size >= 2 to compare samples, got {group_size}.")
        if (token_level or overlong_buffer) and (max_tokens is None or max_tokens < 1):
            raise ValueError(
                "GRPO: token_level and overlong_buffer need max_tokens (the generation budget, "
                f"rl.max_tokens) >= 1, got {max_tokens!r}."
            )
        if not 0 <= overlong_buffer <= (max_tokens or 0):
            raise ValueError(
                f"GRPO: overlong_buffer must be in [0, max_tokens={max_tokens}], got "
                f"{overlong_buffer}."
            )
        self.group_size, self.clip_eps, self.kl_coef = group_size, clip_eps, kl_coef
        self.clip_eps_high, self.token_level = clip_eps_high, token_level
        self.max_tokens = max_tokens
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty
        self.dynamic_sampling = dynamic_sampling

    def score_sample(self, sample: Sample, completion: str, answer: str) -> float:
        reward = super().score_sample(sample, completion, answer)
        if self.overlong_buffer:
            reward -= overlong_penalty(
                sample.length, self.max_tokens, self.overlong_buffer, self.overlong_penalty
            )
        return reward

    def score_group(self, rewards: Sequence[float]) -> list[float]:
        r = torch.tensor(rewards, dtype=torch.float64)
        std = r.std(unbiased=False)
        if std < 1e-8:  # every sample equally good: nothing to learn from this group
            return [0.0] * len(rewards)
        return ((r - r.mean()) / (std + 1e-6)).tolist()

    def keep_group(self, rewards: Sequence[float]) -> bool:
        return not self.dynamic_sampling or max(rewards) - min(rewards) > 1e-8

    def loss(self, batch: LossInputs) -> torch.Tensor:
        token_norm = float(self.max_tokens) if self.token_level else None
        return policy_loss(batch, self.clip_eps, self.clip_eps_high, self.kl_coef, token_norm)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4), as a positive number to subtract.

    0 up to ``max_tokens - buffer`` tokens, then linear up to ``penalty`` at ``max_tokens``, and
    ``penalty`` past it. The sample's own budget may be lower than ``max_tokens`` when its prompt
    fills most of the context; the penalty still counts from ``max_tokens``.

    Examples:
        >>> overlong_penalty(14, max_tokens=16, buffer=4)
        0.5
    """
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    return penalty * min(1.0, (length - free) / buffer)


def dapo(
    reward_fn: RewardFn,
    group_size: int = 8,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    *,
    max_tokens: int,
    clip_eps_high: float = 0.28,
    overlong_buffer: int | None = None,
) -> GRPO:
    """GRPO with every DAPO option on (Yu et al. 2025): clip-higher (0.2 / 0.28 as in the
    paper), token-level loss, overlong penalty over the last fifth of ``max_tokens`` by default
    (the paper's 4K of 20K) and dynamic sampling. DAPO drops the KL term; ``kl_coef`` is kept
    for the uniform constructor and should stay 0.
    """
    buffer = max(1, max_tokens // 5) if overlong_buffer is None else overlong_buffer
    return GRPO(
        reward_fn,
        group_size,
        clip_eps,
        kl_coef,
        clip_eps_high=clip_eps_high,
        token_level=True,
        max_tokens=max_tokens,
        overlong_buffer=buffer,
        dynamic_sampling=True,
    )
