"""Speculative decoding for the long tail, without a draft model (StreamRL §2's long tail).

Once most samples of a batch have finished, an instance decodes the few long ones left: its
forward passes are latency-bound, one token each, however cheap. Seer (2026) speeds up exactly
this phase with grouped speculative decoding: draft a few tokens from text already seen (the
prompt, the sample itself, its group's finished samples: ``drafting.SuffixDrafter``) and check
them all in one forward. ``HFStreamGenerator(speculative=SpeculativeDecoding(...))`` does so
whenever its running batch is at most ``max_running``; at larger batches decode is
compute-bound and it decodes plainly.

Verification (``verification``) is exact (Leviathan et al., 2023, for a deterministic draft):
greedy keeps a draft token while it equals the argmax, so outputs are those of plain decoding;
sampling keeps draft ``d`` with probability ``p(d)`` and, on rejection, samples from ``p`` with
``d`` removed, so every token follows the plain sampling distribution. The log-prob of each
token is the one plain decoding returns for it (same temperature, same EOS mask for forced
lengths).

Examples:
    >>> from streamrl.components.generation.hf_generator import HFStreamGenerator
    >>> from streamrl.policy.models import build_tokenizer, build_tiny_model
    >>> from streamrl.records import Request
    >>> model = build_tiny_model(build_tokenizer(), size="test")
    >>> gen = HFStreamGenerator(model, greedy=True, speculative=SpeculativeDecoding())
    >>> gen.submit([Request("p", [5, 6, 7, 5, 6], max_tokens=8, forced_length=8)])
    >>> [s.length for s in gen.stream()], gen.speculator.verify_steps > 0
    ([8], True)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from streamrl.components.generation.admission import budget
from streamrl.components.generation.drafting import SuffixDrafter, SuffixIndex
from streamrl.components.generation.verification import accept_drafts
from streamrl.errors import ConfigError
from streamrl.records import Request


@dataclass(frozen=True)
class SpeculativeDecoding:
    """Settings of speculative decoding in the tail (picklable: sent to every instance).

    Attributes:
        draft_tokens: most tokens drafted per sequence and step (K); one verify forward then
            emits up to K + 1 tokens of that sequence.
        max_ngram: longest suffix matched to find a draft.
        min_ngram: shortest suffix matched.
        max_running: speculate only while at most this many sequences run on the instance (the
            tail, where decode is latency-bound); ``None``: at any batch size.
        stored_samples: finished samples kept per instance to draft from their group's other
            samples (same prompt and iteration); 0: draft from the sequence itself only.
        min_acceptance: when fewer than this share of the drafts of the last few verify steps
            were accepted (a policy whose text repeats little: verifying would only cost), the
            instance decodes plainly for ``backoff_steps`` steps, then tries again; 0: never.
        backoff_steps: plain decode steps after a low-acceptance stretch.

    Raises:
        ConfigError: a count is out of range.
    """

    draft_tokens: int = 4
    max_ngram: int = 4
    min_ngram: int = 1
    max_running: int | None = 4
    stored_samples: int = 64
    min_acceptance: float = 0.2
    backoff_steps: int = 64

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ConfigError(
                f"SpeculativeDecoding(draft_tokens={self.draft_tokens}): draft at least 1 "
                "token (or pass speculative=None to turn speculation off)."
            )
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(
                f"SpeculativeDecoding: need 1 <= min_ngram <= max_ngram, got "
                f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}."
            )
        if self.max_running is not None and self.max_running < 1:
            raise ConfigError(
                f"SpeculativeDecoding(max_running={self.max_running}): pass a batch size >= 1, "
                "or None to speculate at any batch size."
            )
        if self.stored_samples < 0:
            raise ConfigError(
                f"SpeculativeDecoding(stored_samples={self.stored_samples}): pass >= 0 (0 keeps "
                "no finished samples)."
            )
        if not 0 <= self.min_acceptance < 1 or self.backoff_steps < 1:
            raise ConfigError(
                f"SpeculativeDecoding: need 0 <= min_acceptance < 1 and backoff_steps >= 1, got "
                f"min_acceptance={self.min_acceptance}, backoff_steps={self.backoff_steps}."
            )


class DraftedSequence(Protocol):
    """What the speculator reads of a running sequence (``HFStreamGenerator``'s rows)."""

    request: Request
    token_ids: list[int]
    draft: SuffixIndex | None  # its tokens' index, built on its first draft


class Speculator:
    """Drafts, verifies and counts for one generator (``HFStreamGenerator.speculator``).

    Args:
        settings: the settings.

    Attributes:
        proposed: draft tokens proposed so far.
        accepted: draft tokens that verification accepted (a finishing rule may still end the
            sequence before some of them).
        verify_steps: forwards that verified drafts.
        backoffs: times a low acceptance turned speculation off for ``backoff_steps`` steps.
    """

    def __init__(self, settings: SpeculativeDecoding) -> None:
        self.settings = settings
        self.drafter = SuffixDrafter(
            min_ngram=settings.min_ngram,
            max_ngram=settings.max_ngram,
            stored_samples=settings.stored_samples,
        )
        self.proposed = self.accepted = self.verify_steps = self.backoffs = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=ACCEPTANCE_WINDOW)  # (drafted, kept)
        self._plain_steps = 0  # left in a backoff

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed one (0 before any draft)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def active(self, running: int) -> bool:
        """Whether a batch of ``running`` sequences is in the tail (speculation pays)."""
        limit = self.settings.max_running
        return limit is None or running <= limit

    def drafts(self, rows: Sequence[DraftedSequence]) -> list[list[int]] | None:
        """Each row's draft (empty for a row without a match or without room for one), or
        ``None`` when none speculates this step: the batch is above ``max_running`` or no row
        found a draft (plain decoding then)."""
        if not self.active(len(rows)):
            return None
        if self._plain_steps > 0:
            self._plain_steps -= 1
            return None
        out = []
        for row in rows:
            # The verify forward emits one token past the draft: keep it inside the budget
            # (this also keeps every written cache column inside the row's reserved ones).
            room = min(self.settings.draft_tokens, budget(row.request) - len(row.token_ids) - 1)
            if room < 1:
                out.append([])
                continue
            own = _synced_index(row, self.settings)
            out.append(self.drafter.propose(own, _group(row.request), room))
        return out if any(out) else None

    def accept(
        self, logp: torch.Tensor, drafts: list[list[int]], *, greedy: bool, rng: torch.Generator
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The tokens each row emits after verification, and their log-probs
        (``accept_drafts``); updates the counters."""
        tokens, logprobs = accept_drafts(logp, drafts, greedy=greedy, rng=rng)
        drafted, kept = sum(map(len, drafts)), sum(len(run) - 1 for run in tokens)
        self.verify_steps += 1
        self.proposed, self.accepted = self.proposed + drafted, self.accepted + kept
        self._back_off_if_unaccepted(drafted, kept)
        return tokens, logprobs

    def _back_off_if_unaccepted(self, drafted: int, kept: int) -> None:
        """Decode plainly for a while once the last few verify steps accepted too little."""
        self._recent.append((drafted, kept))
        if len(self._recent) < ACCEPTANCE_WINDOW:
            return
        drafted = sum(d for d, _ in self._recent)
        if drafted and sum(k for _, k in self._recent) / drafted < self.settings.min_acceptance:
            self._plain_steps, self.backoffs = self.settings.backoff_steps, self.backoffs + 1
            self._recent.clear()

    def finished(self, row: DraftedSequence) -> None:
        """Keep a finished row's prompt and completion to draft for its group."""
        if self.settings.stored_samples == 0:
            return
        self.drafter.remember(_group(row.request), _synced_index(row, self.settings))


#: Verify steps whose acceptance decides a backoff.
ACCEPTANCE_WINDOW = 4


def _group(request: Request) -> tuple[str, int]:
    """A sample's group on this instance: the same prompt in the same iteration."""
    return (request.prompt_id, request.iteration)


def _synced_index(row: DraftedSequence, settings: SpeculativeDecoding) -> SuffixIndex:
    """The row's index, holding its prompt and every token generated so far."""
    prompt = row.request.prompt_ids
    if row.draft is None:
        row.draft = SuffixIndex(settings.min_ngram, settings.max_ngram, prompt)
    row.draft.extend(row.token_ids[len(row.draft.tokens) - len(prompt) :])
    return row.draft


@dataclass(frozen=True)
class TailSpeculation:
    """What speculative decoding does to a tail step, as the simulator models it
    (``streamrl.sim``; measured by ``streamrl bench generate --speculative``).

    Attributes:
        max_running: it is on while at most this many samples run.
        tokens_per_step: tokens a verify step yields per sample, on average (accepted drafts
            plus the one the step samples).
        verify_cost: a verify step's seconds relative to a plain decode step's.
    """

    max_running: int
    tokens_per_step: float
    verify_cost: float = 1.0


def vllm_speculative_config(settings: SpeculativeDecoding) -> dict:
    """The settings as vLLM's ``speculative_config``: its n-gram proposer (prompt lookup).

    vLLM 0.32's ``{"method": "ngram"}`` drafts up to ``num_speculative_tokens`` by matching the
    last ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens against the request's own
    prompt and output (on the CPU build too: its V1 CPU model runner verifies drafts with native
    kernels and applies ``min_tokens``, so forced lengths hold). ``max_running`` becomes its
    per-batch-size schedule, ``num_speculative_tokens_per_batch_size``: K up to ``max_running``
    requests, 0 above. What it cannot do is refused rather than dropped.

    Args:
        settings: the settings.

    Returns:
        The ``speculative_config`` engine argument.

    Raises:
        ConfigError: ``stored_samples`` is above 0 (vLLM's n-gram proposer drafts from the
            request alone, not from its group's finished samples), or ``min_acceptance`` is
            (it has no backoff on low acceptance).
    """
    if settings.min_acceptance > 0:
        raise ConfigError(
            f"VLLMEngine(speculative=...): min_acceptance={settings.min_acceptance}, but vLLM's "
            "n-gram proposer has no backoff on low acceptance; pass "
            "SpeculativeDecoding(min_acceptance=0, ...) to speculate in every tail step."
        )
    if settings.stored_samples > 0:
        raise ConfigError(
            f"VLLMEngine(speculative=...): stored_samples={settings.stored_samples}, but vLLM's "
            "n-gram proposer drafts from the request's own prompt and output only, not from "
            "its group's finished samples; pass SpeculativeDecoding(stored_samples=0, ...), or "
            "use HFEngine(speculative=...) (rl.engine: hf) for group drafts."
        )
    config: dict = {
        "method": "ngram",
        "num_speculative_tokens": settings.draft_tokens,
        "prompt_lookup_max": settings.max_ngram,
        "prompt_lookup_min": settings.min_ngram,
    }
    if settings.max_running is not None:
        # Inclusive batch-size ranges; vLLM carries the last K on to every larger batch.
        limit = settings.max_running
        config["num_speculative_tokens_per_batch_size"] = [
            [1, limit, settings.draft_tokens],
            [limit + 1, limit + 1, 0],
        ]
    return config
