"""Held-out success of a policy on an environment: greedy episodes.

``evaluate_episodes`` plays one greedy episode per row with the same ``EpisodeRunner`` that RL
uses, so the tokens, the turn format and the limits are those of training: on the run's own
generator instances (a started service, seen through ``streamrl.eval.on_generators.
EvaluationView``), or on an in-process ``HFStreamGenerator`` (``LocalGeneration``) holding a
policy as it is now.

Examples:
    >>> from streamrl.policy.models import build_bpe_tokenizer, build_tiny_model
    >>> from streamrl.envs.tool_tasks import CalculatorEnv, calculator_rows
    >>> rows = calculator_rows(3)
    >>> tok = build_bpe_tokenizer([str(CalculatorEnv().reset(r)) for r in rows], vocab_size=300)
    >>> result = evaluate_episodes(build_tiny_model(tok), tok, CalculatorEnv, rows, max_tokens=8,
    ...                            context=256, max_turns=2)
    >>> result.n, 0.0 <= result.success <= 1.0
    (3, True)
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.generation.service import StreamGenerationService
from streamrl.envs.runner import EpisodeRunner
from streamrl.eval.on_generators import EVAL_ITERATION, EvaluationView
from streamrl.policy.chat import stop_token_ids
from streamrl.protocols import Environment
from streamrl.records import Request, Sample


class LocalGeneration:
    """What ``EpisodeRunner`` needs of a service, on one in-process generator (evaluation,
    notebooks): ``submit``, ``poll_sample`` and ``open_requests``."""

    dispatcher = None
    sample_timeout_s = 300.0

    def instances(self) -> list:
        return []

    def __init__(self, generator: HFStreamGenerator) -> None:
        self.generator = generator
        self._done: deque[Sample] = deque()
        self._open = 0

    @property
    def open_requests(self) -> int:
        return self._open

    def submit(self, requests: Sequence[Request], scores: Sequence[float] | None = None) -> None:
        self.generator.submit(requests)
        self._open += len(requests)

    def poll_sample(self, timeout_s: float) -> Sample | None:
        """Decode until a sample finishes (or ``timeout_s`` passes)."""
        deadline = time.monotonic() + timeout_s
        while not self._done and not self.generator.idle and time.monotonic() < deadline:
            self._done.extend(self.generator.step())
        if not self._done:
            return None
        self._open -= 1
        return self._done.popleft()


@dataclass
class EpisodeEval:
    """What ``evaluate_episodes`` measured.

    Attributes:
        success: share of episodes whose reward reached ``pass_threshold``.
        reward: mean episode reward.
        turns: mean model turns per episode.
        n: episodes (one per row).
        finish_reasons: how the episodes ended (``"done"``, ``"max_turns"``...).
        rewards: each row's episode reward, in row order.
        weight_versions: the policy versions whose tokens were evaluated, on the run's
            generators (empty for a model).
    """

    success: float
    reward: float
    turns: float
    n: int
    finish_reasons: dict[str, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list, repr=False)
    weight_versions: list[int] = field(default_factory=list)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """What to log; success is also ``pass@1`` (the curve ``PeriodicEval`` plots)."""
        return {
            f"{prefix}/reward": self.reward,
            f"{prefix}/pass@1": self.success,
            f"{prefix}/success": self.success,
            f"{prefix}/turns": self.turns,
        }


def evaluate_episodes(
    model: PreTrainedModel | StreamGenerationService,
    tokenizer: PreTrainedTokenizerBase,
    make_env: Callable[[], Environment],
    rows: Sequence[Mapping[str, Any]],
    *,
    max_tokens: int,
    context: int,
    max_turns: int = 8,
    pass_threshold: float = 1.0,
    batch_size: int = 32,
    env_timeout_s: float = 30.0,
    min_weight_version: int = 0,
) -> EpisodeEval:
    """One greedy episode per row: on a started service's instances once they hold
    ``min_weight_version``, or on ``model`` as it is now (left in eval mode)."""
    if isinstance(model, StreamGenerationService):
        generation = EvaluationView(model)
    else:
        generator = HFStreamGenerator(
            model.eval(),
            max_batch_size=batch_size,
            greedy=True,
            eos_token_id=stop_token_ids(tokenizer),
        )
        generation = LocalGeneration(generator)
    runner = EpisodeRunner(
        generation,  # type: ignore[arg-type]  # the part of a service it uses
        make_env,
        tokenizer,
        max_tokens=max_tokens,
        context=context,
        max_turns=max_turns,
        env_timeout_s=env_timeout_s,
        greedy=True,
    )
    firsts = [runner.start(row, 0, EVAL_ITERATION, min_weight_version) for row in rows]
    runner.submit(firsts)
    by_key = {s.key: s for s in (runner.next_sample() for _ in firsts)}
    episodes = [by_key[r.key] for r in firsts]
    rewards = [float(e.reward) for e in episodes]
    n = max(1, len(episodes))
    return EpisodeEval(
        success=sum(r >= pass_threshold for r in rewards) / n,
        reward=sum(rewards) / n,
        turns=sum(e.turns for e in episodes) / n,
        n=len(episodes),
        finish_reasons=dict(Counter(e.finish_reason for e in episodes)),
        rewards=rewards,
        weight_versions=sorted(getattr(generation, "versions_seen", ())),
    )
