"""Multi-turn episodes on the stream generation service (StreamRL §3, applied to episodes).

``EpisodeRunner`` stands between the service and the trainer's ``RolloutStream``. Each request
the stream sends starts an episode: a fresh environment is reset from the prompt's row, and its
first prompt becomes the first turn. When a turn's sample comes back, the environment's ``step``
runs on a thread of its own, so the generator instances keep decoding every other sequence
meanwhile; its observation is appended as tokens (``Episode``) and the next turn goes back to the
instance that ran the last one, which kept the conversation's KV cache (``Request.keep_prefix``):
only the observation is prefilled. A finished episode streams to the trainer at once, as one
``Sample`` with a loss mask over the environment's tokens.

Skew (§5): the episode's cost the ranker learns is all its tokens, every turn's generation and
observation (what it occupies a batch slot for); its later turns keep their share of the
prediction for LPT admission. When the instance holding an episode has ``rebalance_requests``
more requests open than the least loaded one, the next turn moves there instead (its prefix is
prefilled again). An instance that fails has its open turns requeued by the service; each turn's
request holds the whole conversation, so an episode continues wherever it lands.

Outcomes of what can go wrong in an episode: the environment's ``step`` past ``env_timeout_s`` ->
the episode ends, truncated (``finish_reason="env_timeout"``); more than ``max_turns`` turns ->
``"max_turns"``; no room left in the context for the next observation and a token -> ``"context"``;
a step that is not a ``Step``, a non-finite reward, or an environment that raises ->
``EnvError`` naming the environment and the prompt (the run stops); so is a first prompt that is
blank or leaves no room in the context (``streamrl.envs.contract``). With ``env_workers`` the
environments run in worker processes (``streamrl.envs.workers``): an episode whose worker died
or hung starts again from its prompt on a replacement (``episodes_restarted``), nothing lost or
trained twice; a step past the timeout has its worker pinged, and one that does not answer is
killed and replaced.

An episode the environment cut (``ENV_FAULTS``) is the environment's fault, not the policy's:
with ``on_fault="drop"`` (the default) the trainer leaves it out of the loss (``left_out``;
``RolloutStream`` scores its group over the other episodes and counts it), with ``"train"`` it is
trained with the reward it had. The cuts the policy causes (``max_turns``, ``context``) are
always trained.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from streamrl.components.generation.service import GeneratorError, StreamGenerationService
from streamrl.envs.contract import check_reset, check_step, env_name
from streamrl.envs.episode import Episode, TurnFormat
from streamrl.envs.tools import run_with_timeout
from streamrl.envs.workers import EnvWorkerLost, EnvWorkers
from streamrl.errors import EnvError
from streamrl.policy.chat import completion_text, render_prompt
from streamrl.protocols import Dispatcher, Environment, GroupStart
from streamrl.records import Request, Sample, Step

#: How long the runner waits on the instances at a time while environment steps are running.
POLL_S = 0.02
#: Finish reasons of episodes the environment cut (the policy did nothing wrong).
ENV_FAULTS: frozenset[str] = frozenset({"env_timeout"})
#: What the trainer does with such episodes (``EpisodeRunner``'s ``on_fault``).
OnFault = Literal["drop", "train"]


class EpisodeRunner:
    """Runs episodes of ``make_env`` environments on ``service`` (module docstring).

    It is a ``Sampler`` (``streamrl.protocols``), as the service is, so a ``RolloutStream`` takes
    it in the service's place (``RolloutStream(..., sampler=runner)``): each sample is an
    episode, rewarded by its environment.

    Args:
        service: a started ``StreamGenerationService``.
        make_env: makes one episode's environment (a class, or a function of no arguments).
        tokenizer: the policy's tokenizer (its chat template formats the turns).
        max_tokens: the most tokens one turn may generate.
        context: the policy's context length; an episode never grows past it.
        max_turns: model turns per episode.
        env_timeout_s: the longest one ``reset`` or ``step`` may take.
        rebalance_requests: move an episode's next turn off its instance when that instance has
            this many more requests open than the least loaded one (``None``: never move).
        affinity: send each turn to the instance of the episode's last turn (its prefix's KV
            cache is there); ``False``: the dispatcher places every turn (a turn-level balancer).
        system_prompt: put before the first prompt (when the environment gives no system
            message).
        stop_strings: a turn's text ends before these (the generators stop on them too).
        on_fault: ``"drop"``: an episode the environment cut (``ENV_FAULTS``) is left out of
            the loss (``left_out``); ``"train"``: it is trained with the reward it had.
        greedy: every turn decoded greedily whatever the instances' sampling settings (a
            held-out evaluation on the run's instances, ``streamrl.eval.episodes``).
        env_workers: processes the environments run in (``EnvWorkers``; ``make_env`` must
            pickle); 0: threads of this process.
        max_env_restarts: env workers replaced (died or hung) before the run stops.
        env_status_path: a JSON file of the env workers' pids (slot -> pid), or ``None``.

    Attributes:
        counts: the ledger: episodes started and finished (and why), turns, environment steps,
            turns moved to another instance; the service's own counts hold the requests.
    """

    def __init__(
        self,
        service: StreamGenerationService,
        make_env: Callable[[], Environment],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_tokens: int,
        context: int,
        max_turns: int = 8,
        env_timeout_s: float = 30.0,
        rebalance_requests: int | None = None,
        affinity: bool = True,
        system_prompt: str | None = None,
        stop_strings: Sequence[str] = (),
        on_fault: OnFault = "drop",
        greedy: bool = False,
        env_workers: int = 0,
        max_env_restarts: int = 10,
        env_status_path: str | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}.")
        if on_fault not in ("drop", "train"):
            raise ValueError(f"on_fault must be 'drop' or 'train', got {on_fault!r}.")
        self.service, self.make_env, self.tokenizer = service, make_env, tokenizer
        self.max_tokens, self.context, self.max_turns = max_tokens, context, max_turns
        self.env_timeout_s, self.rebalance_requests = env_timeout_s, rebalance_requests
        self.affinity, self.on_fault, self.greedy = affinity, on_fault, greedy
        self.system_prompt, self.stop_strings = system_prompt, tuple(stop_strings)
        self.format = TurnFormat(tokenizer)
        self.counts: Counter[str] = Counter()
        self._episodes: dict[tuple, Episode] = {}
        self._stepping: dict[tuple, float] = {}  # episode key -> when its env step started
        self._stepped: queue.Queue = queue.Queue()  # (key, Step | BaseException) from threads
        self._finished: deque[Sample] = deque()
        #: The env worker processes, or ``None`` (environments on threads of this process).
        self.workers: EnvWorkers | None = None
        if env_workers > 0:
            self.workers = EnvWorkers(
                make_env, env_workers, max_restarts=max_env_restarts, status_path=env_status_path
            )
            self.workers.start()
            self.make_env = self.workers.make

    # -- what RolloutStream calls (streamrl.protocols.Sampler) -----------------------------
    #: An episode comes scored by its environment (the stream's reward is not used).
    scores_samples = True

    @property
    def dispatcher(self) -> Dispatcher:
        return self.service.dispatcher

    def start_group(self, group: GroupStart) -> list[Request]:
        """Start ``group.size`` episodes of the row (``start``): their first turns' requests,
        each prompted by its environment's ``reset`` (the stream's rendering is not used)."""
        return [
            self.start(group.row, index, group.iteration, group.min_weight_version)
            for index in range(group.size)
        ]

    def start(
        self,
        row: Mapping[str, Any],
        sample_index: int = 0,
        iteration: int = 0,
        min_weight_version: int = 0,
    ) -> Request:
        """Make and reset the environment of one episode of ``row`` (its prompt's
        ``sample_index``-th); returns its first turn's request, prompted with what ``reset``
        gave."""
        for attempt in range(3):  # a worker lost mid-reset: again, on its replacement
            env = self.make_env()
            try:
                prompt = self._call(env, "reset", lambda env=env: env.reset(row), row)
                break
            except EnvError as err:
                if not isinstance(err.__cause__, EnvWorkerLost) or attempt == 2:
                    raise
                self.counts["resets_retried"] += 1
        try:
            check_reset(env, prompt, row.get("prompt_id"))
        except EnvError:
            self._close(env)
            raise
        ids = render_prompt(self.tokenizer, prompt, system_prompt=self._system(prompt))
        budget = min(self.max_tokens, self.context - len(ids))
        if budget < 1:
            self._close(env)
            raise EnvError(
                f"Prompt {row.get('prompt_id')!r}: {env_name(env)}.reset's first prompt has "
                f"{len(ids)} tokens, no room left in the context of {self.context}; shorten the "
                "observation (or the system prompt), or use a model with a larger context."
            )
        first = Request(
            str(row["prompt_id"]),
            ids,
            budget,
            sample_index,
            iteration=iteration,
            min_weight_version=min_weight_version,
            keep_prefix=True,
            greedy=self.greedy,
        )
        self._episodes[first.key] = Episode(first, row, env, ids)
        self.counts["episodes_started"] += 1
        return first

    def left_out(self, sample: Sample) -> bool:
        """Whether the trainer leaves the finished episode ``sample`` out of the loss: the
        environment cut it (``ENV_FAULTS``) and ``on_fault`` is ``"drop"``."""
        return self.on_fault == "drop" and sample.finish_reason in ENV_FAULTS

    def prompt_ids(self, key: tuple) -> list[int]:
        """The first prompt of an open episode."""
        return self._episodes[key].prompt_ids

    def submit(self, requests: Sequence[Request], scores: Sequence[float] | None = None) -> None:
        """Send the first turns of started episodes (``start``) to the service."""
        unknown = [r.key for r in requests if r.key not in self._episodes]
        if unknown:
            raise ValueError(f"submit: {unknown} start no episode; call start() for each first.")
        self.service.submit(requests, scores)

    def next_sample(self) -> Sample:
        """The next finished episode, in completion order.

        Raises:
            EnvError: an environment broke its contract.
            GeneratorError: the instances failed (``StreamGenerationService``), or no turn
                came back within the service's ``sample_timeout_s``.
        """
        timeout_s = getattr(self.service, "sample_timeout_s", 300.0)
        progress = time.monotonic()  # when a turn or a step last came back
        while not self._finished:
            if not self._episodes:
                raise RuntimeError("next_sample: no episode is open; submit() some first.")
            steps = self.counts["env_steps"] + self.counts["env_timeouts"]
            self._take_steps()
            if self._finished:
                break
            if self.service.open_requests:
                sample = self.service.poll_sample(POLL_S if self._stepping else 0.5)
                if sample is not None:
                    self._on_turn(sample)
                    progress = time.monotonic()
            else:  # only environments are working: wait for one
                self._take_steps(block_s=POLL_S)
            if self.counts["env_steps"] + self.counts["env_timeouts"] > steps:
                progress = time.monotonic()
            elif time.monotonic() - progress > timeout_s:
                raise GeneratorError(
                    f"No turn of {len(self._episodes)} open episodes came back within "
                    f"{timeout_s:.0f} s; instances: {self.service.instances()}."
                )
        return self._finished.popleft()

    # -- turns and steps -------------------------------------------------------------------
    def _on_turn(self, sample: Sample) -> None:
        """A turn came back: record it, then let the environment answer it on a thread."""
        episode = self._episodes[sample.key]
        episode.add_turn(sample)
        self.counts["turns"] += 1
        text = completion_text(self.tokenizer, sample.token_ids, stop_strings=self.stop_strings)
        self._stepping[sample.key] = time.monotonic()

        def step() -> None:
            try:
                result: Step | BaseException = episode.env.step(text)
            except BaseException as err:
                result = err
            self._stepped.put((sample.key, episode, result))

        threading.Thread(target=step, daemon=True, name="streamrl-env").start()

    def _take_steps(self, block_s: float = 0.0) -> None:
        """Handle the steps that came back (waiting up to ``block_s`` for the first); end the
        episodes whose step ran past ``env_timeout_s``."""
        while True:
            try:
                key, episode, result = self._stepped.get(timeout=block_s or None, block=block_s > 0)
            except queue.Empty:
                break
            block_s = 0.0
            # A step that comes back after its episode timed out is dropped.
            if self._episodes.get(key) is episode and self._stepping.pop(key, None) is not None:
                self._on_step(episode, result)
        now = time.monotonic()
        for key, started in list(self._stepping.items()):
            if now - started > self.env_timeout_s:
                del self._stepping[key]
                self.counts["env_timeouts"] += 1
                episode = self._episodes[key]
                if self.workers is not None and not self.workers.check(episode.env):
                    self.counts["env_workers_hung"] += 1  # killed: its other episodes restart
                self._finish(episode, "env_timeout")

    def _on_step(self, episode: Episode, result: Step | BaseException) -> None:
        if isinstance(result, EnvWorkerLost):  # not the episode's doing: it starts again
            return self._restart(episode)
        self.counts["env_steps"] += 1
        step = self._checked(episode, result)
        episode.rewards.append(float(step.reward))
        if step.done:
            return self._finish(episode, "done")
        if episode.turns >= self.max_turns:
            return self._finish(episode, "max_turns")
        observed = self.format.observation_ids(episode.token_ids, step.role, step.observation)
        room = self.context - len(episode.ids) - len(observed)
        if room < 1:
            return self._finish(episode, "context")
        episode.add_observation(observed)
        first = episode.request
        predicted = first.predicted_length  # the episode's cost: what is left of it
        if predicted is not None:
            predicted = max(1.0, predicted - len(episode.token_ids))
        turn = Request(
            first.prompt_id,
            episode.ids,
            min(self.max_tokens, room),
            first.sample_index,
            iteration=first.iteration,
            min_weight_version=first.min_weight_version,
            predicted_length=predicted,
            keep_prefix=True,
            prefer_instance=self._placement(episode),
            greedy=first.greedy,
        )
        self.service.submit([turn], None if predicted is None else [predicted])

    def _restart(self, episode: Episode) -> None:
        """Start ``episode`` again from its prompt, under its key (its sample is awaited):
        its environment's worker was lost with the state of the conversation."""
        first = episode.request
        del self._episodes[first.key]
        self.counts["episodes_restarted"] += 1
        self.counts["episodes_started"] -= 1  # counted again by start()
        again = self.start(
            episode.row, first.sample_index, first.iteration, first.min_weight_version
        )
        again.predicted_length = first.predicted_length
        predicted = None if first.predicted_length is None else [first.predicted_length]
        self.service.submit([again], predicted)

    def _checked(self, episode: Episode, result: Step | BaseException) -> Step:
        name, pid = env_name(episode.env), episode.request.prompt_id
        if isinstance(result, BaseException):
            self._finish(episode, "error")
            raise EnvError(f"{name}.step raised {result!r} on prompt {pid!r}.") from result
        try:
            return check_step(episode.env, result, pid)
        except EnvError:
            self._finish(episode, "error")
            raise

    def _placement(self, episode: Episode) -> int | None:
        """The instance for the episode's next turn: the one holding its prefix, unless it has
        ``rebalance_requests`` more open than the least loaded instance."""
        if not self.affinity:
            return None
        if self.rebalance_requests is None:
            return episode.instance_id
        load = {h.instance_id: len(h.open) for h in self.service.pool.active()}
        held = load.get(episode.instance_id)
        if held is None or held - min(load.values()) < self.rebalance_requests:
            return episode.instance_id  # not active any more: the dispatcher places it
        self.counts["turns_moved"] += 1
        return min(load, key=load.__getitem__)

    @property
    def prefill_saved(self) -> float:
        """The share of the finished episodes' prompt tokens whose KV cache was reused from the
        turn before (not prefilled again)."""
        cached, computed = self.counts["cached_tokens"], self.counts["prefill_tokens"]
        return cached / max(1, cached + computed)

    def _finish(self, episode: Episode, reason: str) -> None:
        episode.finish_reason = reason
        del self._episodes[episode.request.key]
        self._close(episode.env)
        self.counts[f"episodes_{reason}"] += 1
        self.counts["prefill_tokens"] += episode.prefill_tokens
        self.counts["cached_tokens"] += episode.cached_tokens
        if reason != "error":
            self.counts["episodes_finished"] += 1
            self._finished.append(episode.to_sample())

    # -- helpers ---------------------------------------------------------------------------
    def _system(self, prompt: str | list[dict]) -> str | None:
        if isinstance(prompt, list) and prompt and prompt[0].get("role") == "system":
            return None
        return self.system_prompt

    def _call(self, env: Environment, what: str, fn: Callable[[], Any], row: Mapping) -> Any:
        try:
            return run_with_timeout(fn, self.env_timeout_s)
        except BaseException as err:
            self._close(env)
            raise EnvError(
                f"{env_name(env)}.{what} failed on prompt {row.get('prompt_id')!r}: {err!r}."
            ) from err

    def _close(self, env: Environment) -> None:
        try:
            run_with_timeout(env.close, self.env_timeout_s)
        except BaseException:
            self.counts["env_close_failed"] += 1

    def close(self) -> None:
        """Close every open episode's environment (a run that stops mid-iteration)."""
        for episode in list(self._episodes.values()):
            self._close(episode.env)
        self._episodes.clear()
        self._stepping.clear()
        if self.workers is not None:
            self.workers.close()
