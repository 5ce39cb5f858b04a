"""Records passed between components: small dataclasses of plain Python values.

They cross process boundaries on multiprocessing queues, so they hold lists and numbers, never
torch tensors (a tensor on a queue costs ~30x more and breaks when its producer exits first).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        finish_reason: ``"eos"``, ``"length"`` (hit ``max_tokens``) or ``"forced"``; an
            episode's: ``"done"``, or why it was truncated (``streamrl.envs.Episode``).
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

    @property
    def length(self) -> int:
        """Number of tokens after the prompt (an episode's observations included)."""
        return len(self.token_ids)

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss is taken on (the policy's own)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)

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
