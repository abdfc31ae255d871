"""The target's KV cache during tree decoding: which caches a tree round can roll back, the buffers preallocated for
the call (:class:`PreallocatedLayer`), the gather that keeps only the accepted path, and the 4D attention masks of a
tree forward (each node sees the cached prefix and its ancestors).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .transformers_compat import DynamicLayer, is_plain_dynamic_layer
from .transformers_compat import is_sliding_layer as sliding_layer

GROWTH = 1.5  # a preallocated layer that must hold more grows its buffers by this factor (at least)


class PreallocatedLayer(DynamicLayer):
    r"""
    A full-attention layer of the target's cache whose keys and values live in buffers preallocated for the whole
    call: ``keys`` / ``values`` are views of the buffers' first ``length`` columns, so a forward writes only its new
    entries (a ``DynamicLayer`` concatenates, copying the whole cache every forward), and the in-place gathers of
    :func:`gather_cache` / :func:`gather_entries` and ``crop`` keep working on the views.

    Anything that replaces the views by other tensors (a row selection) is adopted into fresh buffers at the next
    ``update``; a forward past the capacity grows the buffers (by :data:`GROWTH` at least).

    Args:
        keys (`torch.Tensor` [B, kv_heads, L, D]): the layer's keys after the prefill.
        values (`torch.Tensor` [B, kv_heads, L, D]): its values.
        capacity (`int`): columns to preallocate (at least ``L``).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self._adopt(keys, values, max(capacity, keys.shape[-2]))

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        length = keys.shape[-2]
        self._key_buffer = keys.new_empty(*keys.shape[:2], capacity, keys.shape[-1])
        self._value_buffer = values.new_empty(*values.shape[:2], capacity, values.shape[-1])
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    def _owns_views(self) -> bool:
        """Whether ``keys`` / ``values`` are still the leading columns of the buffers."""
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
        elif not self._owns_views():
            self._adopt(self.keys, self.values, self.capacity)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            self._adopt(self.keys, self.values, max(end, int(self.capacity * GROWTH)))
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values


def preallocate(cache, capacity: int) -> None:
    """
    Move every full-attention layer of ``cache`` (after the prefill) into a :class:`PreallocatedLayer` of
    ``capacity`` columns; sliding-window layers keep their own bounded storage.

    Args:
        cache (`DynamicCache`): the target's cache, its layers filled by the prefill.
        capacity (`int`): columns per layer (the call's ``max_length`` plus one round's nodes, or more).
    """
    for i, layer in enumerate(cache.layers):
        if is_plain_dynamic_layer(layer) and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            cache.layers[i] = PreallocatedLayer(layer.keys, layer.values, capacity)


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
    share: a cache whose entries can be gathered, and no attentions / hidden states asked for (they return neither).

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
    check_tree_cache(cache)
    return key, cache


def prefill(model, input_ids: torch.LongTensor, model_kwargs: dict, cache, capacity: int, forward=None) -> torch.Tensor:
    """
    The target's first forward, over the prompt(s), which fills ``cache``, whose full-attention layers then move into
    buffers of ``capacity`` columns (:func:`preallocate`); returns the float32 logits at the last position ``[B, V]``
    (on ``input_ids``' device).

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
    check_tree_cache(cache)  # layers are created lazily by the first forward
    preallocate(cache, capacity)
    return logits


def gather_cache(cache, keep: torch.LongTensor, num_new: int) -> None:
    """Keep, of the last ``num_new`` entries of every layer of ``cache``, only those at indices ``keep`` (in order).

    Entries before the last ``num_new`` are untouched. Sliding-window layers are then shrunk back to their window,
    as ``crop`` does after a chain round.

    Args:
        cache (`DynamicCache`): the target's cache right after a forward of ``num_new`` tokens.
        keep (`torch.LongTensor`): indices in ``[0, num_new)`` to keep (may be empty).
        num_new (`int`): tokens of that forward.
    """
    check_tree_cache(cache)
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue  # e.g. layers that share another layer's KV
        start = layer.keys.shape[-2] - num_new
        end = start + keep.numel()
        index = keep.to(layer.keys.device) + start
        # Move the kept entries to the front of the new block in place, then drop the rest (no copy of the prefix).
        layer.keys[..., start:end, :] = layer.keys.index_select(-2, index)
        layer.values[..., start:end, :] = layer.values.index_select(-2, index)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if sliding_layer(layer):
            layer.cumulative_length += keep.numel() - num_new
            layer.crop(0)  # back to `sliding_window - 1` entries once past the window


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
    for layer in _layers(cache):
        layer.keys, layer.values = layer.keys[rows.to(layer.keys.device)], layer.values[rows.to(layer.keys.device)]


def gather_entries(cache, index: torch.LongTensor, start: int) -> None:
    """Replace every layer's entries from ``start`` on by the entries at ``start + index[b]`` of each row b.

    Args:
        cache (`DynamicCache`): the target's cache.
        index (`torch.LongTensor` [B, A]): per row, the entries to keep (relative to ``start``), in order.
        start (`int`): the first entry that is rewritten (entries before it are untouched).
    """
    width = index.shape[1]
    for layer in _layers(cache):
        idx = (index.to(layer.keys.device) + start)[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                                           layer.keys.shape[-1])
        keys, values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        layer.keys[:, :, start : start + width] = keys  # in place: the entries before `start` are not copied
        layer.values[:, :, start : start + width] = values
        layer.keys, layer.values = layer.keys[:, :, : start + width], layer.values[:, :, : start + width]
        if sliding_layer(layer):
            layer.cumulative_length = layer.keys.shape[-2]


def compact(cache, valid: torch.BoolTensor) -> torch.BoolTensor:
    """Move each row's valid entries to the right end (holes become left padding) and drop the columns that are
    holes in every row. Returns the new validity mask.

    Args:
        cache (`DynamicCache`): the target's cache.
        valid (`torch.BoolTensor` [B, T]): which entries of each row are real.
    """
    length = int(valid.sum(-1).max())
    # Stable order: holes first, then the valid entries in their order; keep the last `length` of them.
    order = torch.sort(valid.long(), dim=-1, stable=True).indices[:, -length:]
    gather_entries(cache, order, 0)
    return valid.gather(1, order)


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
