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
