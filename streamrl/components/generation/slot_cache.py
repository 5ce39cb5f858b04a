"""The HF generator's KV cache, one row per batch slot, and the model's forwards over it
(StreamRL §5, continuous batching).

- ``SlotCache``: every running sequence owns one row of a preallocated buffer shared by all
  layers; rows are written in place, dropped by moving other rows over them, and the buffer
  only grows (doubling) up to the context length. ``HFStreamGenerator`` drives it through
  ``prepare`` and ``move_rows``; ``save_row`` / ``load_row`` copy one sequence's columns out and
  back in.
- ``SlotForwards``: continuous batching runs rows of different lengths in one forward: each
  row's tokens sit left-aligned in its cache row, a per-row attention mask hides the columns it
  does not use, and explicit position ids give each row its own positions. It builds those
  inputs for the four forwards ``HFStreamGenerator`` runs: a batched prefill from column 0, a
  prefill after an episode's kept prefix, a decode of one token per row, and the verification
  of speculative drafts (``verification.verify_batch``). Which rows run, and what they hold, is
  the generator's.
- ``PrefixStash``: the cache of an episode's last turn, kept on its instance for the next turn.
  A multi-turn episode (``streamrl.envs``) sends its next turn as a request whose prompt is the
  whole conversation so far: the previous turn's prompt and completion, then the environment's
  observation. Its instance kept the previous turn's rows (``Request.keep_prefix``), so only the
  observation's tokens need a prefill; the rest is copied back into a batch slot. This is what
  vLLM's prefix caching does for a server; here it is explicit, one entry per episode, and
  dropped whenever new weights load (a prefix computed by older weights would not be the
  policy's).

Examples:
    >>> from streamrl.policy.models import build_tokenizer, build_tiny_model
    >>> model = build_tiny_model(build_tokenizer(), size="test").eval()
    >>> cache = SlotCache(model.config.num_hidden_layers, slots=2)
    >>> cache.reserve(8, limit=8)
    >>> forwards = SlotForwards(model, cache, pad_token_id=0)
    >>> with torch.inference_mode():
    ...     forwards.prefill(0, [[5, 6], [5, 6, 7]])
    ...     forwards.decode([2, 3], [7, 8]).shape == (2, model.config.vocab_size)
    True
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
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from streamrl.components.generation.verification import verify_batch


class SlotCache(Cache):
    """KV cache with one row per batch slot, written in place.

    All layers share one tensor ``[layers, 2 (key/value), slots, kv_heads, capacity, head_dim]``,
    so dropping rows and growing the capacity are single tensor ops, not loops over layers.
    ``prepare`` is called before each forward to say which rows run and where they write.
    """

    def __init__(self, num_layers: int, slots: int) -> None:
        super().__init__(layers=[])  # we override update(); HF's per-layer objects are unused
        self.num_layers, self.slots = num_layers, slots
        self.kv: torch.Tensor | None = None
        self.capacity = 0
        self.rows, self.kv_len = slice(0, 0), 0
        self.write_pos: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, rows: slice, kv_len: int, write_pos: torch.Tensor | None = None) -> None:
        """Next forward runs ``rows`` and attends to ``kv_len`` columns. It writes row ``i``'s
        input at columns ``write_pos[i]``: one column per row (``[batch]``, decode), one per input
        token (``[batch, tokens]``, a prefill after a kept prefix) or, if ``None``, the whole
        input from column 0."""
        self.rows, self.kv_len, self.write_pos = rows, kv_len, None
        if write_pos is not None:
            # Built once per forward and reused by every layer's update().
            row_idx = torch.arange(rows.start, rows.stop, device=write_pos.device)
            self.write_pos = (row_idx, write_pos)

    def update(
        self, new_k: torch.Tensor, new_v: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys/values in place; return the rows' visible columns."""
        self._ensure_capacity(new_k)
        keys, values = self.kv[layer_idx, 0], self.kv[layer_idx, 1]
        if self.write_pos is None:
            keys[self.rows, :, : new_k.shape[2]] = new_k
            values[self.rows, :, : new_v.shape[2]] = new_v
        elif self.write_pos[1].dim() == 1:
            row_idx, cols = self.write_pos  # each row's new token lands at that row's own length
            keys[row_idx, :, cols] = new_k[:, :, 0]
            values[row_idx, :, cols] = new_v[:, :, 0]
        else:  # [batch, tokens] columns: indexing gives [batch, tokens, heads, dim]
            row_idx, cols = self.write_pos
            keys[row_idx[:, None], :, cols] = new_k.transpose(1, 2)
            values[row_idx[:, None], :, cols] = new_v.transpose(1, 2)
        return keys[self.rows, :, : self.kv_len], values[self.rows, :, : self.kv_len]

    def _ensure_capacity(self, like: torch.Tensor) -> None:
        if self.kv is not None and self.kv.shape[-2] >= self.capacity:
            return
        # Shaped from real key states so heads, head_dim, dtype and device always match.
        _, heads, _, head_dim = like.shape
        shape = (self.num_layers, 2, self.slots, heads, self.capacity, head_dim)
        grown = like.new_zeros(shape)
        if self.kv is not None:
            grown[..., : self.kv.shape[-2], :] = self.kv
        self.kv = grown

    def reserve(self, columns: int, limit: int) -> None:
        """Make room for ``columns`` columns per row, but no more than ``limit`` (the buffer
        grows on the next write)."""
        if columns > self.capacity:
            # Doubling keeps growth copies amortised O(1) per token.
            self.capacity = min(max(columns, 2 * self.capacity), limit)

    def move_rows(self, src: list[int], dst: list[int], columns: int) -> None:
        """Copy rows ``src`` onto rows ``dst`` (first ``columns`` columns only)."""
        if self.kv is not None and src:
            self.kv[:, :, dst, :, :columns] = self.kv[:, :, src, :, :columns]

    def save_row(self, row: int, columns: int) -> torch.Tensor:
        """A copy of row ``row``'s first ``columns`` columns, every layer's keys and values."""
        return self.kv[:, :, row, :, :columns].clone()

    def load_row(self, row: int, saved: torch.Tensor) -> None:
        """Write ``saved`` (from ``save_row``) into row ``row``'s first columns."""
        if self.kv is None or self.kv.shape[-2] < self.capacity:
            self._ensure_capacity(saved[0, 0][None])  # [1, heads, columns, head_dim]
        self.kv[:, :, row, :, : saved.shape[-2]] = saved

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


class SlotForwards:
    """Runs ``model`` on rows of ``cache``, writing each row's new keys and values in place.

    Args:
        model: a causal LM in eval mode, with SDPA or eager attention (it is given 4D masks).
        cache: the cache the forwards read and write; its capacity is the caller's to grow.
        pad_token_id: filler id of padded input positions (their outputs are never read).
    """

    def __init__(self, model: PreTrainedModel, cache: SlotCache, pad_token_id: int) -> None:
        self.model, self.cache, self.pad_token_id = model, cache, pad_token_id

    def prefill(self, start: int, columns: list[list[int]]) -> None:
        """One batched forward that writes rows ``start, start + 1, ...`` of the cache from
        column 0 with ``columns`` (each row's tokens before its next input)."""
        width = max(map(len, columns), default=0)
        if width == 0:
            return
        dev = self.model.device
        ids = torch.full((len(columns), width), self.pad_token_id, dtype=torch.long)
        for i, tokens in enumerate(columns):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        lengths = torch.tensor([len(t) for t in columns], device=dev)
        cols = torch.arange(width, device=dev)
        # Right-padded: a query sees earlier columns that hold prompt tokens. Padding queries also
        # see themselves so no row is fully masked (NaN in half precision); they are never read.
        causal = cols[None, :] <= cols[:, None]
        allowed = causal & (
            (cols < lengths[:, None])[:, None] | torch.eye(width, dtype=torch.bool, device=dev)
        )
        self.cache.prepare(slice(start, start + len(columns)), width)
        self._forward(ids.to(dev), cols.expand(len(columns), width), allowed)

    def prefill_after(self, row: int, tokens: list[int], offset: int) -> None:
        """Prefill ``tokens`` into row ``row`` at columns ``offset, offset + 1, ...``, after the
        columns ``[0, offset)`` it holds already (alone: its new tokens start at its own
        column)."""
        if not tokens:
            return
        dev = self.model.device
        end = offset + len(tokens)
        pos = torch.arange(offset, end, device=dev)[None]  # [1, new]
        allowed = torch.arange(end, device=dev)[None, None, :] <= pos[:, :, None]
        self.cache.prepare(slice(row, row + 1), end, write_pos=pos)
        self._forward(torch.tensor([tokens], device=dev), pos, allowed)

    def decode(self, lengths: list[int], next_inputs: list[int]) -> torch.Tensor:
        """One forward of each row's next input at its column ``lengths[i]`` (rows ``0, 1,
        ...``); the logits of each, ``[batch, vocab]``."""
        dev = self.model.device
        at = torch.tensor(lengths, device=dev)
        ids = torch.tensor([[t] for t in next_inputs], device=dev)
        kv_len = max(lengths) + 1
        allowed = (torch.arange(kv_len, device=dev)[None, :] <= at[:, None])[:, None]
        self.cache.prepare(slice(0, len(lengths)), kv_len, write_pos=at)
        return self._forward(ids, at[:, None], allowed)[:, -1]

    def verify(
        self, lengths: list[int], next_inputs: list[int], drafts: list[list[int]]
    ) -> torch.Tensor:
        """One forward over every row's next input and draft (``verify_batch``); the logits of
        every position, ``[batch, 1 + longest draft, vocab]``."""
        ids, positions, columns, allowed = verify_batch(
            lengths, next_inputs, drafts, pad_token_id=self.pad_token_id, device=self.model.device
        )
        self.cache.prepare(slice(0, len(lengths)), allowed.shape[-1], write_pos=columns)
        return self._forward(ids, positions, allowed, keep=0)

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, keep: int = 1
    ) -> torch.Tensor:
        """One model call on the prepared cache rows; ``allowed``: ``[batch, q, kv]`` bools;
        logits of the last ``keep`` positions (0: all)."""
        dtype = self.model.dtype
        # Additive float mask, as HF builds them: accepted by both SDPA and eager attention.
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        # The kept positions as indices, not a count: the head then reads a contiguous copy of
        # them. A strided slice of a [batch, seq, hidden] bfloat16 tensor sends the CPU's linear
        # to a batched matmul over the weight expanded per row (at a 151,936-token vocabulary
        # and hidden 1,536: a 1.9 GB copy and 11 s per prefill, against 0.05 s).
        width = ids.shape[1]
        kept = torch.arange(width - keep, width, device=ids.device) if 0 < keep < width else keep
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=kept,
        )
        if self.cache.kv is None:
            raise RuntimeError("The model ignored the KV cache (HFStreamGenerator needs HF >= 5).")
        return out.logits


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
