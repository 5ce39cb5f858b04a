"""Requests that move between generator instances mid-flight (beyond StreamRL §5.3).

The paper plans once, then lets the plan run. A planner that learns while the iteration runs
(``streamrl.components.skewness.adaptive``) may move a queued request, or a running one, to an
instance that has room. A running request leaves with what it generated so far
(``records.Progress``: its tokens, their log-probs and weight versions); the instance that takes
it prefills the prompt and those tokens, as partial rollout's recompute does, and goes on, so
the finished sample is what an unmoved run gives (greedy: the same tokens) and keeps each token's
version.
"""

from __future__ import annotations

from dataclasses import replace

from streamrl.components.generation.finished import GeneratedSequence
from streamrl.records import Progress, Request


def leaving(seq: GeneratedSequence) -> Request:
    """The request of a running sequence that leaves its instance, carrying its progress.

    A sequence that has generated nothing yet leaves as its plain request (it starts afresh).
    """
    before = seq.request.progress
    if not seq.token_ids:
        return replace(seq.request, progress=None) if before is None else seq.request
    progress = Progress(
        token_ids=list(seq.token_ids),
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        weight_version=seq.weight_version,
        started_s=seq.started_s,
        moves=(before.moves if before is not None else 0) + 1,
    )
    return replace(seq.request, progress=progress)


def generated_before(request: Request) -> int:
    """Tokens the request generated on earlier instances."""
    return len(request.progress.token_ids) if request.progress is not None else 0
