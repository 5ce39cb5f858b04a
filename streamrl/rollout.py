"""From prompts to scored groups: the trainer's side of the sample stream (StreamRL §3, §4.1).

``PromptSource`` deals prompts for each iteration (shuffled each epoch, resumable).
``RolloutStream`` sends an iteration's requests to the stream generation service and, as samples
stream back, scores each on arrival and yields a prompt's group the moment its last sample lands,
so the trainer can start on it while the rest is still being generated.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import datasets
from transformers import PreTrainedTokenizerBase

from streamrl.algorithms.base import Algorithm
from streamrl.components.generation_service import StreamGenerationService
from streamrl.records import Request, Sample


class PromptSource:
    """Deals ``batch_size`` prompt rows per call, reshuffled every epoch; resumable.

    Args:
        dataset: rows with ``prompt_id``, ``prompt`` and ``answer``.
        batch_size: prompts per iteration.
        seed: shuffling seed.
    """

    def __init__(self, dataset: datasets.Dataset, batch_size: int, seed: int = 0) -> None:
        if len(dataset) == 0:
            raise ValueError("PromptSource: the prompt set is empty; give it at least one row.")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows (wrapping into a new epoch when needed)."""
        rows = []
        while len(rows) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            rows.append(self.dataset[self._order[self.position]])
            self.position += 1
        return rows

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._shuffled(self.epoch)


@dataclass
class ScoredGroup:
    """All samples of one prompt with their rewards and advantages."""

    prompt_id: str
    samples: list[Sample]
    rewards: list[float]
    advantages: list[float]


@dataclass
class IterationStats:
    """Timings and counts of one iteration's rollout (for logs and the closing summary)."""

    samples: int = 0
    tokens: int = 0
    generate_s: float = 0.0
    wait_s: float = 0.0  # time the trainer spent blocked waiting for the next sample
    rewards: list[float] = field(default_factory=list)


class RolloutStream:
    """Streams scored groups of one iteration at a time from the service.

    Args:
        service: a started ``StreamGenerationService``.
        prompts: deals the prompts of each iteration.
        tokenizer: encodes prompts and decodes completions for the reward.
        algorithm: scores samples and groups (its ``group_size`` samples per prompt).
        max_tokens: generation budget per sample.
        context: the policy's context length; a sample's budget never runs past it.
    """

    def __init__(
        self,
        service: StreamGenerationService,
        prompts: PromptSource,
        tokenizer: PreTrainedTokenizerBase,
        algorithm: Algorithm,
        max_tokens: int,
        context: int,
    ) -> None:
        self.service, self.prompts, self.tokenizer = service, prompts, tokenizer
        self.algorithm, self.max_tokens, self.context = algorithm, max_tokens, context
        self.stats = IterationStats()

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts.batch_size * self.algorithm.group_size

    def iteration(self) -> Iterator[ScoredGroup]:
        """Generate one iteration and yield each prompt's group as soon as it is complete."""
        rows = {row["prompt_id"]: row for row in self.prompts.next_batch()}
        requests = []
        for pid, row in rows.items():
            ids = self.tokenizer(row["prompt"])["input_ids"]
            budget = min(self.max_tokens, self.context - len(ids))
            if budget < 1:
                raise ValueError(f"Prompt {pid!r} has {len(ids)} tokens: no room left in the "
                                 f"context of {self.context}; shorten it.")  # fmt: skip
            requests += [Request(pid, ids, budget, i) for i in range(self.algorithm.group_size)]
        self.stats = stats = IterationStats()
        started = time.perf_counter()
        partial: dict[str, list[tuple[Sample, float]]] = {pid: [] for pid in rows}
        stream = self.service.generate(requests)
        while True:
            waited = time.perf_counter()
            sample = next(stream, None)
            stats.wait_s += time.perf_counter() - waited
            if sample is None:
                break
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            reward = self.algorithm.score_sample(sample, text, rows[sample.prompt_id]["answer"])
            sample.reward = reward
            stats.samples, stats.tokens = stats.samples + 1, stats.tokens + sample.length
            stats.rewards.append(reward)
            group = partial[sample.prompt_id]
            group.append((sample, reward))
            if len(group) == self.algorithm.group_size:
                samples, rewards = [s for s, _ in group], [r for _, r in group]
                yield ScoredGroup(sample.prompt_id, samples, rewards,
                                  self.algorithm.score_group(rewards))  # fmt: skip
        stats.generate_s = time.perf_counter() - started
