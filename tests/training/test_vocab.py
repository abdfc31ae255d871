"""The draft vocabulary (:mod:`hf_eagle3.training.vocab`): the most frequent target tokens mapped by ``d2t`` / ``t2d``,
the mapping checked for consistency, and a trained draft remapped to another vocabulary."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import tiny_draft, tiny_target

from hf_eagle3.training.vocab import build_vocab_mapping, check_vocab_mapping, count_tokens, coverage


def test_vocab_mapping_toy_corpus():
    counts = count_tokens([[5, 5, 2, 9], [5, 9, 2, 1], [5, 9, 2]])  # 5:4, 2:3, 9:3, 1:1
    d2t, t2d = build_vocab_mapping(counts, 3, 12)
    used = torch.arange(3) + d2t
    assert used.tolist() == [2, 5, 9]  # the 3 most frequent, sorted ascending
    assert d2t.tolist() == [2, 4, 7]  # d2t[i] = used[i] - i
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]
    assert coverage(counts, d2t) == pytest.approx(10 / 11)
    # ties broken by the smaller id; unseen ids fill a vocabulary larger than the corpus
    d2t, _ = build_vocab_mapping(Counter({7: 2, 3: 2, 4: 1}), 2, 10)
    assert (torch.arange(2) + d2t).tolist() == [3, 7]
    d2t, t2d = build_vocab_mapping(Counter({7: 2}), 3, 10)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 7] and int(t2d.sum()) == 3


def test_vocab_mapping_consistency_check():
    d2t, t2d = build_vocab_mapping(Counter({1: 3, 4: 2, 6: 1}), 3, 8)
    bad = t2d.clone()
    bad[0] = True
    with pytest.raises(ValueError, match="t2d"):
        check_vocab_mapping(d2t, bad)
    with pytest.raises(ValueError, match="increasing"):
        check_vocab_mapping(torch.tensor([4, 0, 0]), t2d)
    with pytest.raises(ValueError, match="outside"):
        build_vocab_mapping(Counter({99: 1}), 1, 8)


def test_remap_draft_vocab_keeps_trained_rows_and_takes_new_ones_from_the_target():
    """``train --init-draft --rebuild-vocab``: tokens both vocabularies hold keep the draft's trained output rows
    (their scores do not move), new tokens start from the target's rows, and the mapping is consistent."""
    from hf_eagle3.training.vocab import remap_draft_vocab

    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab_size=64).float()
    old_used = (torch.arange(64) + draft.d2t).tolist()
    shared = old_used[:40]
    fresh = [t for t in range(4, 256) if t not in old_used][:30]
    counts = Counter({t: 100 for t in shared} | {t: 50 for t in fresh})
    d2t, t2d = build_vocab_mapping(counts, 70, 256)
    features = torch.randn(1, 3, 3 * 64)
    ids = torch.tensor([[5, 6, 7]])
    draft.bind_target(target)
    before = draft(input_ids=ids, target_features=features).logits[0, -1]
    old_rows = {t: draft.lm_head.weight[i].clone() for i, t in enumerate(old_used)}
    head = target.lm_head.weight.detach()
    rows = remap_draft_vocab(draft, d2t, t2d, head)
    new_used = (torch.arange(70) + d2t).tolist()
    assert rows == {"kept": 40, "new": 30, "mapped": False} and draft.config.draft_vocab_size == 70 and draft.lm_head.out_features == 70
    check_vocab_mapping(draft.d2t, draft.t2d)
    for i, t in enumerate(new_used):
        expected = old_rows[t] if t in old_rows else head[t]
        torch.testing.assert_close(draft.lm_head.weight[i], expected, rtol=0, atol=0)
    after = draft(input_ids=ids, target_features=features).logits[0, -1]
    for t in shared:  # the same hidden state, the same row: the same score
        torch.testing.assert_close(after[new_used.index(t)], before[old_used.index(t)], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="same target"):
        remap_draft_vocab(draft, *build_vocab_mapping(Counter({5: 1}), 10, 300), head)


def test_remap_draft_vocab_maps_new_rows_like_the_trained_ones():
    """With enough kept rows, a new token's row is the target's row through the map that takes the kept tokens'
    target rows to their trained rows: exact when training moved every row by one linear map."""
    from hf_eagle3.training.vocab import remap_draft_vocab

    target = tiny_target("llama")
    head = target.lm_head.weight.detach()
    draft = tiny_draft(target, draft_vocab_size=160).float()
    old_used = (torch.arange(160) + draft.d2t).tolist()
    turn = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) / 8
    with torch.no_grad():  # "training" turned and scaled every row the same way
        draft.lm_head.weight.copy_(head[old_used] @ turn)
    fresh = [t for t in range(256) if t not in old_used][:40]
    d2t, t2d = build_vocab_mapping(Counter({t: 100 for t in old_used} | {t: 50 for t in fresh}), 200, 256)
    rows = remap_draft_vocab(draft, d2t, t2d, head)
    assert rows == {"kept": 160, "new": 40, "mapped": True}
    new_used = (torch.arange(200) + d2t).tolist()
    for t in fresh:
        torch.testing.assert_close(draft.lm_head.weight[new_used.index(t)], head[t] @ turn, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(draft.lm_head.weight[new_used.index(t)], head[t], atol=1e-2)
