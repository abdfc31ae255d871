"""The target's cache in hf-eagle3's loops (trees and batches): after the prefill its full-attention layers live in
buffers preallocated for the call (:class:`PreallocatedLayer`), so a round writes only its new entries.

Checked: every round of a tree call and of a batched call writes into the same buffers (no reallocation, no copy of
the cache); the cache a tree call returns holds what plain ``generate``'s holds for the same sequence; a layer grows
past its capacity, adopts rows selected out of it, and starts again after a reset; sliding-window layers keep their
own storage. Lossless decoding on these caches is the subject of ``test_tree.py`` and ``test_batched.py``.
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
