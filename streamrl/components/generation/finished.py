"""A finished sequence, as the ``Sample`` a stream generator emits (StreamRL §3).

Both built-in generators keep, per running sequence, its request, timestamps, admission weight
version and what it generated so far (``GeneratedSequence``); ``finished_sample`` turns one into
the record the trainer takes, the moment it finishes.
"""

from __future__ import annotations

from typing import Any, Protocol

from streamrl.records import Request, Sample


class GeneratedSequence(Protocol):
    """What a generator knows of a sequence it ran."""

    request: Request
    submitted_s: float  # when its request was submitted
    started_s: float  # when it was admitted into a batch slot
    weight_version: int  # the weights loaded at admission
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # per generated token, the weights that drew it
    recomputed: int  # tokens prefilled again under newer weights (partial rollout)


def finished_sample(
    seq: GeneratedSequence,
    *,
    instance_id: int,
    finished_s: float,
    finish_reason: str,
    cached_tokens: int = 0,
    routed_experts: Any = None,
) -> Sample:
    """The ``Sample`` of ``seq``, finished at ``finished_s`` for ``finish_reason``.

    Args:
        seq: the sequence, with all its generated tokens.
        instance_id: the generator instance that ran it.
        finished_s: wall-clock time (``time.time()``) it finished.
        finish_reason: ``"eos"``, ``"stop"``, ``"length"`` or ``"forced"``.
        cached_tokens: prompt tokens whose KV cache was kept from the episode's previous turn
            (not prefilled here).
        routed_experts: a mixture of experts' choices (``RoutedExperts.finish``).
    """
    req = seq.request
    return Sample(
        prompt_id=req.prompt_id,
        sample_index=req.sample_index,
        iteration=req.iteration,
        instance_id=instance_id,
        weight_version=seq.weight_version,
        prompt_ids=list(req.prompt_ids),
        token_ids=seq.token_ids,
        logprobs=seq.logprobs,
        token_versions=seq.versions,
        submitted_s=seq.submitted_s,
        started_s=seq.started_s,
        finished_s=finished_s,
        finish_reason=finish_reason,
        prefill_tokens=len(req.prompt_ids) - cached_tokens + seq.recomputed,
        cached_tokens=cached_tokens,
        routed_experts=routed_experts,
    )
