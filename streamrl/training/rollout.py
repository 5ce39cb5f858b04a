"""From prompts to scored groups: the trainer's side of the sample stream (StreamRL §3, §4.1).

``PromptSource`` (``streamrl.training.prompts``) deals prompts for each iteration (shuffled each
epoch, resumable). ``RolloutStream`` has its sampler start each prompt's group (the stream
generation service: completions; an ``EpisodeRunner``: multi-turn episodes, ``streamrl.protocols.
Sampler``) and, as samples stream back, scores each on arrival and yields a prompt's group the
moment its last sample lands, so the trainer can start on it while the rest is still being
generated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from streamrl.algorithms.base import Algorithm
from streamrl.components.generation.service import StreamGenerationService
from streamrl.policy.chat import completion_text, render_prompt
from streamrl.protocols import DistributionalLengthPredictor, GroupStart, LengthPredictor, Sampler
from streamrl.records import Request, Sample, ScoredGroup
from streamrl.rewards.pool import RewardPool, Scored
from streamrl.rewards.spec import RewardSpec
from streamrl.runtime.stopping import shielded
from streamrl.training.prompts import PromptSource
from streamrl.training.stream_ledger import StreamLedger
from streamrl.training.timeline import TraceRecorder

#: How long the trainer waits on the reward pool at a time when only rewards are outstanding.
REWARD_POLL_S = 0.05
#: The service's events the run's ledger sums over every start (``StreamLedger.events``).
SERVICE_EVENTS = ("instances_restarted", "requests_requeued", "samples_discarded")


@dataclass
class IterationStats:
    """Timings and counts of one iteration's rollout (for logs and the closing summary)."""

    samples: int = 0
    tokens: int = 0
    #: The generation phase on the generators: its first admission to its last sample's finish
    #: (the samples' own timestamps; the simulator's ``gen_s``). Not the trainer's consumption
    #: of it, which waits on training too: in async mode the consumption of iteration b spans the
    #: step on b - 1, so an elastic trigger comparing it with ``train_s`` would always see
    #: generation lag (§4.2). Samples without timestamps: dispatch to the last group taken.
    generate_s: float = 0.0
    wait_s: float = 0.0  # time the trainer spent blocked waiting for the next sample
    rewards: list[float] = field(default_factory=list)
    reward_parts: dict[str, list[float]] = field(default_factory=dict)  # per reward, unweighted
    lengths: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # each sample's prompt, as lengths
    #: Samples missing from the groups trained: episodes the environment cut, left out of the
    #: loss (``Sampler.left_out``); the trainer divides its loss by the samples it has.
    left_out: int = 0


@dataclass
class _Batch:
    """One dispatched iteration: its prompts, groups being filled and groups ready to train."""

    rows: dict[str, dict]
    dispatched_s: float
    min_weight_version: int = 0
    refills: int = 0
    partial: dict[str, list[Sample]] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)  # per prompt: samples left out
    ready: list[ScoredGroup] = field(default_factory=list)
    awaiting: int = 0  # samples requested and not yet received
    unscored: dict[tuple, Sample] = field(default_factory=dict)  # received, reward pending
    delivered: int = 0
    stats: IterationStats = field(default_factory=IterationStats)
    first_started_s: float = float("inf")  # wall clock, of the samples received
    last_finished_s: float = 0.0

    def timed(self, sample: Sample) -> None:
        """Widen the generation phase to cover ``sample`` (if it carries timestamps)."""
        if 0 < sample.started_s <= sample.finished_s:
            self.first_started_s = min(self.first_started_s, sample.started_s)
            self.last_finished_s = max(self.last_finished_s, sample.finished_s)

    def generate_s(self) -> float:
        """First admission to last finish; dispatch to now without timestamps."""
        if self.last_finished_s > 0:
            return self.last_finished_s - self.first_started_s
        return time.perf_counter() - self.dispatched_s


class RolloutStream:
    """Streams scored groups from the service; several iterations may be in flight.

    ``dispatch`` sends the next iteration's prompts and returns its number at once; ``groups``
    yields that iteration's groups as they complete. Samples of a later iteration that arrive
    meanwhile are scored on arrival and kept for it (one-step asynchronous mode, §4.1).
    ``iteration()`` is ``groups(dispatch())``, the synchronous case.

    Args:
        service: a started ``StreamGenerationService`` (its weights and dispatcher).
        prompts: deals the prompts of each iteration.
        tokenizer: encodes prompts and decodes completions for the reward.
        algorithm: scores groups (its ``group_size`` samples per prompt); its ``score_sample``
            may shape each sample's reward.
        reward: the run's reward: a ``RewardPool`` (rewards in worker processes, off the
            trainer's critical path) or a plain function ``fn(completion, row) -> float``
            (scored inline; any form ``streamrl.rewards.spec`` accepts). Needed unless the
            sampler scores its samples (``Sampler.scores_samples``), which then ignores it.
        max_tokens: generation budget per sample.
        context: the policy's context length; a sample's budget never runs past it.
        trace: where sample spans and the trainer's waits are recorded for the timeline.
        forced_lengths: if given, each prompt's samples ignore EOS and generate exactly its
            length (the paper's throughput protocol, §7; benchmarks): the next length of an
            iterator, or a function of the prompt's row (a length the prompt's text implies).
        ranker: a ``LengthPredictor`` of each prompt's output length for the dispatcher and
            LPT admission (§5.2-5.3); its ``learn`` gets the policy's own finished samples every
            ``ranker_refresh_every`` iterations (the dispatcher observes their lengths then,
            with or without a ranker), right after the next dispatch so that it runs while the
            instances generate (until it is ``ready``, no scores are sent).
        system_prompt: a system message put before each prompt (chat-templated tokenizers).
        chat_template: whether string prompts go through the tokenizer's chat template
            (``None``: when it has one; chat-message prompts always do; ``streamrl.policy.chat``).
        stop_strings: the completion the reward sees ends before the first of these (the
            generators stop there too when given the same strings).
        max_refills: groups an algorithm filters out (``keep_group``, e.g. DAPO's dynamic
            sampling) are replaced by new prompts from the stream, at most this many per
            iteration (default: twice the prompts per iteration).
        sampler: where the samples come from (``streamrl.protocols.Sampler``): ``service``
            itself by default (one completion per sample), or an ``EpisodeRunner`` on it (one
            multi-turn episode per sample, rewarded by its environment). A sample the sampler
            leaves out (``left_out``: an episode the environment cut) is no member of its
            group: the group is scored over the others, or, with fewer than the algorithm's
            ``min_group_size`` left, filtered and refilled like a group ``keep_group`` drops;
            such samples are counted in ``samples_env_fault``. A completion the reward pool
            gives up on (its scoring killed or hung a reward worker twice: ``Scored.fault``) is
            left out the same way and counted in ``samples_reward_fault``.
        episodes: the older name of ``sampler`` (an ``EpisodeRunner``).

    Raises:
        ValueError: no ``reward`` for a sampler that does not score its samples, both
            ``sampler`` and ``episodes``, or a setting ``check_settings`` refuses.
    """

    def __init__(
        self,
        service: StreamGenerationService,
        prompts: PromptSource,
        tokenizer: PreTrainedTokenizerBase,
        algorithm: Algorithm,
        *,
        reward: RewardPool | Callable[..., Any] | None = None,
        max_tokens: int = 64,
        context: int,
        trace: TraceRecorder | None = None,
        forced_lengths: Iterator[int] | Callable[[Mapping[str, Any]], int] | None = None,
        ranker: LengthPredictor | None = None,
        ranker_refresh_every: int = 10,
        system_prompt: str | None = None,
        chat_template: bool | None = None,
        stop_strings: Sequence[str] = (),
        max_refills: int | None = None,
        sampler: Sampler | None = None,
        episodes: Sampler | None = None,
    ) -> None:
        if sampler is not None and episodes is not None:
            raise ValueError("RolloutStream: pass sampler= only (episodes= is its older name).")
        self.check_settings(
            max_tokens=max_tokens,
            ranker_refresh_every=ranker_refresh_every,
            max_refills=max_refills,
        )
        self.service, self.prompts, self.tokenizer = service, prompts, tokenizer
        #: Where requests go and samples come from: the service, or a sampler on it.
        self.sampler: Sampler = sampler or episodes or service
        if reward is None and not self.sampler.scores_samples:
            raise ValueError(
                f"RolloutStream: {type(self.sampler).__name__} does not score its samples; pass "
                "reward= (fn(completion, row) -> float, or a RewardPool)."
            )
        if reward is not None and not isinstance(reward, RewardPool):
            reward = RewardPool([RewardSpec(reward)], workers=0)
        #: The reward of samples that come unscored; ``None`` when the sampler scores them.
        self.reward = None if self.sampler.scores_samples else reward
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.stop_strings = tuple(stop_strings)
        self._prompt_ids: dict[str, list[int]] = {}  # prompt id -> rendered token ids
        self.trace = trace if trace is not None else TraceRecorder()
        self.forced_lengths = forced_lengths
        self.ranker, self.ranker_refresh_every = ranker, ranker_refresh_every
        self._finished_lengths: list[tuple[str, int]] = []  # (prompt text, length) since refresh
        self._refresh_due = False
        self.algorithm, self.max_tokens, self.context = algorithm, max_tokens, context
        self.stats = IterationStats()
        self._batches: dict[int, _Batch] = {}
        self._next_iteration = 0
        self.prompts_dispatched = 0
        self.samples_filtered = 0  # in groups an algorithm's keep_group dropped
        #: Samples received and left out (an environment's or a reward's fault), events, over
        #: the whole run (resumed or not), each counted once.
        self.ledger = StreamLedger()
        self._redispatch: dict[int, list[dict]] = {}  # in-flight iterations of a checkpoint
        self._untrained: dict[int, dict[str, dict]] = {}  # delivered, optimizer step not done
        self.max_refills = 2 * prompts.batch_size if max_refills is None else max_refills

    @staticmethod
    def check_settings(
        *, max_tokens: int, ranker_refresh_every: int, max_refills: int | None
    ) -> None:
        """The stream's own settings checked (its constructor calls this, and so does a
        config's check, before any work).

        Raises:
            ValueError: a budget or a refresh period below 1, or fewer than 0 refills.
        """
        if max_tokens < 1 or ranker_refresh_every < 1:
            raise ValueError(
                f"max_tokens and ranker_refresh_every must be >= 1, got {max_tokens} and "
                f"{ranker_refresh_every}."
            )
        if max_refills is not None and max_refills < 0:
            raise ValueError(
                f"max_refills must be >= 0 (or null: twice the prompts), got {max_refills}."
            )

    @property
    def samples_env_fault(self) -> int:
        """Samples the sampler left out of the loss (an episode its environment cut)."""
        return self.ledger.totals["samples_env_fault"]

    @property
    def samples_reward_fault(self) -> int:
        """Samples whose scoring killed or hung two reward workers (``Scored.fault``)."""
        return self.ledger.totals["samples_reward_fault"]

    @property
    def samples_received(self) -> int:
        """Samples that came back from the sampler (completions, or episodes)."""
        return self.ledger.totals["samples_received"]

    def events(self) -> dict[str, int]:
        """The service's ``SERVICE_EVENTS`` and the reward workers restarted, over the run."""
        counts = {k: self.service.counts[k] for k in SERVICE_EVENTS}
        counts["reward_workers_restarted"] = self.reward.restarts if self.reward else 0
        return self.ledger.events(counts)

    @property
    def episodes(self) -> Sampler | None:
        """The sampler when it is not the service (the older name, for an ``EpisodeRunner``)."""
        return None if self.sampler is self.service else self.sampler

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts.batch_size * self.algorithm.group_size

    def dispatch(self, min_weight_version: int = 0) -> int:
        """Send the next iteration's requests; instances admit them once they hold at least
        ``min_weight_version``. Returns the iteration number.

        The prompt source and the stream's in-flight iterations move together (``shielded``):
        a stop (SIGTERM, Ctrl-C) landing in between would checkpoint prompts taken from the
        source but in no iteration, lost to the resumed run."""
        with shielded():
            iteration, self._next_iteration = self._next_iteration, self._next_iteration + 1
            if iteration in self._redispatch:  # resumed: the same prompts as before the stop
                rows = {row["prompt_id"]: row for row in self._redispatch.pop(iteration)}
            else:
                rows = {row["prompt_id"]: row for row in self.prompts.next_batch()}
            requests = [
                r
                for pid, row in rows.items()
                for r in self._requests(pid, row, iteration, min_weight_version)
            ]
            self._batches[iteration] = _Batch(
                rows,
                time.perf_counter(),
                min_weight_version,
                partial={pid: [] for pid in rows},
                awaiting=len(requests),
            )
            self.prompts_dispatched += len(rows)
        self.sampler.submit(requests, self._predicted_lengths(requests, rows))
        if self._refresh_due:  # while the instances generate, not on the trainer's critical path
            self._refresh_ranker()
        return iteration

    def state_dict(self) -> dict:
        """Where the stream is, for checkpoints: the next iteration number and the prompts of
        iterations dispatched but not yet trained (``trained``): generated again on resume, so
        samples that were generated but not trained are regenerated, never trained twice nor
        lost."""
        in_flight = {it: list(rows.values()) for it, rows in self._untrained.items()}
        in_flight.update({it: list(batch.rows.values()) for it, batch in self._batches.items()})
        return {
            "next_iteration": self._next_iteration,
            "in_flight": in_flight,
            "prompts_dispatched": self.prompts_dispatched - sum(map(len, in_flight.values())),
            "samples_filtered": self.samples_filtered,
            "ledger": self.ledger.state_dict(
                {it: [row["prompt_id"] for row in rows] for it, rows in in_flight.items()},
                self.events(),
            ),
        }

    def load_state_dict(self, state: dict) -> None:
        self._redispatch = {int(it): rows for it, rows in state["in_flight"].items()}
        self._next_iteration = min(self._redispatch, default=state["next_iteration"])
        self.prompts_dispatched = state["prompts_dispatched"]
        self.samples_filtered = state["samples_filtered"]
        older = {"counted": {"samples_env_fault": state.get("samples_env_fault", 0)}}
        self.ledger.load_state_dict(state.get("ledger", older))

    def _requests(
        self, pid: str, row: dict, iteration: int, min_weight_version: int
    ) -> list[Request]:
        """One request per sample of the prompt's group, as the sampler starts it."""
        requests = self.sampler.start_group(
            GroupStart(
                row,
                self.algorithm.group_size,
                iteration,
                min_weight_version,
                self.max_tokens,
                self.context,
                prompt_ids=lambda: self.prompt_ids(pid, row),
                forced_length=self._forced_length(row),
            )
        )
        # The prompt as sampled (an environment's first prompt), for the length predictor.
        self._prompt_ids[pid] = requests[0].prompt_ids
        return requests

    def _forced_length(self, row: dict) -> int | None:
        lengths = self.forced_lengths
        if lengths is None:
            return None
        return int(lengths(row)) if callable(lengths) else next(lengths)

    def prompt_ids(self, prompt_id: str, row: dict) -> list[int]:
        """The prompt's token ids: chat messages (or a string, with a chat-templated tokenizer)
        rendered by the template with the generation prompt; cached per prompt."""
        if prompt_id not in self._prompt_ids:
            self._prompt_ids[prompt_id] = render_prompt(
                self.tokenizer,
                row["prompt"],
                system_prompt=self.system_prompt,
                chat=self.chat_template,
            )
        return self._prompt_ids[prompt_id]

    def _prompt_text(self, row: dict) -> str:
        """What the length predictor reads: the prompt string, or the rendered conversation."""
        if isinstance(row.get("prompt"), str):
            return row["prompt"]
        return self.tokenizer.decode(self.prompt_ids(row["prompt_id"], row))

    def groups(self, iteration: int) -> Iterator[ScoredGroup]:
        """Yield the groups of ``iteration`` as they complete (scored on arrival)."""
        batch = self._batches[iteration]
        self.stats = batch.stats
        while batch.delivered < len(batch.rows):
            if batch.ready:
                batch.delivered += 1
                yield batch.ready.pop(0)
                continue
            waited = time.perf_counter()
            with self.trace.span("trainer", "wait", iteration):
                # rewards in flight: take what is done
                if self.reward is not None and (batch.unscored or not batch.awaiting):
                    scored = self.reward.collect(0.0 if batch.awaiting else REWARD_POLL_S)
                    self._scored(scored)
                if batch.awaiting and not batch.ready:
                    self._receive(self.sampler.next_sample())
            batch.stats.wait_s += time.perf_counter() - waited
        batch.stats.generate_s = batch.generate_s()
        # In flight for checkpoints until the step that trains it is done (``trained``); an
        # older one left here was trained: iterations are trained in order. Held there before
        # it leaves ``_batches``: a stop landing in between finds it in one or both, never none.
        self._untrained = {iteration: batch.rows}
        del self._batches[iteration]
        if (iteration + 1) % self.ranker_refresh_every == 0:
            self._refresh_due = True

    def trained(self, iteration: int) -> None:
        """The optimizer step on ``iteration``'s groups is done: checkpoints no longer redo it."""
        self._untrained.pop(iteration, None)
        self.ledger.settled(iteration)

    def iteration(self) -> Iterator[ScoredGroup]:
        """Dispatch one iteration and yield its groups as soon as each is complete."""
        return self.groups(self.dispatch())

    def _predicted_lengths(self, requests: list[Request], rows: dict) -> list[float] | None:
        if self.ranker is None or not self.ranker.ready:
            return None
        texts = [self._prompt_text(r) for r in rows.values()]
        if isinstance(self.ranker, DistributionalLengthPredictor):
            # Each request carries its distribution (planners that weigh the tail read it);
            # the point score stays the median, the paper's prediction (§5.2).
            dists = dict(zip(rows, self.ranker.predict_distribution(texts)))
            for request in requests:
                request.length_dist = dists[request.prompt_id]
            return [dists[r.prompt_id].median for r in requests]
        by_prompt = dict(zip(rows, self.ranker.predict(texts)))
        return [by_prompt[r.prompt_id] for r in requests]

    def _refresh_ranker(self) -> None:
        """Online refresh (§5.2): the policy's lengths drift, so the dispatcher's length
        distribution ``D`` and the ranker follow them."""
        self._refresh_due = False
        lengths = [n for _, n in self._finished_lengths]
        self.service.dispatcher.observe(lengths)
        if self.ranker is not None:
            self.ranker.learn([p for p, _ in self._finished_lengths], lengths)
        self._finished_lengths = []

    def _refill(self, batch: _Batch, prompt_id: str, iteration: int) -> None:
        """Replace a filtered group by the stream's next prompt, in the same iteration (at most
        ``max_refills`` times per iteration; past that the iteration trains one group fewer)."""
        with shielded():  # the source and the iteration's rows move together (``dispatch``)
            self.samples_filtered += len(batch.partial[prompt_id])  # the left out are counted
            del batch.rows[prompt_id], batch.partial[prompt_id]
            batch.left_out.pop(prompt_id, None)
            if batch.refills >= self.max_refills:
                return
            batch.refills += 1
            row = self.prompts.next_row()
            while row["prompt_id"] in batch.rows:  # a small set can wrap into this iteration
                row = self.prompts.next_row()
            pid = row["prompt_id"]
            batch.rows[pid], batch.partial[pid] = row, []
            requests = self._requests(pid, row, iteration, batch.min_weight_version)
            batch.awaiting += len(requests)
            self.prompts_dispatched += 1
        self.sampler.submit(requests, self._predicted_lengths(requests, {pid: row}))

    def _receive(self, sample: Sample) -> None:
        """A sample arrived: send its completion to the reward (scored off the critical path
        when the reward runs in a pool)."""
        batch = self._batches[sample.iteration]
        batch.awaiting -= 1
        batch.timed(sample)
        self.ledger.count("samples_received", sample.iteration, sample.prompt_id)
        if self.sampler.left_out(sample):  # the environment's fault, not the policy's
            self.ledger.count("samples_env_fault", sample.iteration, sample.prompt_id)
            self._leave_out(batch, sample)
            return
        batch.unscored[sample.key] = sample
        if self.reward is None:  # it came scored (an episode, by its environment)
            self._scored([Scored(sample.key, float(sample.reward), {})])
            return
        row = batch.rows[sample.prompt_id]
        text = completion_text(self.tokenizer, sample.token_ids, stop_strings=self.stop_strings)
        self.reward.submit(sample.key, text, row)
        self._scored(self.reward.collect())

    def _scored(self, results: list[Scored]) -> None:
        """Rewards came back: the samples join their groups; a full group is scored."""
        for result in results:
            iteration = result.key[2]
            batch = self._batches[iteration]
            sample = batch.unscored.pop(result.key)
            if result.fault is not None:  # the reward's fault (crashed or hung), not the policy's
                self.ledger.count("samples_reward_fault", iteration, sample.prompt_id)
                self._leave_out(batch, sample)
                continue
            sample.reward = self.algorithm.score_sample(sample, result.total)
            sample.reward_parts = dict(result.parts) or None
            stats = batch.stats
            stats.samples, stats.tokens = stats.samples + 1, stats.tokens + sample.length
            stats.rewards.append(sample.reward)
            for label, value in result.parts.items():
                stats.reward_parts.setdefault(label, []).append(value)
            stats.lengths.append(sample.length)
            stats.prompt_tokens.append(len(sample.prompt_ids))
            row = batch.rows[sample.prompt_id]
            self._finished_lengths.append((self._prompt_text(row), sample.length))
            self.trace.add_samples([sample], sample.iteration)
            self._join_group(batch, sample)

    def _leave_out(self, batch: _Batch, sample: Sample) -> None:
        """``sample`` is no member of its group (a fault, not the policy's doing)."""
        batch.left_out[sample.prompt_id] = batch.left_out.get(sample.prompt_id, 0) + 1
        self._complete(batch, sample.prompt_id, sample.iteration)

    def _join_group(self, batch: _Batch, sample: Sample) -> None:
        batch.partial[sample.prompt_id].append(sample)
        self._complete(batch, sample.prompt_id, sample.iteration)

    def _complete(self, batch: _Batch, prompt_id: str, iteration: int) -> None:
        """Score the prompt's group once each of its samples is in or left out: over the
        samples it has (a left-out episode is no member, not a reward of 0); too few of them
        to score, or a group ``keep_group`` drops, is refilled."""
        group, missing = batch.partial[prompt_id], batch.left_out.get(prompt_id, 0)
        if len(group) + missing < self.algorithm.group_size:
            return
        rewards = [s.reward for s in group]
        # dynamic sampling (DAPO), or too few episodes left by the environment's faults
        if len(group) < self.algorithm.min_group_size or not self.algorithm.keep_group(rewards):
            self._refill(batch, prompt_id, iteration)
            return
        batch.stats.left_out += missing
        advantages = self.algorithm.score_group(rewards)
        batch.ready.append(ScoredGroup(prompt_id, group, rewards, advantages, iteration))
