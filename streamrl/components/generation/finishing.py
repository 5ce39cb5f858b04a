"""When a sequence in ``HFStreamGenerator`` ends, checked after every token it generates.

StreamRL §3 emits a sample the moment it finishes; these are the rules that say it has. They
run token by token, also inside a run of accepted speculative draft tokens, so a sequence ends
at the same token as under plain decoding and nothing past that token is kept.

Examples:
    >>> from streamrl.records import Request
    >>> rules = FinishingRules(eos_token_id=[1])
    >>> rules.reason(Request("p", [5], max_tokens=3), [4, 1])
    'eos'
    >>> rules.reason(Request("p", [5], max_tokens=3, forced_length=3), [4, 1])
    >>> rules.reason(Request("p", [5], max_tokens=3), [4, 4, 4])
    'length'
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

from streamrl.records import Request


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
