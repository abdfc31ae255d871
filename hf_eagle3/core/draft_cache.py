"""The draft's key/value cache, and the sliding-window mask that reads the positions it keeps.
"""

from __future__ import annotations

import threading

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


def causal_mask(columns: torch.LongTensor, width: int, window: int | None = None) -> torch.BoolTensor:
    """
    The mask of queries at ``columns`` of a cache whose column ``p`` holds position ``p``: each attends to the
    columns up to its own, within the sliding window (key position > query position - window).

    Args:
        columns (`torch.LongTensor` [B, n]): the queries' columns (= positions).
        width (`int`): keys in the mask.
        window (`int`, *optional*): the draft's sliding window.

    Returns:
        `torch.BoolTensor` [B, 1, n, width] (True = attend).
    """
    keys = torch.arange(width, device=columns.device)
    mask = keys[None, None, :] <= columns[:, :, None]
    if window is not None:
        mask &= keys[None, None, :] > columns[:, :, None] - window
    return mask[:, None]


def static_capacity(columns: int) -> int:
    """
    The capacity of a static draft cache that must hold ``columns`` columns: the next power of two, at least 256, so
    that calls of similar lengths share one capacity (static steps compile, and capture CUDA graphs, per capacity).

    Args:
        columns (`int`): columns the call may write.
    """
    return max(256, 1 << (max(1, int(columns)) - 1).bit_length())


class Eagle3RowCache:
    r"""
    The draft's key/value cache for a batch whose rows know different numbers of positions: preallocated buffers
    [B, kv_heads, capacity, D] where each row keeps its verified position ``p`` at column ``p`` (no holes, nothing to
    compact), and the speculative entries of a round (a chain's tokens, a tree's levels) in a region shared by all rows
    after the longest row's positions.

    The caller says where the next forward writes and with which mask it attends (:meth:`place_causal` for a feed of
    verified positions, :meth:`place_shared` for a drafting step); the draft's attention then calls :meth:`attend`.
    The masks hold the draft's sliding window, when it has one (the window they were built for is checked).

    A **static** cache (``static_buffers`` given: the steps run under a compile config that asks for static shapes or
    captures CUDA graphs) never reallocates: its buffers come from ``static_buffers`` (kept by the draft and reused by
    every call of the same size in the same thread, so their addresses do not change; a call running at the same time
    in another thread gets buffers of its own, as it gets CUDA graphs of its own), drafting steps write at columns
    given as device tensors and attend over the full capacity with a mask, so every step of a call has the same shapes
    and reads no Python number that changes. Feeds, which run eagerly, still attend over the columns in use only.

    Args:
        rows (`int`): batch size.
        capacity (`int`): columns to preallocate (a dynamic cache grows when a forward writes past them).
        window (`int`, *optional*): the draft's sliding window the masks are built for.
        static_buffers (`dict`, *optional*): makes the cache static; holds the buffers by size and thread between calls.
    """

    def __init__(self, rows: int, capacity: int, window: int | None = None, static_buffers: dict | None = None):
        self.rows, self.capacity, self.window = rows, capacity, window
        self.static_buffers = static_buffers
        self.keys = self.values = None
        self._full = None  # static: the pooled buffers (all the rows they were made for)
        self.length = 0  # columns any forward has written to so far (the keys an attention reads)
        self._columns = None  # [B, n] per-row columns of the next write, or an int (first shared column)
        self._mask = None  # bool [B, 1, n, keys attended]

    @property
    def static(self) -> bool:
        """Whether the buffers never reallocate and drafting steps attend over the full capacity."""
        return self.static_buffers is not None

    def get_seq_length(self) -> int:
        """Columns in use (the widest row's positions plus the speculative region)."""
        return self.length

    def place_causal(self, columns: torch.LongTensor, width: int) -> None:
        """
        The next forward writes row ``b``'s ``j``-th verified position at column ``columns[b, j]`` (its position) and
        attends causally over the row's own positions (within the sliding window).

        Args:
            columns (`torch.LongTensor` [B, n]): per-row columns (= positions).
            width (`int`): the columns in use after the write (the largest column + 1; padding entries of short rows
                may write up to there).
        """
        first = self.length == 0 and (self.window is None or width <= self.window)  # the kernel's causal mask
        self._columns, self._mask = columns, None if first else causal_mask(columns, width, self.window)
        self.length = max(self.length, width)

    def place_shared(self, start: int, mask: torch.BoolTensor) -> None:
        """
        The next forward (a drafting step) writes every row's entries at columns ``start ..`` and attends with
        ``mask`` (padded with False to the full capacity for a static cache).

        Args:
            start (`int`): the first column.
            mask (`torch.BoolTensor` [B, 1, n, start + n] or [B, 1, n, capacity]): True = attend.
        """
        n = mask.shape[2]
        self.length = max(self.length, start + n)
        if not self.static:
            self._columns, self._mask = int(start), mask
            return
        if start + n > self.capacity:
            raise RuntimeError(f"Static draft cache of {self.capacity} columns cannot hold columns up to {start + n}.")
        if mask.shape[-1] < self.capacity:
            mask = torch.nn.functional.pad(mask, (0, self.capacity - mask.shape[-1]), value=False)
        columns = torch.arange(start, start + n, device=mask.device)
        self._columns, self._mask = columns[None].expand(mask.shape[0], n), mask

    def place(self, columns: torch.LongTensor, mask: torch.BoolTensor) -> None:
        """
        Static cache: the next forward writes row ``b``'s entries at ``columns[b]`` and attends with ``mask`` over the
        full capacity; nothing is read or kept on the host (a captured drafting round calls it, see
        :mod:`~hf_eagle3.core.draft_round`; the caller keeps :attr:`length` up to date).

        Args:
            columns (`torch.LongTensor` [B, n]): per-row columns.
            mask (`torch.BoolTensor` [B, 1, n, capacity]): True = attend.
        """
        self._columns, self._mask = columns, mask

    def take_buffers(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """
        Static cache: take the pooled buffers now (a captured round must find them taken).

        Args:
            kv_heads (`int`), head_dim (`int`): the draft's key/value heads and head size.
            dtype (`torch.dtype`), device: the draft's.
        """
        if self.keys is None:
            self._take_static(torch.empty(self.rows, kv_heads, 0, head_dim, dtype=dtype, device=device))

    def crop(self, length: int) -> None:
        """Forget the columns from ``length`` on (the speculative region of the last round).

        Args:
            length (`int`): columns to keep.
        """
        self.length = min(self.length, length)

    def keep_rows(self, keep: torch.LongTensor) -> None:
        """
        Keep the given rows, in that order (finished rows leave the batch). A static cache moves them to its first
        rows in place.

        Args:
            keep (`torch.LongTensor` [B']): row indices.
        """
        if self.keys is not None and self.static:
            n = keep.shape[0]
            self._full[0][:n], self._full[1][:n] = self.keys[keep], self.values[keep]
            self.keys, self.values = self._full[0][:n], self._full[1][:n]
        elif self.keys is not None:
            self.keys, self.values = self.keys[keep], self.values[keep]
        self.rows = keep.shape[0]

    def _reserve(self, k: torch.Tensor, width: int) -> None:
        if self.keys is not None and width <= self.keys.shape[2]:
            return
        if self.static:
            self._take_static(k)
            if width > self.capacity:
                raise RuntimeError(f"Static draft cache of {self.capacity} columns cannot hold {width}.")
            return
        capacity = max(self.capacity, width, 2 * self.keys.shape[2] if self.keys is not None else 0)
        keys = k.new_zeros(self.rows, k.shape[1], capacity, k.shape[3])
        values = keys.clone()
        if self.keys is not None:
            keys[:, :, : self.keys.shape[2]] = self.keys
            values[:, :, : self.values.shape[2]] = self.values
        self.keys, self.values, self.capacity = keys, values, capacity

    def _take_static(self, k: torch.Tensor) -> None:
        """The pooled buffers of this size and thread (made, zeroed and marked static on first use)."""
        key = (self.rows, k.shape[1], self.capacity, k.shape[3], k.dtype, str(k.device), threading.get_ident())
        if key not in self.static_buffers:
            keys = k.new_zeros(self.rows, k.shape[1], self.capacity, k.shape[3])
            values = keys.clone()
            for buffer in (keys, values):  # cudagraphs: the same address at every replay, no copy
                torch._dynamo.mark_static_address(buffer)
            self.static_buffers[key] = (keys, values)
        self._full = self.static_buffers[key]
        self.keys, self.values = self._full

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """
        Write this forward's keys and values where the last ``place_*`` call said and attend ``q`` with its mask.

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
            raise RuntimeError("Eagle3RowCache: call place_causal() or place_shared() before each draft forward.")
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
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.keys[:, :, :width], self.values[:, :, :width], attn_mask=mask, is_causal=mask is None,
            enable_gqa=q.shape[1] != k.shape[1])
