"""GRPO (DeepSeekMath, Shao et al. 2024) and its DAPO options (Yu et al. 2025).

GRPO: group-relative advantages and a clipped policy-gradient loss. DAPO adds four switches,
each off by default in ``GRPO`` and all on in ``DAPO``: clip-higher, token-level loss
aggregation, an overlong reward penalty and dynamic sampling (zero-variance groups are filtered
out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from streamrl.algorithms.base import Algorithm, LossInputs, RunFacts, TokenLoss
from streamrl.algorithms.losses import policy_token_loss
from streamrl.records import Sample


class GRPO(Algorithm):
    """Group Relative Policy Optimization, with DAPO's options.

    Each prompt is sampled ``group_size`` times; a sample's advantage is its reward minus the
    group mean, over the group standard deviation. The loss is PPO's clipped surrogate with the
    generator's behaviour log-probs as the old policy, averaged over each sample's tokens, plus an
    optional KL penalty to a reference policy (the k3 estimator).

    Args:
        group_size: samples per prompt (>= 2: advantages compare a prompt's samples).
        clip_eps: PPO clip range (the lower one when ``clip_eps_high`` is set).
        kl_coef: weight of the KL penalty; 0 disables it (and the reference model).
        clip_eps_high: DAPO clip-higher (§3.1): upper clip range, e.g. 0.28 with
            ``clip_eps=0.2``; ``None`` clips symmetrically.
        token_level: DAPO token-level loss (§3.3): every token of the iteration weighs the
            same, so long completions are not down-weighted. Each sample's token sum is divided
            by ``max_tokens`` (see ``base.per_sample`` for why a constant, not the batch's
            total tokens, in a streaming trainer).
        max_tokens: the generation budget; needed by ``token_level`` and ``overlong_buffer``
            (``from_run`` does not pass it: use ``DAPO``, or pass ``max_tokens=`` as an option).
        overlong_buffer: DAPO overlong reward shaping (§3.4): completions longer than
            ``max_tokens - overlong_buffer`` get a penalty growing linearly to
            ``overlong_penalty`` at ``max_tokens``; 0 disables it.
        overlong_penalty: the penalty at ``max_tokens``.
        dynamic_sampling: DAPO dynamic sampling (§3.2): ``keep_group`` is ``False`` for groups
            whose rewards are all equal (no learning signal).

    Examples:
        >>> [round(a, 4) for a in GRPO(group_size=2).score_group([1.0, 0.0])]
        [1.0, -1.0]
    """

    min_group_size: ClassVar[int] = 2
    group_size_reason: ClassVar[str] = "to compare samples"

    def __init__(
        self,
        *,
        group_size: int = 8,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        clip_eps_high: float | None = None,
        token_level: bool = False,
        max_tokens: int | None = None,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        dynamic_sampling: bool = False,
    ) -> None:
        super().__init__(group_size=group_size, clip_eps=clip_eps, kl_coef=kl_coef)
        name = self.display_name
        if (token_level or overlong_buffer) and (max_tokens is None or max_tokens < 1):
            raise ValueError(
                f"{name}: token_level and overlong_buffer need max_tokens (the generation "
                f"budget, rl.rollouts.max_tokens) >= 1, got {max_tokens!r}."
            )
        if not 0 <= overlong_buffer <= (max_tokens or 0):
            raise ValueError(
                f"{name}: overlong_buffer must be in [0, max_tokens={max_tokens}], got "
                f"{overlong_buffer}."
            )
        self.clip_eps_high, self.token_level = clip_eps_high, token_level
        self.max_tokens = max_tokens
        self.token_norm = float(max_tokens) if token_level and max_tokens else None
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty
        self.dynamic_sampling = dynamic_sampling

    def score_sample(self, sample: Sample, reward: float) -> float:
        """The task reward minus DAPO's overlong penalty (when ``overlong_buffer`` is set)."""
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

    def token_loss(self, batch: LossInputs) -> TokenLoss:
        return policy_token_loss(batch, self.clip_eps, self.clip_eps_high, self.kl_coef)


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


class DAPO(GRPO):
    """GRPO with every DAPO option on (Yu et al. 2025), config name ``"dapo"``.

    Clip-higher (0.2 / 0.28 as in the paper), token-level loss, an overlong penalty over the last
    fifth of ``max_tokens`` by default (the paper's 4K of 20K) and dynamic sampling. DAPO drops
    the KL term; ``kl_coef`` is kept for the uniform constructor and should stay 0.

    Args:
        group_size: samples per prompt (>= 2).
        clip_eps: lower clip range.
        kl_coef: weight of the k3 KL penalty (0 in the paper).
        max_tokens: the generation budget (``from_run`` passes ``rl.rollouts.max_tokens``).
        clip_eps_high: upper clip range.
        overlong_buffer: tokens before ``max_tokens`` where the overlong penalty starts;
            ``None``: a fifth of ``max_tokens`` (at least 1).

    Examples:
        >>> algo = DAPO(group_size=4, max_tokens=64)
        >>> algo.overlong_buffer, algo.token_norm, algo.keep_group([1.0, 1.0, 1.0, 1.0])
        (12, 64.0, False)
    """

    def __init__(
        self,
        *,
        group_size: int = 8,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        max_tokens: int,
        clip_eps_high: float = 0.28,
        overlong_buffer: int | None = None,
    ) -> None:
        buffer = max(1, max_tokens // 5) if overlong_buffer is None else overlong_buffer
        super().__init__(
            group_size=group_size,
            clip_eps=clip_eps,
            kl_coef=kl_coef,
            clip_eps_high=clip_eps_high,
            token_level=True,
            max_tokens=max_tokens,
            overlong_buffer=buffer,
            dynamic_sampling=True,
        )

    @classmethod
    def from_run(cls, run: RunFacts, **options: Any) -> Algorithm:
        """Needs the generation budget (``run.max_tokens``) besides the shared facts."""
        options.setdefault("max_tokens", run.max_tokens)
        return super().from_run(run, **options)
