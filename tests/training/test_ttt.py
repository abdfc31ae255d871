"""Training-time test (:mod:`hf_eagle3.training.ttt`): its attention equals masked SDPA, its unrolled steps equal
inference, its loss equals a direct computation with masking and target temperature, and sliding-window drafts train
where the window does not bind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_draft, tiny_target

import hf_eagle3
from hf_eagle3.training.ttt import ConcatKVCache, TTTAttention, ttt_attention_mask, ttt_forward, ttt_loss


def test_ttt_attention_equals_masked_sdpa():
    torch.manual_seed(0)
    att, ref = TTTAttention(), ConcatKVCache()
    for step in range(4):
        q = torch.randn(2, 4, 6, 8)
        k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        out = att.attend(q, k, v)
        keys, values = ref.update(k, v)
        expected = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ttt_attention_mask(6, step), enable_gqa=True
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _bound_draft(vocab=64, dv=32, hidden=32, seed=0):
    target = tiny_target("llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4)
    draft = tiny_draft(target, dv, seed=seed)
    draft.bind_target(target)
    return target, draft


def test_training_time_test_matches_inference():
    """Step k of the unrolled TTT at base t == the draft's (k+1)-th step at inference after real features up to t."""
    torch.manual_seed(0)
    _, draft = _bound_draft()
    n, T = 9, draft.config.target_hidden_size
    feats = torch.randn(1, n, 3 * T)
    ids = torch.randint(0, 64, (1, n))
    steps = ttt_forward(draft, feats, ids, ttt_length=3)
    for t in range(n - 1):
        cache = hf_eagle3.Eagle3KVCache()
        out = draft(input_ids=ids[:, 1 : t + 2], target_features=feats[:, : t + 1], cache=cache)
        torch.testing.assert_close(out.hidden_states[:, -1], steps[0][:, t], atol=1e-5, rtol=1e-4)
        h = out.hidden_states[:, -1:]
        for k in range(1, 3):
            if t + 1 + k >= n:
                break
            out = draft(input_ids=ids[:, t + 1 + k : t + 2 + k], hidden_states=h, cache=cache,
                        position_ids=torch.tensor([[t + k]]))
            torch.testing.assert_close(out.hidden_states[:, -1], steps[k][:, t], atol=1e-5, rtol=1e-4)
            h = out.hidden_states


def test_ttt_loss_matches_direct_computation_and_masking():
    torch.manual_seed(1)
    _, draft = _bound_draft()
    b, n, T, dv = 2, 7, draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits = torch.randn(b, n, dv)
    mask = (torch.rand(b, n) > 0.4).float()
    mask[:, -1] = 0
    loss, stats = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3, step_decay=0.8)
    steps = ttt_forward(draft, feats, ids, 3)
    expected = 0.0
    for k in range(3):
        terms, hits = [], []
        for r in range(b):
            for t in range(n - 1):
                pos = t + 1 + k  # step k at base t is trained on the target's distribution at position t+1+k
                if pos < n and mask[r, pos] > 0:
                    p = tlogits[r, pos].softmax(-1)
                    logq = draft.compute_logits(steps[k][r, t]).log_softmax(-1)
                    terms.append(-(p * logq).sum())
                    hits.append(float(logq.argmax() == p.argmax()))
        assert stats["count"][k] == len(terms)
        if terms:
            expected = expected + 0.8**k * torch.stack(terms).mean()
            assert stats["acc"][k] == pytest.approx(sum(hits) / len(hits))
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=loss.dtype), atol=1e-4, rtol=1e-4)
    # a fully masked batch contributes nothing
    zero, stats0 = ttt_loss(draft, feats, ids, tlogits, torch.zeros(b, n), ttt_length=3)
    assert float(zero.detach()) == 0.0 and stats0["count"] == [0.0, 0.0, 0.0]
    zero.backward()  # and still backpropagates (a training step on it must not fail), with zero gradients everywhere
    grads = [q.grad for q in draft.parameters() if q.requires_grad]
    assert grads and all(g is not None and not g.any() for g in grads)


def test_sliding_window_drafts_train_where_the_window_does_not_bind():
    """A sliding-window draft (speculators' default layout) computes on sequences shorter than its window what a
    full-attention one does, so it trains and evaluates exactly; where the window would bind, a clear error."""
    torch.manual_seed(3)
    _, draft = _bound_draft()
    b, n, T, dv = 2, 9, draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits, mask = torch.randn(b, n, dv), torch.ones(b, n)
    full, _ = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3)
    # step k at base position t sits at position t + k and attends position 0: at most (n - 2) + 2 = 9 apart
    draft.midlayer.self_attn.sliding_window = n + 1
    windowed, _ = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3)
    torch.testing.assert_close(windowed, full)
    draft.midlayer.self_attn.sliding_window = n  # 9 apart: the window binds
    with pytest.raises(ValueError, match=r"sliding window \(9\) binds on these sequences \(8 positions, step 3\)"):
        ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3)


def test_ttt_loss_target_temperature_sharpens_the_soft_labels():
    torch.manual_seed(2)
    _, draft = _bound_draft()
    b, n, T, dv = 2, 6, draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits, mask = torch.randn(b, n, dv), torch.ones(b, n)
    mask[:, -1] = 0
    ref, ref_stats = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2)
    # temperature T on the labels == the reference loss on logits / T
    half, half_stats = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2, target_temperature=0.5)
    torch.testing.assert_close(half, ttt_loss(draft, feats, ids, 2 * tlogits, mask, ttt_length=2)[0])
    assert not torch.allclose(half, ref) and half_stats["acc"] == ref_stats["acc"]  # accuracy is the argmax's
    # towards 0 the labels become one-hot on the target's argmax: cross-entropy on it
    cold, _ = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2, target_temperature=1e-4)
    hard = 1e4 * F.one_hot(tlogits.argmax(-1), dv).float()
    torch.testing.assert_close(cold, ttt_loss(draft, feats, ids, hard, mask, ttt_length=2)[0])
    with pytest.raises(ValueError, match="target_temperature"):
        ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2, target_temperature=0.0)
