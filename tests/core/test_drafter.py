"""The batch drafter drafts, for every row at once, what each row gets drafted alone.

Rows of different lengths are fed ragged blocks (each row's positions at its own columns of the row cache), rounds
that draft nothing leave their blocks pending (merged at the next feed), and rows leave the batch; at every round
each row's tree (tokens, parents, depths, ancestors) equals the one a sequential reference builds for that row alone
(the chain's draft state: the draft's own cache, causal feeds, a 2D tree mask per level), and every tree is closed
under parents. Sliding-window drafts and drafts with a smaller vocabulary are included.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig
from conftest import cached_target, tiny_draft

from hf_eagle3.core.drafter import Eagle3Drafter
from hf_eagle3.core.draft_state import Eagle3DraftState
from hf_eagle3.core.logits_process import Eagle3D2TLogitsProcessor
from hf_eagle3.core.draft_round import feed_width
from hf_eagle3.core.tree_candidates import grow_candidates, select_nodes, select_trees, trees_from


def decisive_draft(**overrides):
    """A random draft whose scores are spread out (no near-ties for top-k to break differently by rounding)."""
    target = cached_target("llama")
    draft = tiny_draft(target, **overrides)
    draft.bind_target(target)
    with torch.no_grad():
        draft.lm_head.weight.mul_(40.0)
        draft.fc.weight.mul_(4.0)
    return draft


class Alone:
    """One row drafted alone, the reference: the chain's draft state feeds it causally on the draft's own cache, and
    each tree level attends over the fed positions, its ancestors and itself (a 2D mask)."""

    def __init__(self, draft):
        self.draft, self.state = draft, Eagle3DraftState(draft)
        self.d2t = Eagle3D2TLogitsProcessor(draft.d2t, draft.config.vocab_size)

    def tree(self, depth, top_k, total, root):
        out = self.state.feed()
        real = self.state.fed

        def step(ids, hidden, level, ancestors):
            k = ids.shape[1]
            mask = torch.cat([torch.ones(k, real, dtype=torch.bool), ancestors[0], torch.eye(k, dtype=torch.bool)], -1)
            return self.draft(input_ids=self.d2t.map_tokens(ids), hidden_states=hidden.contiguous(),
                              position_ids=torch.full((1, k), real - 1 + level), cache=self.state.cache,
                              attention_mask=mask)

        candidates = grow_candidates(out.logits[:, -1], out.hidden_states[:, -1:], depth, top_k, step)
        tree = select_trees(candidates, root.view(1), total, self.d2t)[0]
        self.state.crop()  # the tree's entries go
        return tree


def assert_closed(tree):
    parents, depths, ancestors = tree.parents.tolist(), tree.depths.tolist(), tree.ancestors.tolist()
    for i in range(1, len(parents)):
        assert parents[i] < i and depths[i] == depths[parents[i]] + 1, (parents, depths)
        chain, j = {i}, i
        while j:
            j = parents[j]
            chain.add(j)
        assert {c for c, seen in enumerate(ancestors[i]) if seen} == chain, (i, parents, ancestors[i])


def assert_same_tree(batched, alone):
    assert_closed(batched)
    for name in ("tokens", "parents", "depths", "ancestors"):
        assert torch.equal(getattr(batched, name), getattr(alone, name)), name
    assert batched.max_depth == alone.max_depth


def padded(blocks: list) -> tuple:
    """Right-pad per-row ``(features [f, 3T], tokens [f])`` into one block."""
    width = max(t.shape[0] for _, t in blocks)
    features = torch.zeros(len(blocks), width, blocks[0][0].shape[-1])
    tokens = torch.zeros(len(blocks), width, dtype=torch.long)
    for b, (f, t) in enumerate(blocks):
        features[b, : t.shape[0]], tokens[b, : t.shape[0]] = f, t
    return features, tokens, [t.shape[0] for _, t in blocks]


@pytest.mark.parametrize("drafting", ["steps", "captured"])
@pytest.mark.parametrize("shape", [(4, 1, 4), (4, 3, 8), (3, 4, 12)], ids=["chain", "tree", "wide"])
@pytest.mark.parametrize("overrides", [{}, {"draft_vocab_size": 48}, {"draft_sliding_window": 6}],
                         ids=["full", "small-vocab", "window"])
def test_batch_trees_equal_each_row_drafted_alone(shape, overrides, drafting):
    """``steps``: feed, expand and select, eagerly; ``captured``: each round one compiled region (static drafting
    steps, dynamo's graph capture with ``fullgraph=True``: a graph break or a host read inside fails), its feeds
    padded to buckets or, wider than every bucket (the first feed here, 20 positions), fed eagerly first."""
    depth, top_k, total = shape
    vocab_size = overrides.pop("draft_vocab_size", None)
    draft = decisive_draft(draft_vocab_size=vocab_size, **overrides)
    width = 3 * draft.config.target_hidden_size
    g = torch.Generator().manual_seed(0)
    rows = 4
    alone = [Alone(draft) for _ in range(rows)]
    if drafting == "captured":
        torch.compiler.reset()  # graphs of the other cases' drafts go (each new draft compiles its own)
        draft.generation_config.compile_config = CompileConfig(backend="aot_eager", mode="reduce-overhead",
                                                               fullgraph=True)
    batch = Eagle3Drafter(draft, rows, capacity=8)  # small: the row cache must grow (steps)
    draft.generation_config.compile_config = None
    assert (batch.whole_round is not None) == (drafting == "captured")
    live = list(range(rows))  # which of the original rows the batch still holds, in its order
    feeds = [[9, 3, 20, 1], [2, 5, 1, 4], [1, 1, 3, 2], [5, 2, 2, 1], [3, 1, 4, 2], [2, 2, 1, 3]]
    for step, counts in enumerate(feeds):
        blocks = [(torch.randn(counts[r], width, generator=g), torch.randint(0, 256, (counts[r],), generator=g))
                  for r in live]
        for r, (f, t) in zip(live, blocks):
            alone[r].state.add(f[None], t)
        batch.add(*padded(blocks))
        if step == 2:  # a round that drafts nothing: the blocks wait and are merged with the next
            continue
        if step == 4:  # the second row finishes and leaves the batch
            keep = [i for i, r in enumerate(live) if r != 1]
            batch.keep_rows(keep)
            live = [live[i] for i in keep]
        roots = torch.randint(0, 256, (len(live),), generator=g)
        trees = batch.draft_round(roots, depth, top_k, total).trees
        for r, tree, root in zip(live, trees, roots):
            assert_same_tree(tree, alone[r].tree(depth, top_k, total, root))
        assert batch.fed == [alone[r].state.fed for r in live]
    if drafting == "captured":  # the first feed ran eagerly, every later one inside its region, padded
        widths = {bucket[1] for bucket in batch.buckets}
        assert 0 in widths and widths - {0} and all(w >= feed_width(1, depth) for w in widths - {0})


@pytest.mark.parametrize("seed", range(4))
def test_a_smaller_selection_is_a_prefix_of_a_larger_one(seed):
    """Nodes best first: the tree of the ``m`` best candidates is the first ``m + 1`` nodes of the tree of the ``n``
    best, ties included (scores drawn from few values, some ``-inf``), so a captured round can select a bucket's
    nodes and cut."""
    g = torch.Generator().manual_seed(seed)
    k, levels, rows = 3, 4, 2
    m = k + (levels - 1) * k * k
    scores = torch.randint(-3, 0, (rows, m), generator=g).float()
    scores[:, 5] = float("-inf")
    first = [1] + [1 + k + i * k * k for i in range(levels)]  # each level's first candidate number
    parents = torch.cat([torch.zeros(rows, k, dtype=torch.long)]  # each child of a node of the level before
                        + [torch.randint(first[i], first[i + 1], (rows, k * k), generator=g) for i in range(levels - 1)],
                        dim=1)
    depths = torch.cat([torch.full((k,), 1)] + [torch.full((k * k,), i + 2) for i in range(levels - 1)])
    for _ in range(levels):  # children never above their parents (level by level)
        scores = torch.where(parents > 0, torch.minimum(scores, scores.gather(1, (parents - 1).clamp(min=0))), scores)
    ids = torch.randint(0, 50, (rows, m), generator=g)
    d2t = Eagle3D2TLogitsProcessor(torch.zeros(50, dtype=torch.long), 50)
    candidates = (scores, ids, parents, depths, levels)
    roots = torch.tensor([7, 8])
    full = select_nodes(candidates, roots, m, d2t)
    for n in (1, 2, 5, 8, 16, m):
        for tree, cut in zip(select_trees(candidates, roots, n, d2t), trees_from(full, n, min(n, levels))):
            assert_closed(tree)
            assert_same_tree(cut, tree)


def test_row_cache_refuses_another_window_and_a_forward_without_placement():
    from hf_eagle3.core.draft_cache import Eagle3RowCache

    cache = Eagle3RowCache(rows=1, capacity=4, window=8)
    q = k = v = torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="place"):
        cache.attend(q, k, v, window=8)
    cache.place_shared(0, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding window of 8"):
        cache.attend(q, k, v, window=None)
