"""A sequence in one of ``HFStreamGenerator``'s batch slots (StreamRL §5, continuous batching).

A request becomes a ``SlotSequence`` when it is admitted into a slot, in one of three ways:
fresh (its prompt is prefilled), resumed from a kept prefix (an episode's previous turn left
its KV cache in the ``PrefixStash``: only the prompt past ``offset`` is prefilled), or moved here
from another instance with its ``Request.progress`` (``moving.leaving``): it keeps its tokens,
log-probs, versions and first admission, and its prompt and tokens are prefilled here. The
sequence's tokens fill its cache row's columns ``[0, length)``; ``next_input`` is the token the
next forward feeds. ``FinishingRules`` say when it ends: checked after every token it
generates, also inside a run of accepted speculative draft tokens, so a sequence ends at the
same token as under plain decoding and nothing past that token is kept (StreamRL §3 emits a
sample the moment it finishes).

Examples:
    >>> from streamrl.records import Request
    >>> seq = admitted_sequence(Request("p", [5, 6, 7], max_tokens=4), 0.0, 1.0, 0)
    >>> seq.length, seq.next_input, seq.columns()
    (2, 7, [5, 6])
    >>> seq.append(9, -0.5, 0)
    >>> seq.length, seq.next_input, seq.columns()
    (3, 9, [5, 6, 7])
    >>> rules = FinishingRules(eos_token_id=[1])
    >>> rules.reason(Request("p", [5], max_tokens=3), [4, 1])
    'eos'
    >>> rules.reason(Request("p", [5], max_tokens=3, forced_length=3), [4, 1])
    >>> rules.reason(Request("p", [5], max_tokens=3), [4, 4, 4])
    'length'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from streamrl.components.generation.drafting import SuffixIndex
from streamrl.records import Request


@dataclass
class SlotSequence:
    """A sequence occupying a batch slot (a ``finished.GeneratedSequence`` once it ends)."""

    request: Request
    submitted_s: float
    started_s: float
    weight_version: int
    length: int  # cache columns filled, i.e. the position of ``next_input``
    next_input: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per generated token, its weights
    offset: int = 0  # prompt columns whose KV was kept from the episode's previous turn
    recomputed: int = 0  # cache columns computed again under newer weights (partial rollout)
    draft: SuffixIndex | None = None  # its tokens' n-grams, once speculative decoding drafts

    def columns(self) -> list[int]:
        """The tokens in its cache columns ``[0, length)``: its prompt, then what it generated
        before its next input."""
        return (self.request.prompt_ids + self.token_ids)[: self.length]

    def append(self, token: int, logprob: float, version: int) -> None:
        """Record one generated token, drawn by weights ``version``: it becomes the next input,
        and the previous next input now fills a cache column."""
        self.length += 1
        self.next_input = token
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)


def admitted_sequence(
    request: Request, submitted_s: float, now_s: float, weight_version: int, offset: int = 0
) -> SlotSequence:
    """The sequence of ``request``, admitted into a slot at ``now_s``.

    The last known token (the prompt's, or the last one it generated before it moved here) is
    its next input, fed by the shared decode forward. A moved request (``request.progress``)
    keeps its tokens, log-probs, versions and first admission; its tokens are prefilled here,
    counted in ``recomputed``.

    Args:
        request: the admitted request.
        submitted_s: when it was submitted (``time.time()``).
        now_s: when it is admitted.
        weight_version: the version of the weights loaded now.
        offset: prompt tokens whose KV cache was kept from the episode's previous turn.

    Returns:
        The sequence, its cache columns still to be prefilled.
    """
    prompt, done = request.prompt_ids, request.progress
    if done is None or not done.token_ids:
        last = len(prompt) - 1
        return SlotSequence(
            request, submitted_s, now_s, weight_version, last, prompt[-1], offset=offset
        )
    return SlotSequence(
        request,
        submitted_s,
        done.started_s,
        done.weight_version,
        len(prompt) + len(done.token_ids) - 1,
        done.token_ids[-1],
        token_ids=list(done.token_ids),
        logprobs=list(done.logprobs),
        versions=list(done.versions),
        offset=offset,
        recomputed=len(done.token_ids),
    )


class FinishingRules:
    """The finishing rules of one generator, in their order of precedence.

    A ``forced_length`` request ends at exactly that many tokens (``"forced"``, EOS ignored);
    any other ends on an EOS id (``"eos"``), on a stop string in the text of its last tokens
    (``"stop"``), or at ``max_tokens`` (``"length"``).

    Args:
        eos_token_id: stop token(s); ``None``: none.
        stop_strings: a sequence also stops once the text of its last few tokens contains one
            of these (empty ones are dropped); its tokens are kept whole, so it may end with
            text past the stop string.
        tokenizer: decodes those tokens; needed with ``stop_strings`` only.

    Raises:
        ValueError: ``stop_strings`` without a ``tokenizer``.
    """

    def __init__(
        self,
        eos_token_id: int | list[int] | None = None,
        stop_strings: Sequence[str] = (),
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.eos_ids: list[int] = (
            [] if eos_token_id is None else [int(e) for e in np.atleast_1d(eos_token_id)]
        )
        self.stop_strings = tuple(s for s in stop_strings if s)
        if self.stop_strings and tokenizer is None:
            raise ValueError("HFStreamGenerator: stop_strings need the tokenizer= to decode with.")
        self.tokenizer = tokenizer
        # Tokens decoded per check: each holds at least one byte of text, plus two for a
        # character split across tokens or a space the decoder drops at the start.
        self.stop_window = max((len(s.encode()) for s in self.stop_strings), default=0) + 2

    def reason(self, request: Request, token_ids: list[int]) -> str | None:
        """Why the sequence of ``request`` ends now that its newest token is ``token_ids[-1]``.

        Args:
            request: the sequence's request.
            token_ids: every token it generated so far, the newest last.

        Returns:
            ``"forced"``, ``"eos"``, ``"stop"`` or ``"length"``; ``None`` while it goes on.
        """
        if request.forced_length is not None:
            return "forced" if len(token_ids) >= request.forced_length else None
        if token_ids[-1] in self.eos_ids:
            return "eos"
        if self.stop_strings and self._has_stop_string(token_ids):
            return "stop"
        return "length" if len(token_ids) >= request.max_tokens else None

    def _has_stop_string(self, token_ids: list[int]) -> bool:
        """Whether the text of the last few tokens holds a stop string (checked every token,
        so one that ends with the newest token is found at once)."""
        tail = self.tokenizer.decode(token_ids[-self.stop_window :])
        return any(s in tail for s in self.stop_strings)
