"""The draft's key/value cache, and the sliding-window mask that reads the positions it keeps.
"""

from __future__ import annotations

import torch


class Eagle3KVCache:
    """The draft's key/value cache: preallocated buffers with a length that can be cropped.

    ``update`` appends new keys/values and returns everything cached so far; ``crop`` forgets the tail (drafted
    positions that were rejected), without copying. For a sliding-window draft it also keeps the position of each
    cached key (the window is measured in positions, as vLLM does, also for tree nodes).
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.length = 0

    def get_seq_length(self) -> int:
        """Number of cached positions."""
        return self.length

    def crop(self, length: int) -> None:
        """
        Keep only the first ``length`` positions (a longer ``length`` changes nothing).

        Args:
            length (`int`): positions to keep.
        """
        self.length = max(0, min(self.length, length))

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None):
        """
        Append new keys and values and return all cached ones.

        Args:
            k (`torch.Tensor` [B, kv_heads, n, D]): keys of the new positions.
            v (`torch.Tensor` [B, kv_heads, n, D]): their values.
            positions (`torch.LongTensor` [n], *optional*): their positions, kept when given (sliding windows).

        Returns:
            `(keys, values)`, each [B, kv_heads, cached + n, D] (views of the buffers).
        """
        n = k.shape[2]
        need = self.length + n
        if self.keys is None or need > self.keys.shape[2] or self.keys.shape[0] != k.shape[0]:
            cap = max(256, 2 * need)
            keys = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            values = v.new_empty(keys.shape)
            pos = torch.zeros(cap, dtype=torch.long, device=k.device)
            if self.keys is not None and self.length:
                keys[:, :, : self.length] = self.keys[:, :, : self.length]
                values[:, :, : self.length] = self.values[:, :, : self.length]
                pos[: self.length] = self.positions[: self.length]
            self.keys, self.values, self.positions = keys, values, pos
        self.keys[:, :, self.length : need] = k
        self.values[:, :, self.length : need] = v
        if positions is not None:
            self.positions[self.length : need] = positions
        self.length = need
        return self.keys[:, :, :need], self.values[:, :, :need]

    def key_positions(self) -> torch.Tensor:
        """Positions of the cached keys [length] (meaningful when every ``update`` gave them)."""
        return self.positions[: self.length]


def sliding_window_mask(attention_mask, query_positions: torch.Tensor, key_positions: torch.Tensor, window: int,
                        past: int):
    """
    Restrict an attention mask to keys less than ``window`` positions behind each query (vLLM's and speculators'
    rule: key position > query position - window; the query itself is always inside).

    Args:
        attention_mask (`torch.Tensor` or `None`): bool (True = attend) or additive float mask [..., n, past + n];
            ``None`` means causal.
        query_positions (`torch.LongTensor` [n]): positions of the queries.
        key_positions (`torch.LongTensor` [past + n]): positions of the keys.
        window (`int`): the sliding window.
        past (`int`): keys cached before the queries.

    Returns:
        The combined mask (bool, or float when ``attention_mask`` was float).
    """
    inside = key_positions[None, :] > query_positions[:, None] - window
    if attention_mask is None:
        n = query_positions.shape[0]
        idx = torch.arange(past + n, device=inside.device)[None, :]
        return inside & (idx <= torch.arange(past, past + n, device=inside.device)[:, None])
    if attention_mask.dtype == torch.bool:
        return attention_mask & inside
    return attention_mask.masked_fill(~inside, float("-inf"))


class Eagle3RowCache:
    r"""
    The draft's key/value cache for a batch whose rows know different numbers of positions: preallocated buffers
    [B, kv_heads, capacity, D] where each row keeps its verified position ``p`` at column ``p`` (no holes, nothing to
    compact), and the speculative entries of a round (a tree's levels) in a region shared by all rows after the
    longest row's positions.

    The caller says where the next forward writes (:meth:`place`, per row, or :meth:`place_shared`, the same columns
    for every row) and with which mask it attends; the draft's attention then calls :meth:`attend`. The mask already
    holds the draft's sliding window, when it has one (the window it was built for is checked).

    Args:
        rows (`int`): batch size.
        capacity (`int`): columns to preallocate (grown when a forward writes past them).
        window (`int`, *optional*): the draft's sliding window the masks are built for.
    """

    def __init__(self, rows: int, capacity: int, window: int | None = None):
        self.rows, self.capacity, self.window = rows, capacity, window
        self.keys = self.values = None
        self.length = 0  # columns any forward has written to so far (the keys an attention reads)
        self._columns = None  # [B, n] per-row columns of the next write, or an int (first shared column)
        self._mask = None  # bool [B, 1, n, length after the write]

    def get_seq_length(self) -> int:
        """Columns in use (the widest row's positions plus the speculative region)."""
        return self.length

    def place(self, columns: torch.LongTensor, mask: torch.BoolTensor | None) -> None:
        """
        The next forward writes row ``b``'s ``j``-th entry at ``columns[b, j]`` and attends with ``mask``.

        Args:
            columns (`torch.LongTensor` [B, n]): per-row columns.
            mask (`torch.BoolTensor` [B, 1, n, width] or `None`): True = attend; ``width`` is the cache's width after
                the write. ``None``: every row writes columns ``0 .. n - 1`` and attends causally (a first feed: the
                attention kernel applies the mask, none is built).
        """
        self._columns, self._mask = columns, mask

    def place_shared(self, start: int, mask: torch.BoolTensor) -> None:
        """
        The next forward writes every row's entries at columns ``start ..`` and attends with ``mask``.

        Args:
            start (`int`): the first column.
            mask (`torch.BoolTensor` [B, 1, n, start + n]): True = attend.
        """
        self._columns, self._mask = int(start), mask

    def truncate(self, length: int) -> None:
        """Forget the columns from ``length`` on (the speculative region of the last round).

        Args:
            length (`int`): columns to keep.
        """
        self.length = min(self.length, length)

    def keep_rows(self, keep: torch.LongTensor) -> None:
        """
        Keep the given rows, in that order (finished rows leave the batch).

        Args:
            keep (`torch.LongTensor` [B']): row indices.
        """
        if self.keys is not None:
            self.keys, self.values = self.keys[keep], self.values[keep]
        self.rows = keep.shape[0]

    def _reserve(self, k: torch.Tensor, width: int) -> None:
        if self.keys is not None and width <= self.keys.shape[2]:
            return
        capacity = max(self.capacity, width, 2 * self.length)
        keys = k.new_zeros(self.rows, k.shape[1], capacity, k.shape[3])
        values = keys.clone()
        if self.keys is not None and self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """
        Write this forward's keys and values where :meth:`place` said and attend ``q`` with its mask.

        Args:
            q (`torch.Tensor` [B, heads, n, D]), k, v (`torch.Tensor` [B, kv_heads, n, D]): the forward's.
            window (`int`, *optional*): the draft's sliding window (must be the one the masks were built for).

        Returns:
            `torch.Tensor` [B, heads, n, D].
        """
        if window != self.window:
            raise ValueError(f"This row cache's masks are built for a sliding window of {self.window}, "
                             f"the draft has {window}.")
        columns, mask = self._columns, self._mask
        if columns is None:
            raise RuntimeError("Eagle3RowCache: call place() or place_shared() before each draft forward.")
        self._columns = self._mask = None
        width = mask.shape[-1] if mask is not None else k.shape[2]
        self._reserve(k, width)
        if isinstance(columns, int):
            self.keys[:, :, columns : columns + k.shape[2]] = k
            self.values[:, :, columns : columns + k.shape[2]] = v
        else:
            index = columns[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.keys.scatter_(2, index, k)
            self.values.scatter_(2, index, v)
        self.length = max(self.length, width)
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.keys[:, :, :width], self.values[:, :, :width], attn_mask=mask, is_causal=mask is None,
            enable_gqa=q.shape[1] != k.shape[1])
