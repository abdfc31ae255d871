"""The acceptance step as pure functions (``hf_eagle3.core.acceptance``) and the batched cache helpers
(``hf_eagle3.core.target_cache``), each on its own: hand-built trees and logits, hand-built caches."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_eagle3.core import acceptance
from hf_eagle3.core.acceptance import (
    children_lists,
    clip_new_tokens,
    round_planes,
    sample_among_children,
    sampling_decisions,
    walk_planes,
    walk_tree,
)
from hf_eagle3.core.target_cache import batch_tree_mask, compact, gather_entries, keep_rows
from hf_eagle3.core.tree_candidates import DraftTree

V = 8


def one_hot_logits(choices: list[int]) -> torch.Tensor:
    """Logits [n, V] whose argmax at node i is ``choices[i]``."""
    logits = torch.zeros(len(choices), V)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


# root 0 -> children 1 (token 3), 2 (token 4); node 1 -> child 3 (token 5); node 2 -> child 4 (token 6)
TOKENS, PARENTS = [7, 3, 4, 5, 6], [0, 0, 0, 1, 2]


def test_children_in_candidate_order():
    assert children_lists(PARENTS) == [[1, 2], [3], [4], [], []]


@pytest.mark.parametrize(("choices", "accepted", "bonus"), [
    ([4, 0, 6, 0, 2], [2, 4], 2),   # second child, then its child, then the target's own token at node 4
    ([3, 5, 0, 1, 0], [1, 3], 1),   # first child and its child
    ([1, 0, 0, 0, 0], [], 1),       # nothing accepted: the bonus at the root
])
def test_greedy_walk(choices, accepted, bonus):
    logits = one_hot_logits(choices)
    for argmax in (None, choices):  # computed from the logits, or given
        walk = walk_tree(TOKENS, PARENTS, logits, do_sample=False, argmax=argmax)
        assert walk.accepted == accepted and walk.bonus == bonus
        assert len(walk.scores) == len(walk.logits) == len(accepted) + 1


def test_greedy_walk_processes_each_node_with_its_own_path():
    seen = []

    def process(path, row):
        seen.append(list(path))
        return row

    walk_tree(TOKENS, PARENTS, one_hot_logits([4, 0, 6, 0, 2]), do_sample=False, process=process)
    assert seen == [[], [4], [4, 6]]


def test_sampled_walk_accepts_a_sure_child_and_never_an_impossible_one():
    logits = torch.full((5, V), -1e9)
    logits[0, 4] = 0.0  # the target at the root is sure of token 4: child 2
    logits[2, 1] = 0.0  # at node 2 it is sure of token 1: not node 4's token 6
    for seed in range(20):
        torch.manual_seed(seed)
        walk = walk_tree(TOKENS, PARENTS, logits, do_sample=True)
        assert walk.accepted == [2] and walk.bonus == 1


def test_sampled_walk_from_device_decisions_accepts_a_sure_child_and_never_an_impossible_one():
    logits = torch.full((5, V), -1e9)
    logits[0, 4] = 0.0
    logits[2, 1] = 0.0
    tree = DraftTree(tokens=torch.tensor(TOKENS), parents=torch.tensor(PARENTS), depths=torch.tensor([0, 1, 1, 2, 2]),
                     ancestors=torch.eye(5, dtype=torch.bool), scores=torch.zeros(4), max_depth=2)
    for seed in range(20):
        torch.manual_seed(seed)
        planes, processed = round_planes(tree, logits, True, None)
        assert planes.shape == (5, 5)
        walk = walk_planes(planes.tolist(), logits, True, processed)
        assert walk.accepted == [2] and walk.bonus == 1 and len(walk.scores) == 2


@pytest.mark.parametrize("children", [[1, 3, 4], [2], []])
def test_device_decisions_keep_the_target_distribution(children):
    """The token a node yields (its accepted child's, else the residual sample) is distributed as the target's
    distribution there, as with the host-side :func:`sample_among_children`; a rule that always accepts the first
    child (the negative control) is told apart."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(V) * 1.5, -1)
    tokens, parents = torch.tensor([0] + children), torch.zeros(len(children) + 1, dtype=torch.long)
    device, host, broken = torch.zeros(V), torch.zeros(V), torch.zeros(V)
    for _ in range(4000):
        first, residual = sampling_decisions(probs.expand(len(tokens), V).contiguous(), tokens, parents)[:, 0].tolist()
        device[tokens[first] if first >= 0 else residual] += 1
        index, bonus = sample_among_children(probs, children)
        host[children[index] if index is not None else bonus] += 1
        broken[children[0] if children else bonus] += 1
    for counts in (device, host):
        assert (counts / counts.sum() - probs).abs().max() < 0.03
    if children:
        assert (broken / broken.sum() - probs).abs().max() > 0.1


def test_clip_new_tokens():
    assert clip_new_tokens([5, 6, 7], room=10, eos=set()) == [5, 6, 7]
    assert clip_new_tokens([5, 6, 7], room=2, eos=set()) == [5, 6]
    assert clip_new_tokens([5, 2, 7], room=10, eos={2}) == [5, 2]
    assert clip_new_tokens([5, 6, 2], room=2, eos={2}) == [5, 6]
    assert clip_new_tokens([5], room=0, eos=set()) == []


# ------------------------------------------------------------------------------------------------ batched cache
def cache_of(keys: torch.Tensor) -> DynamicCache:
    """A one-layer DynamicCache holding ``keys`` [B, 1, T, 1] (values = keys + 100)."""
    cache = DynamicCache()
    cache.update(keys, keys + 100, 0)
    return cache


def entries(cache) -> list:
    return cache.layers[0].keys[:, 0, :, 0].tolist()


def test_gather_entries_keeps_each_rows_own_nodes_in_place():
    cache = cache_of(torch.arange(12.0).view(2, 1, 6, 1))  # rows: 0..5 and 6..11; the last 3 are a round's
    gather_entries(cache, torch.tensor([[0, 2], [1, 1]]), 3)
    assert entries(cache) == [[0, 1, 2, 3, 5], [6, 7, 8, 10, 10]]
    assert (cache.layers[0].values - cache.layers[0].keys == 100).all()


def test_compact_moves_valid_entries_right_and_drops_shared_holes():
    cache = cache_of(torch.arange(12.0).view(2, 1, 6, 1))
    valid = torch.tensor([[False, True, False, True, True, False], [True, True, False, True, False, False]])
    out = compact(cache, valid)
    assert out.tolist() == [[True, True, True], [True, True, True]]
    assert entries(cache) == [[1, 3, 4], [6, 7, 9]]
    uneven = cache_of(torch.arange(8.0).view(2, 1, 4, 1))
    out = compact(uneven, torch.tensor([[True, False, True, True], [False, True, False, False]]))
    assert out.tolist() == [[True, True, True], [False, False, True]]
    assert entries(uneven)[0] == [0, 2, 3] and entries(uneven)[1][2] == 5  # holes hold anything


def test_keep_rows():
    cache = cache_of(torch.arange(12.0).view(3, 1, 4, 1))
    keep_rows(cache, torch.tensor([2, 0]))
    assert entries(cache) == [[8, 9, 10, 11], [0, 1, 2, 3]]


def test_batch_tree_mask():
    cache = cache_of(torch.zeros(2, 1, 3, 1))
    valid = torch.tensor([[False, True, True], [True, False, True]])
    chain = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]),
                      torch.tril(torch.ones(3, 3, dtype=torch.bool)), None, 2)
    root = DraftTree.root_only(torch.tensor([5]))
    mask = batch_tree_mask(cache, valid, [chain, root], 3, torch.float32)
    allowed = mask[:, 0] == 0
    assert mask.shape == (2, 1, 3, 6)
    assert allowed[0].tolist() == [[False, True, True, True, False, False],
                                   [False, True, True, True, True, False],
                                   [False, True, True, True, True, True]]
    assert allowed[1].tolist() == [[True, False, True, True, False, False],  # the root
                                   [True, False, True, False, True, False],  # padding nodes see themselves only
                                   [True, False, True, False, False, True]]


def test_read_back_returns_the_planes_and_the_probabilities_in_one_transfer(monkeypatch):
    planes = torch.arange(24).view(2, 3, 4)
    probs = torch.tensor([0.9, 0.5, 0.123456789, 0.0], dtype=torch.float64)
    transfers = []
    original = torch.Tensor.tolist

    def counted(self):
        transfers.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    host, back = acceptance.read_back(planes, probs)
    assert len(transfers) == 1
    assert host == original(planes)
    assert back == pytest.approx(original(probs), abs=1 / acceptance.PROBABILITY_SCALE)
    one_row, none = acceptance.read_back(planes[0])
    assert one_row == original(planes[0]) and none is None
    ranking = torch.stack([probs, torch.tensor([1.0, 3.0, 2.0, 5.0], dtype=torch.float64)])
    host, back = acceptance.read_back(planes, ranking)
    assert host == original(planes) and back[1] == [1.0, 3.0, 2.0, 5.0]
    assert back[0] == pytest.approx(original(probs), abs=1 / acceptance.PROBABILITY_SCALE)
