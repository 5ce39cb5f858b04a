"""Every extension point of streamrl, in one place (``typing.Protocol``s).

Anything with these methods plugs in; no base class is needed (``Algorithm`` is the exception: its
base applies what no algorithm may forget, see ``streamrl.algorithms.base``). Each protocol says
where it is called, so a reader can follow one sample from prompt to gradient:

1. a ``RewardFn`` scores a finished completion (on arrival, ``RolloutStream``);
2. a ``LengthPredictor`` ranks prompts by expected output length (§5.2);
3. a ``Dispatcher`` splits an iteration's requests over generator instances (§5.3);
4. an ``AdmissionScheduler`` picks the request for a freed batch slot inside an instance (LPT);
5. a ``GenerationEngine`` builds each instance's ``StreamGenerator`` in its own process (§3);
6. the ``Algorithm`` turns rewards into advantages and micro-batches into a loss;
7. an ``Environment`` answers each turn of a multi-turn episode (``streamrl.envs``);
8. a ``Sampler`` turns a prompt's row into its group's requests and streams the finished
   samples back to ``RolloutStream``: the generation service (one completion per sample) or the
   ``EpisodeRunner`` (one multi-turn episode per sample).

In YAML each of them is a short name for a built-in or ``package.module:Name`` for your own
(``streamrl.runtime.references``), checked before any work starts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from streamrl.records import InstanceLoad, LengthDistribution, Move, Request, Sample, Step


class RewardFn(Protocol):
    """Scores one decoded completion against its reference answer (higher is better)."""

    def __call__(self, completion: str, answer: str) -> float: ...


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts a prompt's output length from its text, learning from finished samples (§5.2).

    ``RolloutStream`` asks for ``predict`` only once ``ready``; it hands ``learn`` the lengths the
    policy produced since the last call, every ``ranker_refresh_every`` iterations.
    """

    @property
    def ready(self) -> bool:
        """Whether it has learned enough to predict."""
        ...

    def predict(self, prompts: Sequence[str]) -> list[float]:
        """A length score per prompt (higher means longer)."""
        ...

    def learn(self, prompts: Sequence[str], lengths: Sequence[int]) -> None:
        """Fit on (or, once fitted, refresh with) the policy's finished samples."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class DistributionalLengthPredictor(LengthPredictor, Protocol):
    """A ``LengthPredictor`` that also predicts each prompt's length as a distribution, so
    planners can weigh the tail: the expected longest of a group's samples, a quantile, the
    remaining tokens of a running sample (``LengthDistribution``)."""

    def predict_distribution(self, prompts: Sequence[str]) -> list[LengthDistribution]:
        """A length distribution per prompt (one sample's length)."""
        ...


@runtime_checkable
class Dispatcher(Protocol):
    """Splits an iteration's requests over generator instances (§5.3); the service calls
    ``plan`` on every submit and sends each instance its ``batch_limits``."""

    def plan(
        self, requests: Sequence[Request], scores: Sequence[float] | None, instances: int
    ) -> list[list[Request]]:
        """One list of requests per instance (every request exactly once; a prompt's samples
        stay together).

        Args:
            requests: the iteration's requests.
            scores: predicted output length per request (same order), or ``None``.
            instances: number of active generator instances.
        """
        ...

    def observe(self, lengths: Iterable[int]) -> None:
        """Recent finished samples' output lengths (the distribution ``D`` of Algorithm 2)."""
        ...

    def batch_limits(self, instances: int) -> list[int] | None:
        """Each instance's batch size under the last plan, or ``None`` to leave them as set."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Rebalancer(Protocol):
    """What a ``Dispatcher`` adds to go on planning while the iteration runs (beyond §5.3):
    the pool tells it each finished sample and, when an instance has free slots while another
    is busy, asks it what to move (``streamrl.components.skewness.adaptive``)."""

    def finished(self, sample: Sample) -> Mapping[tuple, float]:
        """A sample finished: learn from it (its group's siblings); returns new admission
        costs of open requests by key (sent to the instances that queue them)."""
        ...

    def rebalance(self, loads: Sequence[InstanceLoad]) -> list[Move]:
        """The moves that shorten the predicted makespan of these instances (may be none)."""
        ...


@runtime_checkable
class AdmissionScheduler(Protocol):
    """Queue of waiting requests, consulted each time a batch slot frees."""

    def push(self, request: Request) -> None:
        """Add a waiting request."""
        ...

    def pop(self) -> Request:
        """Remove and return the request to admit next; raises ``IndexError`` when empty."""
        ...

    def __len__(self) -> int:
        """Number of waiting requests."""
        ...


@runtime_checkable
class StreamGenerator(Protocol):
    """One generator instance: continuous batching that emits each sample as it finishes."""

    @property
    def weight_version(self) -> int:
        """Version of the weights it holds."""
        ...

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        ...

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests (validated before any is queued)."""
        ...

    def step(self) -> list[Sample]:
        """Admit into free slots, decode one token for every running sequence, return the
        samples that finished at this step."""
        ...

    def stream(self) -> Iterator[Sample]:
        """Step until idle, yielding samples in completion order."""
        ...

    def set_batch_limit(self, limit: int) -> None:
        """Run at most ``limit`` sequences at once (the dispatcher's pool sizes)."""
        ...

    def weight_templates(self) -> Mapping[str, torch.Tensor]:
        """The tensors a weight update fills: the trainer's names, shapes and dtypes, in the
        order it sends them."""
        ...

    def load_weights(
        self, state_dict: Mapping[str, torch.Tensor | np.ndarray], version: int
    ) -> None:
        """Copy new weights in place (between two decode steps) and tag later samples with
        ``version``."""
        ...


@runtime_checkable
class RecomputingGenerator(Protocol):
    """What a ``StreamGenerator`` adds to go on with its running sequences under new weights
    after computing their cache again (``rl.generation.partial_rollout: recompute``)."""

    def recompute_running(self) -> int:
        """Prefill every running sequence again, prompt and tokens so far, under the weights
        loaded now; returns the tokens prefilled."""
        ...


@runtime_checkable
class MovableGenerator(Protocol):
    """What a ``StreamGenerator`` adds so a planner can move its requests to other instances
    mid-flight (``streamrl.components.skewness.adaptive``): take requests off, say how far the
    running ones are, and reorder the waiting ones."""

    def release(self, keys: Collection[tuple]) -> list[Request]:
        """Take these requests off (waiting ones as they are, running ones with their
        ``Request.progress``); keys it does not hold are ignored."""
        ...

    def reprioritize(self, costs: Mapping[tuple, float]) -> int:
        """Set new admission costs (``predicted_length``) of waiting requests by key."""
        ...

    def running_progress(self) -> list[tuple[tuple, int]]:
        """``(key, tokens generated)`` of each running sequence."""
        ...


@runtime_checkable
class Cluster(Protocol):
    """Where generator instances run (``streamrl.components.generation.clusters``: local
    processes or Ray actors). The service checks it before any process starts, asks it each
    instance's device, and has it start each instance."""

    def check(self, gpus_per_instance: int) -> None:
        """Raise ``ConfigError`` with the fix unless instances with ``gpus_per_instance`` GPUs
        can start (the package installed, the GPUs there)."""
        ...

    def device(
        self,
        instance_id: int,
        gpus_per_instance: int,
        *,
        spare_first: bool = False,
        gpu_ids: Sequence[int] | None = None,
    ) -> str:
        """The torch device instance ``instance_id`` runs on (``"cpu"``, ``"cuda:1"``,
        ``"cuda:2,3"``...), from the generators' ``gpu_ids``; ``spare_first`` leaves
        ``cuda:0`` to the trainer."""
        ...

    def spawn(
        self,
        instance_id: int,
        spec_fields: Mapping[str, Any],
        *,
        gpus_per_instance: int,
        gpu_ids: Sequence[int] | None,
        start_timeout_s: float,
    ) -> Any:
        """Start the instance (its ``WorkerSpec`` fields) and return the handle the service's
        pool drives (``InstanceHandle``: its inbox, its sample pipe, its liveness)."""
        ...


class WeightLink(Protocol):
    """One member's end of a connected weight group (``WeightTransport.connect``)."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` in place from rank 0 (send there, receive elsewhere)."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """How a bucket of weights crosses from the trainer to an instance (or from an instance to
    the next): ``GlooTransport``, ``NcclTransport`` (``streamrl.components.weights.transport``)
    or yours. It is pickled to every instance: keep it small, importable by the child.

    Attributes:
        needs_own_gpu: the trainer and each instance must hold GPUs of their own (NCCL).
    """

    needs_own_gpu: bool

    def check(self) -> None:
        """Raise ``ConfigError`` with the fix unless it can run here (a package, a GPU)."""
        ...

    def connect(
        self, store: Any, rank: int, world_size: int, *, timeout_s: float, device: str
    ) -> WeightLink:
        """Connect this member once every member is at the rendezvous ``store`` (a
        ``torch.distributed.Store``); ``device`` is where its GPU copies live."""
        ...


@dataclass(frozen=True)
class EngineSpec:
    """What a ``GenerationEngine`` gets to build one instance, inside that instance's process.

    Attributes:
        model_dir: the policy's model directory.
        device: where the model runs (``"cpu"``, ``"cuda:1"``...).
        instance_id: the instance's id in the service.
        weight_version: the version of the weights in ``model_dir`` (a resumed or added
            instance starts at the trainer's version).
        max_batch_size: batch slots.
        temperature: sampling temperature.
        greedy: decode greedily instead of sampling.
        seed: the instance's sampling seed.
        stop_token_ids: more ids that end a sequence, besides the model's eos (end-of-turn
            tokens: ``streamrl.policy.chat.stop_token_ids``).
        stop_strings: a sequence also ends once its text contains one of these (the stop
            string's tokens are kept in the sample).
    """

    model_dir: str
    device: str
    instance_id: int
    weight_version: int
    max_batch_size: int
    temperature: float
    greedy: bool
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@runtime_checkable
class GenerationEngine(Protocol):
    """Builds the ``StreamGenerator`` of each instance (``HFEngine``, ``VLLMEngine``, or yours).

    It is pickled to every instance process (or Ray actor): keep it a small object of plain
    settings, importable by the child.
    """

    def check(self, *, cluster: Cluster, gpus_per_instance: int) -> None:
        """Raise ``ConfigError`` if it cannot run there (a package missing, an option the
        weight updates would break); called before any process starts, after
        ``cluster.check`` (the GPUs are there)."""
        ...

    def __call__(self, spec: EngineSpec, scheduler: AdmissionScheduler) -> StreamGenerator:
        """Load the model and return the instance's generator (runs in the instance process)."""
        ...


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: a tool set, a game, a multi-step task (``streamrl.envs``).

    The ``EpisodeRunner`` makes one per episode (a fresh object from the run's factory), calls
    ``reset`` with the episode's dataset row, then ``step`` with each model turn's text until a
    step is ``done`` or a limit is hit, then ``close``. Both run on an environment worker thread,
    never in a generator's decode loop, and each call has a timeout.
    """

    def reset(self, row: Mapping) -> str | list[dict]:
        """The episode's first prompt: a string, or chat messages (a system message with the
        tools, then the task)."""
        ...

    def step(self, action: str) -> Step:
        """Answer the model's turn (its text, before the end-of-turn token)."""
        ...

    def close(self) -> None:
        """Free what the episode held (called once, also after a failure)."""
        ...


@dataclass(frozen=True)
class GroupStart:
    """One prompt's group, as ``RolloutStream`` asks a ``Sampler`` to start it.

    Attributes:
        row: the prompt's dataset row (its ``prompt_id``, and whatever else the task reads).
        size: samples in the group (the algorithm's ``group_size``).
        iteration: the iteration the group trains in.
        min_weight_version: instances admit its requests once they hold this version or newer.
        max_tokens: the generation budget of one sample (the room left in ``context`` caps it).
        context: the policy's context length.
        prompt_ids: renders the row's prompt as the stream does (its tokenizer, chat template
            and system prompt); a sampler whose prompts come from elsewhere (an environment's
            ``reset``) never calls it.
        forced_length: if given, the group's samples ignore EOS and generate exactly this many
            tokens (the room left in the context allowing; benchmarks, §7).
    """

    row: Mapping[str, Any]
    size: int
    iteration: int
    min_weight_version: int
    max_tokens: int
    context: int
    prompt_ids: Callable[[], list[int]]
    forced_length: int | None = None


@runtime_checkable
class Sampler(Protocol):
    """Where ``RolloutStream``'s samples come from: the ``StreamGenerationService`` (a sample is
    one completion of the row's prompt) or the ``EpisodeRunner`` (a sample is one multi-turn
    episode of the row's environment, on the service).

    The stream calls ``start_group`` for each prompt of an iteration, sends what it returns with
    ``submit``, and takes the finished samples, in completion order, from ``next_sample``. A
    sample whose key it did not request is an error. What a sampler must say of its samples:

    - ``scores_samples``: whether they come scored (``Sample.reward`` set, an episode by its
      environment); the stream then sends none to its reward, and needs none;
    - ``left_out(sample)``: whether a finished sample stays out of the loss (an episode the
      environment cut): its group is scored over the others, and it is counted as the
      environment's fault, not lost.
    """

    @property
    def dispatcher(self) -> Dispatcher:
        """The dispatcher placing the requests (the ranker's refresh feeds it lengths)."""
        ...

    @property
    def scores_samples(self) -> bool:
        """Whether finished samples carry their reward (no reward function needed)."""
        ...

    def start_group(self, group: GroupStart) -> list[Request]:
        """The requests of one prompt's group, one per sample (keys ``(prompt_id, index,
        iteration)``, index ``0..size-1``); nothing is sent yet.

        Raises:
            ValueError: the prompt leaves no room in the context (or ``EnvError``: the
                environment failed to start an episode).
        """
        ...

    def submit(self, requests: Sequence[Request], scores: Sequence[float] | None = None) -> None:
        """Send requests ``start_group`` made (``scores``: predicted lengths, for dispatch)."""
        ...

    def next_sample(self) -> Sample:
        """The next finished sample, in completion order (blocks; raises past its timeout)."""
        ...

    def left_out(self, sample: Sample) -> bool:
        """Whether ``sample`` stays out of the loss (the environment's fault)."""
        ...

    def close(self) -> None:
        """Stop: drop what is still open (a run that stops mid-iteration). Safe to call twice."""
        ...
