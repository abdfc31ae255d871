"""The target's KV cache during tree decoding: which caches a tree round can roll back, the buffers preallocated for
the call (:class:`PreallocatedLayer`, pooled in one :class:`KVPool`), the gathers that keep only the accepted path
(one for all pooled layers, none when nothing moves), and the 4D attention masks of a tree forward (each node sees
the cached prefix and its ancestors).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticLayer

from .transfers import to_device
from .transformers_compat import DynamicLayer, is_plain_dynamic_layer
from .transformers_compat import is_sliding_layer as sliding_layer

GROWTH = 1.5  # a preallocated layer that must hold more grows its buffers by this factor (at least)


def move_kept(buffer: torch.Tensor, keep: torch.LongTensor | None, start: int, count: int) -> int:
    """
    In a pool buffer ``[2, layers, B, kv_heads, capacity, D]``, move the entries at ``start + keep`` (every row alike)
    to ``start .. start + count`` with one gather and one copy (``keep`` ``None``: they are there already); returns
    ``start + count``.

    Args:
        buffer (`torch.Tensor`): the pool's buffer.
        keep (`torch.LongTensor` [count] or `None`): indices from ``start``, in order.
        start (`int`): the first entry rewritten.
        count (`int`): entries kept.
    """
    if keep is not None:
        buffer[..., start : start + count, :] = buffer.index_select(-2, keep.to(buffer.device) + start)
    return start + count


def move_rows(buffer: torch.Tensor, index: torch.LongTensor, start: int) -> int:
    """
    In a pool buffer ``[2, layers, B, kv_heads, capacity, D]``, replace each row b's entries from ``start`` on by its
    entries at ``start + index[b]`` with one gather and one copy; returns the end of the kept entries.

    Args:
        buffer (`torch.Tensor`): the pool's buffer.
        index (`torch.LongTensor` [B, A]): per row, the entries to keep (relative to ``start``), in order.
        start (`int`): the first entry rewritten.
    """
    width, shape = index.shape[1], buffer.shape
    idx = (index.to(buffer.device) + start)[None, None, :, None, :, None]
    buffer[..., start : start + width, :] = buffer.gather(4, idx.expand(shape[0], shape[1], -1, shape[3], -1, shape[5]))
    return start + width


class KVPool:
    r"""
    One buffer holding the keys and values of every pooled :class:`PreallocatedLayer` of a cache, so that a round's
    commit moves the accepted entries of all layers with one gather and one copy, whatever the number of layers.

    A layer stays pooled while its views are the leading columns of its slot; anything that gives it other tensors
    (a reset) moves it to buffers of its own. Growing past the capacity grows the whole pool.

    Args:
        keys (`list[torch.Tensor]`): per layer, its keys after the prefill ``[B, kv_heads, L, D]`` (one shape).
        values (`list[torch.Tensor]`): per layer, its values.
        capacity (`int`): columns to preallocate (at least ``L``).
    """

    def __init__(self, keys: list, values: list, capacity: int):
        first = keys[0]
        length = first.shape[-2]
        self.buffer = first.new_empty(2, len(keys), *first.shape[:2], max(capacity, length), first.shape[-1])
        for slot, (k, v) in enumerate(zip(keys, values)):
            self.buffer[0, slot, :, :, :length] = k
            self.buffer[1, slot, :, :, :length] = v
        self.layers: list[PreallocatedLayer] = []

    @staticmethod
    def poolable(layers: list) -> bool:
        """Whether the layers' keys and values share one shape, dtype and device (and there are two or more)."""
        tensors = [t for layer in layers for t in (layer.keys, layer.values)]
        return len(layers) > 1 and all(
            t.dim() == 4 and t.shape == tensors[0].shape and t.dtype == tensors[0].dtype
            and t.device == tensors[0].device for t in tensors)

    @property
    def capacity(self) -> int:
        """Columns each slot holds."""
        return self.buffer.shape[-2]

    def members(self) -> list:
        """The layers still pooled."""
        return [layer for layer in self.layers if layer.pool is self]

    def grow(self, capacity: int) -> None:
        """
        Move every pooled layer into a larger pool buffer (their entries kept, their views rebound).

        Args:
            capacity (`int`): the new number of columns.
        """
        old = self.buffer
        self.buffer = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
        self.buffer[..., : old.shape[-2], :] = old
        for layer in self.members():
            layer.bind(layer.keys.shape[-2])

    def length(self) -> int | None:
        """The entries every pooled layer holds, or ``None`` when the layers differ (or one left its slot)."""
        members = self.members()
        if len(members) != len(self.layers) or not all(layer.owns_views() for layer in members):
            return None
        lengths = {layer.keys.shape[-2] for layer in members}
        return lengths.pop() if len(lengths) == 1 else None

    def keep(self, keep: torch.LongTensor | None, count: int, num_new: int) -> None:
        """
        Of the last ``num_new`` entries of every pooled layer, keep ``count`` of them: those at ``keep`` (in order),
        with one gather and one copy for all layers; the first ``count`` when ``keep`` is ``None`` (nothing moves).

        Args:
            keep (`torch.LongTensor` [count] or `None`): indices in ``[0, num_new)``.
            count (`int`): entries kept.
            num_new (`int`): tokens of the latest forward.
        """
        start = self.length() - num_new
        end = move_kept(self.buffer, keep, start, count)
        for layer in self.layers:
            layer.bind(end)

    def gather_rows(self, index: torch.LongTensor, start: int) -> None:
        """
        Replace every pooled layer's entries from ``start`` on by the entries at ``start + index[b]`` of each row b.

        Args:
            index (`torch.LongTensor` [B, A]): per row, the entries to keep (relative to ``start``), in order.
            start (`int`): the first entry rewritten.
        """
        end = move_rows(self.buffer, index, start)
        for layer in self.layers:
            layer.bind(end)

    def keep_rows(self, rows: torch.LongTensor) -> None:
        """
        Keep only the batch rows ``rows`` (in that order) of every pooled layer.

        Args:
            rows (`torch.LongTensor`): batch indices to keep.
        """
        length = self.length()
        self.buffer = self.buffer.index_select(2, rows.to(self.buffer.device))
        for layer in self.layers:
            layer.bind(length)


class PreallocatedLayer(DynamicLayer):
    r"""
    A full-attention layer of the target's cache whose keys and values live in buffers preallocated for the whole
    call: ``keys`` / ``values`` are views of the buffers' first ``length`` columns, so a forward writes only its new
    entries (a ``DynamicLayer`` concatenates, copying the whole cache every forward), and the in-place gathers of
    :func:`gather_cache` / :func:`gather_entries` and ``crop`` keep working on the views. The buffers are a slot of
    a :class:`KVPool` when ``pool`` is given, or the layer's own.

    Anything that replaces the views by other tensors (a row selection outside :func:`keep_rows`) is adopted into
    buffers of the layer's own at the next ``update``; a forward past the capacity grows the buffers (by
    :data:`GROWTH` at least), the whole pool for a pooled layer.

    Args:
        keys (`torch.Tensor` [B, kv_heads, L, D]): the layer's keys after the prefill.
        values (`torch.Tensor` [B, kv_heads, L, D]): its values.
        capacity (`int`): columns to preallocate (at least ``L``).
        pool (`KVPool`, *optional*): the pool holding the layer's entries (already copied there).
        slot (`int`, *optional*): the layer's slot in ``pool``.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, pool: KVPool | None = None,
                 slot: int = 0):
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self.pool, self.slot = pool, slot
        if pool is None:
            self._adopt(keys, values, max(capacity, keys.shape[-2]))
        else:
            pool.layers.append(self)
            self.bind(keys.shape[-2])

    def bind(self, length: int) -> None:
        """
        Point the buffers at the pool's slot and the views at its first ``length`` columns.

        Args:
            length (`int`): the entries held.
        """
        self._key_buffer, self._value_buffer = self.pool.buffer[0, self.slot], self.pool.buffer[1, self.slot]
        self._set_views(length)

    def _set_views(self, length: int) -> None:
        """``keys`` / ``values``: the buffers' first ``length`` columns."""
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        self._views = (self.keys, self.values)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Copy ``keys`` / ``values`` into buffers of the layer's own (leaving any pool)."""
        self.pool = None
        length = keys.shape[-2]
        key_buffer = keys.new_empty(*keys.shape[:2], capacity, keys.shape[-1])
        value_buffer = values.new_empty(*values.shape[:2], capacity, values.shape[-1])
        key_buffer[:, :, :length] = keys
        value_buffer[:, :, :length] = values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._set_views(length)

    def owns_views(self) -> bool:
        """Whether ``keys`` / ``values`` are still the leading columns of the buffers (at once when they are the
        views the layer set last)."""
        if self.keys is self._views[0] and self.values is self._views[1]:
            return True
        return all(view is not None and view.dim() == 4 and view.data_ptr() == buffer.data_ptr()
                   and view.shape[:2] == buffer.shape[:2] and view.stride() == buffer.stride()
                   for view, buffer in ((self.keys, self._key_buffer), (self.values, self._value_buffer)))

    @property
    def capacity(self) -> int:
        """Columns the buffers hold."""
        return self._key_buffer.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """
        Write the new entries after the cached ones and return every cached entry (views of the buffers).

        Args:
            key_states (`torch.Tensor` [B, kv_heads, n, D]): the new keys.
            value_states (`torch.Tensor` [B, kv_heads, n, D]): their values.
        """
        if self.keys is None or self.keys.dim() != 4:  # reset: start again from nothing, same capacity
            empty = key_states[:, :, :0]
            self._adopt(empty, value_states[:, :, :0], self.capacity)
            self.is_initialized = True
        elif not self.owns_views():
            self._adopt(self.keys, self.values, self.capacity)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            capacity = max(end, int(self.capacity * GROWTH))
            if self.pool is not None:
                self.pool.grow(capacity)
            else:
                self._adopt(self.keys, self.values, capacity)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self._set_views(end)
        return self.keys, self.values


def preallocate(cache, capacity: int) -> None:
    """
    Move every full-attention layer of ``cache`` (after the prefill) into a :class:`PreallocatedLayer` of
    ``capacity`` columns, all in one :class:`KVPool` when they share a shape; sliding-window layers keep their own
    bounded storage.

    Args:
        cache (`DynamicCache`): the target's cache, its layers filled by the prefill.
        capacity (`int`): columns per layer (the call's ``max_length`` plus one round's nodes, or more).
    """
    slots = [i for i, layer in enumerate(cache.layers) if is_plain_dynamic_layer(layer) and layer.is_initialized
             and layer.keys is not None and layer.keys.dim() == 4]
    layers = [cache.layers[i] for i in slots]
    pool = None
    if KVPool.poolable(layers):
        pool = KVPool([layer.keys for layer in layers], [layer.values for layer in layers], capacity)
    for slot, i in enumerate(slots):
        layer = cache.layers[i]
        cache.layers[i] = PreallocatedLayer(layer.keys, layer.values, capacity, pool, slot)


def pooled(cache) -> KVPool | None:
    """
    The pool holding every full-attention layer of ``cache`` with one length, or ``None`` (the gathers then go
    layer by layer).

    Args:
        cache (`DynamicCache`): the target's cache.
    """
    pool = None
    for layer in cache.layers:
        if sliding_layer(layer) or not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue
        if not isinstance(layer, PreallocatedLayer) or layer.pool is None or pool not in (None, layer.pool):
            return None
        pool = layer.pool
    return pool if pool is not None and pool.length() is not None else None


def sliding_window(cache) -> float:
    """
    The smallest sliding window among the layers of ``cache`` (``inf`` when no layer slides).

    Args:
        cache (`DynamicCache`): the target's cache.
    """
    return min([layer.sliding_window for layer in cache.layers if sliding_layer(layer)], default=float("inf"))


def check_tree_cache(cache) -> None:
    """
    Raise ``ValueError`` unless every layer of ``cache`` is one whose entries :func:`gather_cache` can select.

    Args:
        cache (`Cache`): the target's KV cache of this ``generate`` call.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"EAGLE-3 tree decoding keeps the accepted path of the target's KV cache with a gather, implemented for "
            f"DynamicCache (full and sliding-window layers); got {type(cache).__name__}. Use the default cache "
            "(no cache_implementation), or drop the tree_* settings to use chain drafting."
        )
    for i, layer in enumerate(cache.layers):
        if not is_plain_dynamic_layer(layer) and not sliding_layer(layer) and not isinstance(layer, PreallocatedLayer):
            raise ValueError(
                f"EAGLE-3 tree decoding cannot gather cache layer {i} of type {type(layer).__name__} (supported: "
                "DynamicLayer, DynamicSlidingWindowLayer). Drop the tree_* settings to use chain drafting."
            )


def cache_entry(model_kwargs: dict) -> tuple[str, object]:
    """
    The target's cache among ``generate``'s prepared model kwargs and its keyword: ``"cache"``, or
    ``"past_key_values"`` (its name on earlier releases); the cache is ``None`` when there is none.

    Args:
        model_kwargs (`dict`): the prepared model kwargs.
    """
    key = "cache" if model_kwargs.get("cache") is not None else "past_key_values"
    return key, model_kwargs.get(key)


def decoding_cache(model_kwargs: dict, generation_config, loop: str) -> tuple[str, object]:
    """
    The target's cache of this ``generate`` call and the keyword it travels under, after the checks both EAGLE-3 loops
    share: a cache whose entries can be gathered (a dynamic cache, or a static one whose layers all attend fully), and
    no attentions / hidden states asked for (they return neither).

    Args:
        model_kwargs (`dict`): the prepared model kwargs.
        generation_config (`GenerationConfig`): the call's config.
        loop (`str`): the loop's name, for the error messages.

    Returns:
        ``(key, cache)``: ``"cache"`` (Transformers >= 5.2x) or ``"past_key_values"``, and the `DynamicCache`.
    """
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(f"{loop} does not return attentions or hidden states; drop output_attentions / "
                         "output_hidden_states (scores and logits are supported).")
    key, cache = cache_entry(model_kwargs)
    if cache is None or not generation_config.use_cache:
        raise ValueError(f"{loop} requires a cache (use_cache=True).")
    if is_static_cache(cache):
        check_static_cache(cache, loop)
    else:
        check_tree_cache(cache)
    return key, cache


def prefill(model, input_ids: torch.LongTensor, model_kwargs: dict, cache, capacity: int, forward=None) -> torch.Tensor:
    """
    The target's first forward, over the prompt(s), which fills ``cache``, whose full-attention layers then move into
    buffers of ``capacity`` columns (:func:`preallocate`; a static cache keeps its own); returns the float32 logits at
    the last position ``[B, V]`` (on ``input_ids``' device).

    Args:
        model (`PreTrainedModel`): the target.
        input_ids (`torch.LongTensor` [B, L]): the prompt(s).
        model_kwargs (`dict`): the prepared model kwargs (cache, attention mask, ...).
        cache (`DynamicCache`): the cache among them, checked again once its layers exist.
        capacity (`int`): columns to preallocate per layer.
        forward (`Callable`, *optional*): runs the forward as ``forward(model, **inputs)`` (the call's feature
            capture's ``forward``, which keeps its features); default ``model(**inputs)``.
    """
    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    if "logits_to_keep" in model_inputs:
        model_inputs["logits_to_keep"] = 1
    outputs = forward(model, **model_inputs) if forward is not None else model(**model_inputs)
    logits = outputs.logits[:, -1].to(dtype=torch.float32, device=input_ids.device)
    if not is_static_cache(cache):
        check_tree_cache(cache)  # layers are created lazily by the first forward
        preallocate(cache, capacity)
    return logits


def in_order(paths: list) -> bool:
    """
    Whether every path (host lists of a round's entry indices) keeps a prefix of the round's entries where they are,
    so that committing it moves nothing (a chain's accepted prefix, a plain step).

    Args:
        paths (`list[list[int]]`): per row, the kept indices in ``[0, num_new)``, in order.
    """
    return all(list(path) == list(range(len(path))) for path in paths)


def gather_cache(cache, keep, num_new: int) -> None:
    """Keep, of the last ``num_new`` entries of every layer of ``cache``, only those at indices ``keep`` (in order).

    Entries before the last ``num_new`` are untouched. Pooled layers move together (one gather, one copy), and no
    layer moves anything when ``keep`` is the host list ``0 .. k - 1`` (a chain's accepted prefix, decided without
    reading the device). Sliding-window layers are then shrunk back to their window, as ``crop`` does after a chain
    round.

    Args:
        cache (`DynamicCache`): the target's cache right after a forward of ``num_new`` tokens.
        keep (`list[int]` or `torch.LongTensor`): indices in ``[0, num_new)`` to keep (may be empty).
        num_new (`int`): tokens of that forward.
    """
    check_tree_cache(cache)
    count = len(keep) if isinstance(keep, (list, tuple)) else keep.numel()
    ordered = isinstance(keep, (list, tuple)) and in_order([keep])
    if ordered and count == num_new:  # every entry kept where it is: only sliding layers go back to their window
        for layer in cache.layers:
            if sliding_layer(layer) and layer.is_initialized and layer.keys is not None and layer.keys.numel():
                layer.crop(0)
        return
    pool = pooled(cache)
    index = None  # the kept indices on the cache's device, only where entries move
    if not ordered:
        layer = next((layer for layer in cache.layers if layer.is_initialized and layer.keys is not None), None)
        device = layer.keys.device if layer is not None else None
        index = keep.to(device) if isinstance(keep, torch.Tensor) else to_device(keep, device)
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue  # e.g. layers that share another layer's KV
        if pool is not None and isinstance(layer, PreallocatedLayer):
            continue  # moved below, all at once
        start = layer.keys.shape[-2] - num_new
        end = start + count
        if index is not None:  # move the kept entries to the front of the new block in place (no copy of the prefix)
            at = index.to(layer.keys.device) + start
            layer.keys[..., start:end, :] = layer.keys.index_select(-2, at)
            layer.values[..., start:end, :] = layer.values.index_select(-2, at)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if sliding_layer(layer):
            layer.cumulative_length += count - num_new
            layer.crop(0)  # back to `sliding_window - 1` entries once past the window
    if pool is not None:
        pool.keep(index, count, num_new)


def tree_attention_mask(cache, ancestors: torch.BoolTensor, depths: torch.LongTensor, prefix_allowed, dtype):
    """The 4D additive masks of a tree forward: each node sees the cached prefix and its ancestors (itself included).

    Sliding-window layers also hide the prefix entries outside the window. Built from each layer's
    ``get_mask_sizes`` before the forward, so the key length matches what the layer returns.

    Args:
        cache (`DynamicCache`): the target's cache (before the forward).
        ancestors (`torch.BoolTensor` [n, n]): ``ancestors[i, j]``: node j is node i or an ancestor of it.
        depths (`torch.LongTensor` [n]): depth of each node (the root, the sequence's last token, is 0).
        prefix_allowed (`torch.BoolTensor` [past] or `None`): False at padded prefix positions.
        dtype: the target's dtype.

    Returns:
        A float tensor [1, 1, n, kv_length] (0 = attend, dtype min = masked); or, for models with both full and
        sliding layers, ``{"full_attention": ..., "sliding_attention": ...}``.
    """
    n = ancestors.shape[0]
    device = ancestors.device
    past = cache.get_seq_length()
    query = past + depths  # cache index of each node
    masks = {}
    for layer in cache.layers:
        kind = "sliding_attention" if sliding_layer(layer) else "full_attention"
        if kind in masks:
            if kind == "sliding_attention" and layer.sliding_window != masks["_window"]:
                raise ValueError("EAGLE-3 tree decoding needs one sliding window size across the target's layers.")
            continue
        if layer.is_initialized:
            kv_length, kv_offset = layer.get_mask_sizes(n)
        else:
            kv_length, kv_offset = past + n, 0
        columns = kv_offset + torch.arange(kv_length - n, device=device)
        allowed_prefix = torch.ones(n, kv_length - n, dtype=torch.bool, device=device)
        allowed_tree = ancestors
        if prefix_allowed is not None:
            allowed_prefix = allowed_prefix & prefix_allowed.to(device)[columns][None]
        if kind == "sliding_attention":
            window = layer.sliding_window
            masks["_window"] = window
            allowed_prefix = allowed_prefix & (columns[None] > query[:, None] - window)
            allowed_tree = allowed_tree & (depths[:, None] - depths[None] < window)
        allowed = torch.cat([allowed_prefix, allowed_tree], dim=-1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        masks[kind] = mask[None, None]
    masks.pop("_window", None)
    return next(iter(masks.values())) if len(masks) == 1 else masks


# ------------------------------------------------------------------------------------------------ batches
def _layers(cache):
    return [layer for layer in cache.layers if layer.is_initialized and layer.keys is not None and layer.keys.numel()]


def keep_rows(cache, rows: torch.LongTensor) -> None:
    """Keep only the batch rows ``rows`` (in that order) of every layer of ``cache``.

    Args:
        cache (`DynamicCache`): the target's cache.
        rows (`torch.LongTensor`): batch indices to keep.
    """
    pool = pooled(cache)
    for layer in _layers(cache):
        if pool is None or not isinstance(layer, PreallocatedLayer):
            layer.keys, layer.values = layer.keys[rows.to(layer.keys.device)], layer.values[rows.to(layer.keys.device)]
    if pool is not None:
        pool.keep_rows(rows)


def gather_entries(cache, index: torch.LongTensor, start: int) -> None:
    """Replace every layer's entries from ``start`` on by the entries at ``start + index[b]`` of each row b (pooled
    layers all at once).

    Args:
        cache (`DynamicCache`): the target's cache.
        index (`torch.LongTensor` [B, A]): per row, the entries to keep (relative to ``start``), in order.
        start (`int`): the first entry that is rewritten (entries before it are untouched).
    """
    width = index.shape[1]
    pool = pooled(cache)
    for layer in _layers(cache):
        if pool is not None and isinstance(layer, PreallocatedLayer):
            continue
        idx = (index.to(layer.keys.device) + start)[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                                           layer.keys.shape[-1])
        keys, values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        layer.keys[:, :, start : start + width] = keys  # in place: the entries before `start` are not copied
        layer.values[:, :, start : start + width] = values
        layer.keys, layer.values = layer.keys[:, :, : start + width], layer.values[:, :, : start + width]
        if sliding_layer(layer):
            layer.cumulative_length = layer.keys.shape[-2]
    if pool is not None:
        pool.gather_rows(index, start)


def compact(cache, valid: torch.BoolTensor) -> torch.BoolTensor:
    """Move each row's valid entries to the right end (holes become left padding) and drop the columns that are
    holes in every row. Returns the new validity mask.

    Args:
        cache (`DynamicCache`): the target's cache.
        valid (`torch.BoolTensor` [B, T]): which entries of each row are real.
    """
    order = compaction_order(valid, int(valid.sum(-1).max()))
    gather_entries(cache, order, 0)
    return valid.gather(1, order)


def compaction_order(valid: torch.BoolTensor, length: int) -> torch.LongTensor:
    """
    Per row, the entries a compaction keeps, in order: its valid entries at the right end, holes before them, ``length``
    in all (a stable sort: holes first, then the valid entries in their order; the last ``length`` of them).

    Args:
        valid (`torch.BoolTensor` [B, T]): which entries of each row are real.
        length (`int`): entries kept per row (at least the most valid entries of a row).
    """
    return torch.sort(valid.long(), dim=-1, stable=True).indices[:, -length:]


def batch_tree_mask(cache, valid: torch.BoolTensor, trees: list, nodes: int, dtype):
    """The 4D additive mask of a batched tree forward: each node sees its row's valid cache entries and its own
    ancestors (itself included); the padding nodes of a smaller tree see only themselves.

    Args:
        cache (`DynamicCache`): the target's cache (before the forward).
        valid (`torch.BoolTensor` [B, T]): real entries of each row.
        trees (`list[DraftTree]`): one per row.
        nodes (`int`): tokens of the forward per row (the largest tree).
        dtype: the target's dtype.

    Returns:
        A float tensor [B, 1, nodes, T + nodes]; for models with both full and sliding layers, the same mask under
        ``"full_attention"`` and ``"sliding_attention"`` (nothing is ever outside the window, see
        :func:`~hf_eagle3.core.decoding_loop.check_rows`).
    """
    device = valid.device
    tree = torch.eye(nodes, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        n = t.tokens.shape[0]
        tree[b, :n, :n] = t.ancestors.to(device)
    allowed = torch.cat([valid[:, None, :].expand(-1, nodes, -1), tree], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    mask = mask[:, None]
    kinds = {"sliding_attention" if sliding_layer(layer) else "full_attention" for layer in cache.layers}
    return {kind: mask for kind in kinds} if len(kinds) > 1 else mask


# ------------------------------------------------------------------------------------------------ static caches
NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # widths a static round is padded to (one graph each), beside the widest round


def is_static_cache(cache) -> bool:
    """
    Whether ``cache`` is a static cache (``cache_implementation="static"``: Transformers' ``StaticCache``, layers of
    a fixed capacity written in place).

    Args:
        cache (`Cache`): the target's cache of a ``generate`` call.
    """
    layers = getattr(cache, "layers", None)
    return not isinstance(cache, DynamicCache) and bool(layers) and all(isinstance(layer, StaticLayer)
                                                                         for layer in layers)


def check_static_cache(cache, loop: str) -> None:
    """
    Raise ``ValueError`` unless every layer of the static ``cache`` attends fully (a static sliding-window layer is a
    ring of the window's entries, which a tree's gather cannot keep in order).

    Args:
        cache (`StaticCache`): the target's cache of this ``generate`` call.
        loop (`str`): the loop's name, for the error message.
    """
    odd = [i for i, layer in enumerate(cache.layers) if type(layer) is not StaticLayer]
    if odd:
        raise ValueError(
            f"{loop} on a static cache needs layers that attend fully; layer {odd[0]} is a "
            f"{type(cache.layers[odd[0]]).__name__}. Use the default dynamic cache (drop cache_implementation) for "
            "this target."
        )


def node_bucket(nodes: int, widest: int) -> int:
    """
    The width a static round's forward is padded to: the least of :data:`NODE_BUCKETS` and the call's widest round
    holding ``nodes`` (one compiled graph per width used; a fixed chain or tree fills its own width, unpadded).

    Args:
        nodes (`int`): tokens per row the round verifies (the root included).
        widest (`int`): the most tokens per row a round of the call verifies.
    """
    return min((b for b in (*NODE_BUCKETS, widest) if b >= nodes), default=nodes)


def static_cache_for(model, cache, rows: int, columns: int):
    """
    A static cache of at least ``columns`` entries per row: ``cache`` when it holds them (``generate`` sizes it to
    ``max_length - 1``, or to ``max_cache_len``), else a new one of the next power of two (at least 256, so that calls
    of similar lengths share a capacity and a compiled graph).

    Args:
        model (`PreTrainedModel`): the target.
        cache (`StaticCache`): the call's cache, not yet filled.
        rows (`int`): the batch size.
        columns (`int`): entries per row the call writes at most (its longest row plus one round's nodes).
    """
    from transformers import StaticCache

    from .draft_cache import static_capacity

    if cache.get_max_length() >= columns:
        return cache
    return StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=static_capacity(columns))


class StaticPool:
    r"""
    The layers of a static target cache moved, after the prefill, into one buffer ``[2, layers, B, kv_heads,
    capacity, D]`` (and their lengths into one tensor), so that a round's commit moves the accepted entries of every
    layer with one gather and one copy, and sets every layer's length with one fill. The layers keep writing a
    forward's entries in place at their ``cumulative_length``, at addresses that never change (what a compiled
    forward and a CUDA graph need); the pool keeps the length on the host too, so nothing is read back.

    Args:
        cache (`StaticCache`): the target's cache, filled by the prefill (:func:`check_static_cache` passed).
        length (`int`): entries per row the prefill wrote.
    """

    def __init__(self, cache, length: int):
        layers = list(cache.layers)
        first = layers[0].keys
        if any(layer.keys.shape != first.shape or layer.values.shape != first.shape for layer in layers):
            raise ValueError("EAGLE-3 decoding on a static cache needs one key/value shape across the target's "
                             "layers. Use the default dynamic cache (drop cache_implementation) for this target.")
        self.buffer = first.new_empty(2, len(layers), *first.shape)
        self.lengths = torch.full((len(layers),), length, dtype=layers[0].cumulative_length.dtype,
                                  device=layers[0].cumulative_length.device)
        for slot, layer in enumerate(layers):
            self.buffer[0, slot], self.buffer[1, slot] = layer.keys, layer.values
            layer.keys, layer.values = self.buffer[0, slot], self.buffer[1, slot]
            layer.cumulative_length = self.lengths[slot]
            for tensor in (layer.keys, layer.values, layer.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.length = length

    @property
    def capacity(self) -> int:
        """Entries each row holds."""
        return self.buffer.shape[-2]

    def wrote(self, n: int) -> None:
        """
        Count a forward of ``n`` tokens per row (the layers advanced their lengths themselves).

        Args:
            n (`int`): tokens per row of the forward.
        """
        self.length += n

    def set_length(self, length: int) -> None:
        """
        Every layer's next forward writes from entry ``length`` on (one fill for all layers).

        Args:
            length (`int`): entries per row kept.
        """
        self.lengths.fill_(length)
        self.length = length

    def keep(self, keep: torch.LongTensor | None, count: int, num_new: int) -> None:
        """
        Of the last ``num_new`` entries, keep ``count``: those at ``keep`` (in order), all layers with one gather and
        one copy; the first ``count`` when ``keep`` is ``None`` (nothing moves).

        Args:
            keep (`torch.LongTensor` [count] or `None`): indices in ``[0, num_new)``.
            count (`int`): entries kept.
            num_new (`int`): tokens of the latest forward.
        """
        self.set_length(move_kept(self.buffer, keep, self.length - num_new, count))

    def gather_rows(self, index: torch.LongTensor, start: int) -> None:
        """
        Replace every layer's entries from ``start`` on by the entries at ``start + index[b]`` of each row b (one
        gather and one copy for all layers), and write the next forward after them.

        Args:
            index (`torch.LongTensor` [B, A]): per row, the entries to keep (relative to ``start``), in order.
            start (`int`): the first entry rewritten.
        """
        self.set_length(move_rows(self.buffer, index, start))


def static_tree_mask(valid: torch.BoolTensor, ancestors: list, nodes: int, capacity: int, dtype):
    """The 4D additive mask of a tree forward on a static cache of ``capacity`` entries per row: each node sees its
    row's valid entries and its own ancestors (itself included); the padding nodes of a smaller tree, and every node
    of a row given no tree (a finished row kept in the batch), see only themselves; entries past the forward's are
    hidden.

    Args:
        valid (`torch.BoolTensor` [B, T]): real entries of each row (T: the entries before the forward).
        ancestors (`list`): per row, its tree's ``ancestors`` [n, n], or ``None`` for a row given no tree.
        nodes (`int`): tokens of the forward per row (a width of :data:`NODE_BUCKETS`).
        capacity (`int`): the cache's entries per row.
        dtype: the target's dtype.

    Returns:
        A float tensor [B, 1, nodes, capacity].
    """
    rows, past = valid.shape
    device = valid.device
    allowed = torch.zeros(rows, nodes, capacity, dtype=torch.bool, device=device)
    allowed[:, :, past : past + nodes] = torch.eye(nodes, dtype=torch.bool, device=device)
    for b, tree in enumerate(ancestors):
        if tree is None:
            continue
        n = tree.shape[0]
        allowed[b, :, :past] = valid[b]
        allowed[b, :n, past : past + n] = tree.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
