"""Records passed between components: small dataclasses of plain Python values.

They cross process boundaries on multiprocessing queues, so they hold lists, numbers and numpy
arrays, never torch tensors (a tensor on a queue costs ~30x more and breaks when its producer
exits first).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

_NORMAL = NormalDist()


@dataclass(frozen=True)
class LengthDistribution:
    """A predicted output length as a distribution, not a point: ``log(length) ~ N(mu, sigma)``.

    Output lengths are heavy-tailed (StreamRL §5, Fig. 3), and what a group of ``G`` samples
    costs an instance is its *longest* sample, so planners need more than a point estimate: a
    quantile (``quantile(0.9)``), the expected longest of ``n`` draws (``expected_max``), and,
    for a sample still running, its expected remaining tokens (``remaining``).

    Attributes:
        mu: mean of the log length (``exp(mu)`` is the median length).
        sigma: standard deviation of the log length: the predictor's error and the sampling
            spread together (0: a point).

    Examples:
        >>> d = LengthDistribution(mu=math.log(100), sigma=0.5)
        >>> round(d.median), round(d.quantile(0.9)), round(d.mean)
        (100, 190, 113)
        >>> round(d.expected_max(8)) > round(d.mean)
        True
    """

    mu: float
    sigma: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and math.isfinite(self.sigma)) or self.sigma < 0:
            raise ValueError(f"LengthDistribution: need finite mu and sigma >= 0, got {self}.")

    @classmethod
    def point(cls, length: float) -> LengthDistribution:
        """All mass at ``length`` (a point prediction seen as a distribution)."""
        return cls(math.log(max(float(length), 1.0)), 0.0)

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma**2 / 2)

    def quantile(self, q: float) -> float:
        """The length below which a share ``q`` of samples ends (``0 < q < 1``)."""
        if not 0 < q < 1:
            raise ValueError(f"quantile: q must be in (0, 1), got {q}.")
        return math.exp(self.mu + self.sigma * _NORMAL.inv_cdf(q))

    def cdf(self, length: float) -> float:
        """Probability that a sample ends at ``length`` tokens or sooner."""
        if length <= 0:
            return 0.0
        if self.sigma == 0:
            return float(length >= self.median)
        return _NORMAL.cdf((math.log(length) - self.mu) / self.sigma)

    def expected_max(self, n: int, cap: float | None = None) -> float:
        """Expected longest of ``n`` independent samples: what a group of ``n`` occupies an
        instance for (``E[max] = integral over u of Q(u ** (1/n))``, by quadrature); with
        ``cap``, of samples cut at ``cap`` tokens (a generation budget)."""
        if n < 1:
            raise ValueError(f"expected_max: n must be >= 1, got {n}.")
        if n == 1:
            return self.mean if cap is None else self.mean_above(0.0, cap)
        draws = math.exp(self.mu) * np.exp(self.sigma * _max_grid(n))
        return float((draws if cap is None else np.minimum(draws, cap)).mean())

    def remaining(self, generated: float, cap: float | None = None) -> float:
        """Expected tokens still to come for a sample that has ``generated`` tokens and has not
        ended: ``E[L | L > generated] - generated`` (``L`` cut at ``cap`` if given; at least
        1)."""
        if cap is not None and generated >= cap:
            return 1.0
        if self.sigma == 0:
            length = self.median if cap is None else min(self.median, cap)
            return max(1.0, length - generated)
        if generated <= 0:
            return self.mean if cap is None else self.mean_above(0.0, cap)
        z = (math.log(generated) - self.mu) / self.sigma
        survive = 1.0 - _NORMAL.cdf(z)
        if survive < 1e-9:  # far in the tail: the Mills-ratio limit, E[L - g | L > g] ~ g s / z
            left = generated * self.sigma / max(z, 1e-6)
            return max(1.0, left if cap is None else min(left, cap - generated))
        return max(1.0, self.mean_above(generated, cap) / survive - generated)

    def mean_above(self, low: float, cap: float | None = None) -> float:
        """``E[min(L, cap); L > low]``: the mean length over the samples longer than ``low``,
        each cut at ``cap`` (``None``: not cut), times their probability (closed form)."""
        if low > 0 and cap is not None and low >= cap:
            return 0.0
        if self.sigma == 0:
            length = self.median if cap is None else min(self.median, cap)
            return length if self.median > low else 0.0
        above_low = self._tail_mean(low)
        if cap is None:
            return above_low
        return above_low - self._tail_mean(cap) + cap * (1.0 - self.cdf(cap))

    def _tail_mean(self, length: float) -> float:
        """``E[L; L > length]`` of the log-normal (closed form)."""
        if length <= 0:
            return self.mean
        z = (math.log(length) - self.mu) / self.sigma
        return self.mean * (1.0 - _NORMAL.cdf(z - self.sigma))


@functools.lru_cache(maxsize=256)
def _max_grid(n: int, points: int = 128) -> np.ndarray:
    """Standard-normal quantiles at ``u ** (1/n)`` for midpoints ``u`` of ``points`` cells."""
    u = (np.arange(points) + 0.5) / points
    return np.array([_NORMAL.inv_cdf(x) for x in u ** (1.0 / n)])


@dataclass
class Progress:
    """What a request generated on one instance before it moved to another (mid-flight moves).

    Attributes:
        token_ids: the tokens generated so far.
        logprobs: their behaviour log-probabilities.
        versions: the weight version that drew each of them.
        weight_version: the version loaded when the request was first admitted (the finished
            sample's ``weight_version``).
        started_s: when it was first admitted (the finished sample's ``started_s``).
        moves: how many times it has moved.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    weight_version: int
    started_s: float
    moves: int = 1


@dataclass
class Request:
    """One generation request: a prompt's token ids and how far to decode.

    Attributes:
        prompt_id: identifies the prompt across the whole run (unique per prompt).
        prompt_ids: the prompt's token ids.
        max_tokens: the most tokens to generate (EOS may stop it earlier).
        sample_index: which of the prompt's ``group_size`` samples this is.
        forced_length: if set, ignore EOS and generate exactly this many tokens (the paper's
            throughput protocol, §7).
        predicted_length: a length estimate used by schedulers (e.g. LPT); ``None`` if unknown.
        min_weight_version: the instance holds the request until it has at least this weight
            version (paces admission so that no sample exceeds the staleness bound, §4.1).
        iteration: the RL iteration the request belongs to (several may be in flight).
        keep_prefix: keep the finished sequence's KV cache on its instance, so that the next
            turn of the same episode (a request with the same ``key`` whose prompt extends this
            one) prefills only its new tokens (``streamrl.envs``).
        prefer_instance: the instance that should run it (the one holding its prefix); the
            dispatcher places it if that instance is not active.
        length_dist: the predicted length as a distribution (a distributional predictor's),
            for planners that weigh the tail; ``predicted_length`` is the cost LPT orders by.
        progress: what the request generated on another instance before it was moved (its
            tokens, log-probs and versions); the instance that takes it prefills the prompt and
            those tokens, then goes on. ``None``: it starts from its prompt.
        greedy: decode this request greedily (the most likely token each step) whatever the
            instance's sampling settings: a held-out evaluation on the training instances
            (``streamrl.eval.on_generators``).
    """

    prompt_id: str
    prompt_ids: list[int]
    max_tokens: int
    sample_index: int = 0
    forced_length: int | None = None
    predicted_length: float | None = None
    min_weight_version: int = 0
    iteration: int = 0
    keep_prefix: bool = False
    prefer_instance: int | None = None
    length_dist: LengthDistribution | None = None
    progress: Progress | None = None
    greedy: bool = False

    @property
    def key(self) -> tuple[str, int, int]:
        """``(prompt_id, sample_index, iteration)``: unique per sample in a run."""
        return (self.prompt_id, self.sample_index, self.iteration)


@dataclass
class Sample:
    """One finished generation, emitted the moment it completes (StreamRL §3, stream generation).

    Attributes:
        prompt_id: the request's prompt id.
        sample_index: which of the prompt's group this is.
        prompt_ids: the prompt's token ids.
        token_ids: the generated token ids (EOS included when it stopped on EOS).
        logprobs: behaviour log-probabilities of ``token_ids`` under the generating weights.
        weight_version: the version of the weights that generated it.
        instance_id: the generator instance that produced it.
        submitted_s / started_s / finished_s: wall-clock timestamps (``time.time()``) of
            submission, admission into a batch slot and completion.
        finish_reason: ``"eos"``, ``"stop"`` (a stop string), ``"length"`` (hit ``max_tokens``)
            or ``"forced"``; an episode's: ``"done"``, or why it was truncated
            (``streamrl.envs.Episode``).
        reward: filled in by the trainer once scored (an episode comes with its env's reward).
        reward_parts: each of the run's rewards on its own, unweighted (``RewardSpec``'s labels),
            filled in with ``reward``; ``None`` for an episode (its environment rewards it).
        iteration: the RL iteration of its request.
        loss_mask: per token of ``token_ids``, 1 if the policy generated it (trained on) and 0
            if an environment or tool did (an episode's observations); ``None``: all 1.
        token_versions: per token, the weight version that generated it (an episode's turns
            may span weight updates); ``None``: all ``weight_version``.
        turns: the model turns it holds (1 for a single completion).
        prefill_tokens / cached_tokens: prompt tokens this instance computed, and those whose
            KV cache it reused from the episode's previous turn (``Request.keep_prefix``).
        routed_experts: a mixture-of-experts generator's choices, ``int16`` numpy array
            ``[len(prompt_ids) + length, MoE layers, k]``, ``-1`` where not recorded, which the
            trainer replays (``streamrl.policy.routing``); ``None`` for a dense policy.
    """

    prompt_id: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    instance_id: int
    submitted_s: float = 0.0
    started_s: float = 0.0
    finished_s: float = 0.0
    finish_reason: str = "eos"
    reward: float | None = None
    reward_parts: dict[str, float] | None = None
    iteration: int = 0
    loss_mask: list[int] | None = None
    token_versions: list[int] | None = None
    turns: int = 1
    prefill_tokens: int = 0
    cached_tokens: int = 0
    routed_experts: Any = field(default=None, compare=False)

    @property
    def length(self) -> int:
        """Number of tokens after the prompt (an episode's observations included)."""
        return len(self.token_ids)

    @property
    def key(self) -> tuple[str, int, int]:
        """``(prompt_id, sample_index, iteration)``, the key of its request."""
        return (self.prompt_id, self.sample_index, self.iteration)


@dataclass
class ScoredGroup:
    """All samples of one prompt with their rewards and advantages."""

    prompt_id: str
    samples: list[Sample]
    rewards: list[float]
    advantages: list[float]
    iteration: int = 0


@dataclass
class Step:
    """What an environment answers to one model turn (``Environment.step``, ``streamrl.envs``).

    Attributes:
        observation: the environment's reply, shown to the model as the next message (a tool's
            result, a game's new state); ``None`` when the episode ends without one.
        reward: this turn's reward; an episode's reward is the sum over its turns.
        done: the episode is over (success, failure, or the environment's own limit).
        role: the chat role the observation is shown with (``"user"``; ``"tool"`` for a tool's
            result).
        info: anything to log (not used by training).
    """

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    role: str = "user"
    info: dict = field(default_factory=dict)


@dataclass
class InstanceLoad:
    """What one generator instance holds, as a planner that moves work sees it.

    Attributes:
        instance_id: the instance.
        batch_limit: sequences it runs at once.
        running: each running request with the tokens it has generated.
        waiting: its requests not yet admitted (its queue).
    """

    instance_id: int
    batch_limit: int
    running: list[tuple[Request, int]]
    waiting: list[Request]


@dataclass(frozen=True)
class Move:
    """Requests a planner moves from one instance to another, mid-flight."""

    keys: tuple[tuple[str, int, int], ...]
    source: int
    target: int


#: What a pipeline run reports, real (``streamrl bench pipeline``) or simulated, by name.
PIPELINE_COLUMNS: tuple[str, ...] = (
    "samples_per_s",
    "iteration_s",
    "gen_s",
    "train_s",
    "trainer_idle_frac",
    "generator_idle_frac",
    "exposed_sync_s",
    "token_lag_mean",
)
