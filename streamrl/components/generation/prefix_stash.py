"""The KV cache of an episode's last turn, kept on its instance for the next turn.

A multi-turn episode (``streamrl.envs``) sends its next turn as a request whose prompt is the whole
conversation so far: the previous turn's prompt and completion, then the environment's
observation. Its instance kept the previous turn's KV cache (``Request.keep_prefix``), so only the
observation's tokens need a prefill; the rest is copied back into a batch slot. This is what
vLLM's prefix caching does for a server; here it is explicit, one entry per episode, and dropped
whenever new weights load (a prefix computed by older weights would not be the policy's).

Examples:
    >>> import torch
    >>> stash = PrefixStash(max_entries=2)
    >>> stash.put(("p", 0, 0), [5, 6, 7], torch.zeros(1), weight_version=0)
    >>> stash.take(("p", 0, 0), [5, 6, 7, 8, 9], weight_version=0).token_ids
    [5, 6, 7]
    >>> stash.take(("p", 0, 0), [5, 6, 7, 8], weight_version=0) is None  # taken once
    True
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass
class KeptPrefix:
    """The KV cache of ``token_ids`` (every layer's keys and values, ``SlotCache.save_row``)."""

    token_ids: list[int]
    kv: torch.Tensor
    weight_version: int


class PrefixStash:
    """Finished sequences' KV caches by request key, least recently kept evicted first.

    Args:
        max_entries: how many to keep (an episode whose next turn moved to another instance, or
            that ended, leaves its entry to be evicted).

    Attributes:
        hits / misses: ``take`` calls that found a usable prefix, and those that found one they
            could not use (another weight version, or a prompt that does not extend it).
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"PrefixStash: max_entries must be >= 1, got {max_entries}.")
        self.max_entries = max_entries
        self._kept: OrderedDict[Hashable, KeptPrefix] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._kept

    def put(
        self, key: Hashable, token_ids: list[int], kv: torch.Tensor, weight_version: int
    ) -> None:
        """Keep ``kv``, the cache of ``token_ids``, under ``key`` (replacing an older one)."""
        self._kept.pop(key, None)
        self._kept[key] = KeptPrefix(list(token_ids), kv, weight_version)
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)

    def take(self, key: Hashable, prompt_ids: list[int], weight_version: int) -> KeptPrefix | None:
        """Remove and return ``key``'s prefix if ``prompt_ids`` extends it (at least one new
        token) and it was computed by ``weight_version``; ``None`` otherwise."""
        kept = self._kept.pop(key, None)
        usable = (
            kept is not None
            and kept.weight_version == weight_version
            and len(kept.token_ids) < len(prompt_ids)
            and prompt_ids[: len(kept.token_ids)] == kept.token_ids
        )
        if usable:
            self.hits += 1
            return kept
        self.misses += kept is not None
        return None

    def clear(self) -> None:
        """Drop every entry (new weights: the kept caches are not the policy's any more)."""
        self._kept.clear()
