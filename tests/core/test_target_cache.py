"""The target's cache in hf-eagle3's loops (trees and batches): after the prefill its full-attention layers live in
buffers preallocated for the call (:class:`PreallocatedLayer`), so a round writes only its new entries.

Checked: every round of a tree call and of a batched call writes into the same buffers (no reallocation, no copy of
the cache); the cache a tree call returns holds what plain ``generate``'s holds for the same sequence; a layer grows
past its capacity, adopts rows selected out of it, and starts again after a reset; sliding-window layers keep their
own storage. Lossless decoding on these caches is the subject of ``test_tree_decoding.py`` and ``test_batched_decoding.py``.
"""

from __future__ import annotations

import torch
from conftest import cached_draft, cached_target, random_prompt, tiny_draft, tiny_target
from transformers import DynamicCache

from hf_eagle3.core import target_cache
from hf_eagle3.core.target_cache import PreallocatedLayer, gather_entries, keep_rows

TREE = dict(tree_top_k=3, tree_depth=4, tree_total_tokens=8)


def watch_buffers(monkeypatch):
    """Record the buffer addresses of every preallocated layer at each target forward of the loops."""
    seen = []
    original = PreallocatedLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        result = original(self, key_states, value_states, *args, **kwargs)
        seen.append((id(self), self._key_buffer.data_ptr(), self._value_buffer.data_ptr(), self.capacity))
        return result

    monkeypatch.setattr(PreallocatedLayer, "update", update)
    return seen


def test_tree_rounds_write_into_the_preallocated_buffers(monkeypatch):
    target, draft = cached_target("llama"), cached_draft("llama")
    seen = watch_buffers(monkeypatch)
    ids = random_prompt(10, seed=1)
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=30,
                          return_dict_in_generate=True, **TREE)
    layers = {entry[0] for entry in seen}
    assert len(layers) == target.config.num_hidden_layers
    assert len(seen) >= 20 * len(layers)  # every round's verify forward went through them
    for layer in layers:
        addresses = {entry[1:] for entry in seen if entry[0] == layer}
        assert len(addresses) == 1  # the same buffers every round: nothing reallocated
    cache = out.past_key_values
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    assert all(layer.capacity >= ids.shape[1] + 30 for layer in cache.layers)
    # What it holds is plain generate's cache for the same sequence.
    plain = target.generate(ids, do_sample=False, max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(plain.sequences, out.sequences)
    for ours, theirs in zip(cache.layers, plain.past_key_values.layers):
        assert ours.keys.shape == theirs.keys.shape
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-5)


def test_batched_rounds_write_into_the_preallocated_buffers(monkeypatch):
    target, draft = cached_target("llama"), cached_draft("llama")
    seen = watch_buffers(monkeypatch)
    ids = torch.randint(4, 256, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=16,
                          num_assistant_tokens=3)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))
    for layer in {entry[0] for entry in seen}:
        assert len({entry[1:] for entry in seen if entry[0] == layer}) == 1


def test_layer_grows_adopts_selected_rows_and_resets():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    layer = PreallocatedLayer(keys, values, capacity=8)
    assert layer.capacity == 8 and torch.equal(layer.keys, keys) and layer.get_seq_length() == 5
    new_k, new_v = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    k, v = layer.update(new_k, new_v)
    assert torch.equal(k, torch.cat([keys, new_k], dim=2)) and torch.equal(v, torch.cat([values, new_v], dim=2))
    more_k, more_v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    k, _ = layer.update(more_k, more_v)  # 10 > 8: grows
    assert layer.capacity >= 12 and torch.equal(k, torch.cat([keys, new_k, more_k], dim=2))
    # A row selection (a finished row leaves the batch) hands the layer other tensors: adopted at the next update.
    cache = DynamicCache()
    cache.layers = [layer]
    keep_rows(cache, torch.tensor([1]))
    k, _ = layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert k.shape == (1, 2, 11, 4) and torch.equal(k[0, :, :5], keys[1]) and k[0, :, 10].abs().sum() == 0
    assert k.data_ptr() == layer._key_buffer.data_ptr()
    # The in-place gathers keep the views: the next update appends after the kept entries.
    gather_entries(cache, torch.tensor([[0, 1]]), 8)  # keep 2 of the last 3 entries
    assert layer.get_seq_length() == 10
    k, _ = layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert k.shape[2] == 11 and k[0, :, 10].eq(1).all()
    layer.reset()
    k, _ = layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    assert k.shape == (1, 2, 3, 4) and layer.get_seq_length() == 3


def test_sliding_window_layers_keep_their_own_storage():
    target = tiny_target("gemma3")
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    ids = random_prompt(10, seed=3)
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=30,
                          return_dict_in_generate=True, **TREE)
    kinds = {type(layer).__name__ for layer in out.past_key_values.layers}
    assert kinds == {"PreallocatedLayer", "DynamicSlidingWindowLayer"}
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
    assert target_cache.sliding_window(out.past_key_values) == 16


VIEWS = {"aten.view.default", "aten.slice.Tensor", "aten.select.int", "aten.alias.default", "aten.detach.default",
         "aten.lift_fresh.default", "aten.expand.default", "aten.unsqueeze.default"}


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten operations run inside the block that are more than views (kernels)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in VIEWS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _filled_cache(num_layers: int, rows: int = 1, length: int = 6, seed: int = 0):
    """A cache of ``num_layers`` full-attention layers after a prefill of ``length`` entries, preallocated."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(num_layers):
        cache.update(torch.randn(rows, 2, length, 4, generator=generator),
                     torch.randn(rows, 2, length, 4, generator=generator), i)
    target_cache.preallocate(cache, capacity=32)
    return cache


def _round(cache, nodes: int, seed: int = 1):
    """A verify forward of ``nodes`` entries per layer; returns every layer's keys and values after it (copies)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        rows = layer.keys.shape[0]
        layer.update(torch.randn(rows, 2, nodes, 4, generator=generator), torch.randn(rows, 2, nodes, 4,
                                                                                       generator=generator))
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_one_commit_for_all_layers():
    counts = {}
    for num_layers in (2, 7):
        cache = _filled_cache(num_layers)
        assert target_cache.pooled(cache) is not None
        before = _round(cache, nodes=5)
        with _Ops() as ops:
            target_cache.gather_cache(cache, [0, 2, 3], 5)
        counts[num_layers] = len(ops.ops)
        for layer, (keys, values) in zip(cache.layers, before):  # what a per-layer gather keeps
            assert torch.equal(layer.keys, torch.cat([keys[:, :, :6], keys[:, :, [6, 8, 9]]], dim=2))
            assert torch.equal(layer.values, torch.cat([values[:, :, :6], values[:, :, [6, 8, 9]]], dim=2))
        _round(cache, nodes=2, seed=3)  # the next round appends after the kept entries
        assert all(layer.keys.shape[2] == 11 and layer.owns_views() for layer in cache.layers)
    assert counts[2] == counts[7] <= 4, counts  # the index, its offset, one gather, one copy


def test_no_move_when_the_path_is_in_order():
    cache = _filled_cache(3)
    before = _round(cache, nodes=4)
    with _Ops() as ops:
        target_cache.gather_cache(cache, [0, 1], 4)
    assert ops.ops == []  # no kernel at all
    for layer, (keys, _) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys[:, :, :8])


def test_pooled_batch_gathers_match_layer_by_layer():
    counts = {}
    for num_layers in (2, 5):
        pooled, alone = _filled_cache(num_layers, rows=3), _filled_cache(num_layers, rows=3)
        for layer in alone.layers:  # the same entries in buffers of each layer's own
            layer._adopt(layer.keys, layer.values, layer.capacity)
        assert target_cache.pooled(pooled) is not None and target_cache.pooled(alone) is None
        for cache in (pooled, alone):
            _round(cache, nodes=3)
        index = torch.tensor([[0, 2], [1, 1], [2, 0]])
        with _Ops() as ops:
            gather_entries(pooled, index, 6)
        counts[num_layers] = len(ops.ops)
        gather_entries(alone, index, 6)
        keep_rows(pooled, torch.tensor([2, 0]))
        keep_rows(alone, torch.tensor([2, 0]))
        for cache in (pooled, alone):
            _round(cache, nodes=1, seed=4)
        for ours, theirs in zip(pooled.layers, alone.layers):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert target_cache.pooled(pooled) is not None  # the row selection kept the pool
    assert counts[2] == counts[5], counts


def test_a_pooled_layer_growing_grows_the_pool():
    cache = _filled_cache(3)
    pool = target_cache.pooled(cache)
    before = _round(cache, nodes=30)  # 36 > 32 columns
    assert target_cache.pooled(cache) is pool and pool.capacity >= 36
    for layer, (keys, values) in zip(cache.layers, before):
        assert layer.pool is pool and torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
