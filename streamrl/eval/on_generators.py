"""Held-out evaluation on the run's own generator instances, not on a copy of the policy.

A run evaluates (before RL, every ``rl.eval.every`` iterations, after RL) with the very engine,
chat rendering, stop rules and reward it trains with, on the instances that hold the version
being evaluated: no process keeps a second copy of the policy for it, and the GPUs that generate
for training decode the held-out prompts too (a CPU copy of a 7B policy took 5-15 minutes per
evaluation with every GPU idle).

- ``ServiceDecoder`` decodes token-id prompts on a running ``StreamGenerationService``
  (``streamrl.eval.heldout.evaluate`` takes it in a model's place);
- ``EvaluationView`` is the service as an evaluation sees it (``streamrl.eval.episodes``'
  episodes run on it): its requests are dealt to the least busy instances without the run's
  dispatcher and come back only to it, so training samples arriving meanwhile (async mode
  generates ahead) wait for the training stream untouched.

Which weights an evaluation sees: its requests carry ``min_weight_version``, so an instance
admits them only once it holds that version (the one the trainer just pushed); the trainer waits
for the evaluation, so no newer version arrives meanwhile. ``versions_seen`` records the
versions that decoded them.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrl.components.generation.service import StreamGenerationService
from streamrl.protocols import Dispatcher
from streamrl.records import Request, Sample

#: The iteration an evaluation's requests carry: no training iteration has it.
EVAL_ITERATION = -1


class EvaluationView:
    """What an evaluation sees of a running service: ``submit``, ``poll_sample``,
    ``next_sample`` and ``open_requests`` over its own requests only (what ``EpisodeRunner``
    and ``ServiceDecoder`` use).

    Args:
        service: the run's started service.
    """

    def __init__(self, service: StreamGenerationService) -> None:
        self.service = service
        self.sample_timeout_s = service.timeouts.sample_s
        self.versions_seen: set[int] = set()
        self._open: set[tuple] = set()

    @property
    def dispatcher(self) -> Dispatcher:
        return self.service.dispatcher

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def instances(self) -> list:
        return self.service.instances()

    def submit(self, requests: Sequence[Request], scores: Sequence[float] | None = None) -> None:
        self.service.submit(requests, scores, evaluation=True)
        self._open.update(r.key for r in requests)

    def poll_sample(self, timeout_s: float) -> Sample | None:
        sample = self.service.poll_sample(timeout_s, keys=self._open)
        return self._taken(sample) if sample is not None else None

    def next_sample(self) -> Sample:
        return self._taken(self.service.next_sample(keys=self._open))

    def _taken(self, sample: Sample) -> Sample:
        self._open.discard(sample.key)
        self.versions_seen.update(sample.token_versions or [sample.weight_version])
        return sample


class ServiceDecoder:
    """Decodes token-id prompts on a running service's instances, for
    ``streamrl.eval.heldout.evaluate`` (a ``Decoder``).

    Args:
        service: the run's started ``StreamGenerationService``.
        context: the policy's context length; a prompt's budget is cut to what is left of it.
        min_weight_version: the version the instances must hold before they decode (the one
            being evaluated).

    Examples:
        >>> # result = evaluate(ServiceDecoder(service, context=1024, min_weight_version=3),
        >>> #                   tokenizer, heldout, max_new_tokens=512, score=score)
    """

    def __init__(
        self, service: StreamGenerationService, context: int, *, min_weight_version: int = 0
    ) -> None:
        self.view = EvaluationView(service)
        self.context, self.min_weight_version = context, min_weight_version
        self._calls = 0

    @property
    def versions_seen(self) -> set[int]:
        """The weight versions that decoded the tokens so far."""
        return self.view.versions_seen

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, *, greedy: bool, seed: int = 0
    ) -> list[list[int]]:
        """Each prompt's completion (its ids, the stop token left out), in order: greedy, or
        sampled at the instances' temperature (their own random streams: ``seed`` is not used).
        """
        del seed
        self._calls += 1
        requests = [
            Request(
                f"eval:{self._calls}:{i}",
                list(prompt),
                max(1, min(max_new_tokens, self.context - len(prompt))),
                iteration=EVAL_ITERATION,
                min_weight_version=self.min_weight_version,
                greedy=greedy,
            )
            for i, prompt in enumerate(prompts)
        ]
        self.view.submit(requests)
        done = {s.prompt_id: s for s in (self.view.next_sample() for _ in requests)}
        return [_completion(done[r.prompt_id]) for r in requests]


def _completion(sample: Sample) -> list[int]:
    """A sample's tokens without the stop token it ended on."""
    if sample.finish_reason == "eos" and sample.token_ids:
        return list(sample.token_ids[:-1])
    return list(sample.token_ids)
