"""Drafts without a draft model: suffix matching over the sequence and its group's samples.

Speculative decoding needs a cheap guess of the next few tokens. In RL rollouts the guess is
often already written down: an answer quotes its prompt, repeats its own phrasing, or says what
the other samples of its group (same prompt, same iteration) said. Seer's grouped speculative
decoding (2026) drafts from the group's responses; suffix decoding and prompt lookup draft from
the request's own tokens. ``SuffixDrafter`` does both, training-free: it finds the longest
recent suffix of the sequence (prompt plus tokens so far) that occurred earlier in the sequence
itself or in a finished sample of its group, and proposes the tokens that followed it there.

Examples:
    >>> drafter = SuffixDrafter(min_ngram=1, max_ngram=3, stored_samples=8)
    >>> own = SuffixIndex(1, 3, [7, 1, 2, 3, 4, 9, 1, 2])  # "1 2" occurred before, then "3 4"
    >>> drafter.propose(own, group=("p", 0), limit=2)
    [3, 4]
    >>> drafter.remember(("p", 0), [5, 6, 8, 8, 0])  # a finished sibling
    >>> drafter.propose(SuffixIndex(1, 3, [5, 6]), group=("p", 0), limit=4)
    [8, 8, 0]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable


class SuffixIndex:
    """Where each n-gram of one token sequence last occurred, to draft what follows it.

    Tokens are appended with ``extend``; the n-grams (``min_ngram`` to ``max_ngram`` tokens) are
    indexed lazily on the next lookup, so a sequence that never drafts costs only its list.

    Args:
        min_ngram: shortest n-gram indexed.
        max_ngram: longest n-gram indexed.
        tokens: the sequence's tokens so far.
    """

    def __init__(self, min_ngram: int, max_ngram: int, tokens: Iterable[int] = ()) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = list(tokens)
        # n-gram -> the position right after its latest occurrence that has a token after it.
        self._follower: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the sequence."""
        self.tokens.extend(tokens)

    def continuation(
        self, ngram: tuple[int, ...], limit: int, *, periodic: bool = False
    ) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of ``ngram``
        (empty if it never occurred with a token after it).

        Args:
            ngram: the tokens to find.
            limit: most tokens returned.
            periodic: the sequence is the one being continued: a match that runs into its end
                goes on with its own continuation (as an LZ77 copy does), so a repeating
                pattern drafts ``limit`` tokens of its period rather than stopping at the end.
        """
        self._catch_up()
        start = self._follower.get(ngram)
        if start is None:
            return []
        out = self.tokens[start : start + limit]
        if periodic:
            end = len(self.tokens)
            while len(out) < limit:
                out.append(out[start + len(out) - end])
        return out

    def _catch_up(self) -> None:
        tokens = self.tokens
        # An n-gram ending at `end` is indexed once token `end + 1` exists, so the sequence's
        # own newest suffix is never found as its own earlier occurrence. Later occurrences
        # overwrite earlier ones: the most recent wins.
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._follower[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, len(tokens) - 1)


class SuffixDrafter:
    """Proposes a sequence's next tokens from its own tokens and its group's finished samples.

    The longest suffix wins: n-grams are tried from ``max_ngram`` down to ``min_ngram``; at one
    length the sequence itself is searched first (its prompt and what it generated), then its
    group's samples, newest first. The store of finished samples is bounded: past
    ``stored_samples`` the oldest sample is forgotten.

    Args:
        min_ngram: shortest suffix matched.
        max_ngram: longest suffix matched.
        stored_samples: finished samples kept (prompt plus completion each), all groups
            together; 0 keeps none (drafts from the sequence itself only).
    """

    def __init__(self, *, min_ngram: int, max_ngram: int, stored_samples: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.stored_samples = stored_samples
        self._groups: dict[Hashable, list[SuffixIndex]] = {}
        self._order: deque[Hashable] = deque()  # the group of each stored sample, oldest first

    def propose(self, own: SuffixIndex, group: Hashable, limit: int) -> list[int]:
        """Up to ``limit`` tokens likely to follow ``own`` (empty when no suffix matched).

        Args:
            own: the index of the sequence being decoded (prompt plus tokens so far).
            group: its group's key, e.g. ``(prompt_id, iteration)``.
            limit: most tokens to propose.
        """
        siblings = self._groups.get(group, [])
        tokens = own.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            suffix = tuple(tokens[-n:])
            draft = own.continuation(suffix, limit, periodic=True)
            for index in reversed(siblings):
                if draft:
                    break
                draft = index.continuation(suffix, limit)
            if draft:
                return draft
        return []

    def remember(self, group: Hashable, tokens: list[int] | SuffixIndex) -> None:
        """Keep a finished sample of ``group`` (its prompt and completion, or their index)."""
        if self.stored_samples == 0:
            return
        if not isinstance(tokens, SuffixIndex):
            tokens = SuffixIndex(self.min_ngram, self.max_ngram, tokens)
        self._groups.setdefault(group, []).append(tokens)
        self._order.append(group)
        while len(self._order) > self.stored_samples:
            oldest = self._order.popleft()
            kept = self._groups[oldest]
            kept.pop(0)
            if not kept:
                del self._groups[oldest]

    def __len__(self) -> int:
        """Finished samples stored."""
        return len(self._order)
