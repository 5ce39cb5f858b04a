"""A KV cache with one row per batch slot, for continuous batching (StreamRL §5).

Every running sequence owns one row of a preallocated buffer shared by all layers; rows are
written in place, dropped by moving other rows over them, and the buffer only grows (doubling)
up to the context length. ``HFStreamGenerator`` drives it through ``prepare`` and ``move_rows``;
``save_row`` / ``load_row`` copy one sequence's columns out and back in (an episode's prefix kept
between two turns, ``PrefixStash``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


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
