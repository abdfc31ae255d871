"""Eagle3DraftState, the draft's view of the verified sequence shared by chain and tree drafting: what it collects
from the capture, and that a feed (deferred or not) is the draft's forward over exactly those positions."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_draft, tiny_target

from hf_eagle3.core.draft_state import Eagle3DraftState
from hf_eagle3.core.draft_steps import chain_step


class FakeCapture:
    """Holds the features of one 'target forward' until cleared."""

    def __init__(self, features):
        self._features = features

    def features(self, device, dtype):
        return None if self._features is None else self._features.to(device=device, dtype=dtype)

    def clear(self):
        self._features = None


def state_and_inputs(n=9):
    target = tiny_target("llama")
    draft = tiny_draft(target, 48)
    draft.bind_target(target)
    torch.manual_seed(0)
    features = torch.randn(1, n, 3 * target.config.hidden_size)
    tokens = torch.randint(0, target.config.vocab_size, (n,))
    return Eagle3DraftState(draft), draft, features, tokens


def test_deferred_feed_equals_one_forward():
    state, draft, features, tokens = state_and_inputs()
    with torch.no_grad():
        reference = draft(input_ids=tokens[None], target_features=features, logits_to_keep=1).logits
        state.collect(FakeCapture(features[:, :4]), tokens[:4], end=4)
        capture = FakeCapture(features[:, 4:])
        state.collect(capture, tokens[4:], end=9)  # a round without a draft: the feed waits
        assert capture.features("cpu", torch.float32) is None  # the capture was cleared
        assert state.num_pending == 9 and state.fed == 0
        out = state.feed()
    assert state.fed == 9 and state.num_pending == 0 and state.cache.get_seq_length() == 9
    torch.testing.assert_close(out.logits, reference, atol=1e-5, rtol=1e-5)


def test_collect_keeps_the_verified_entries_only():
    state, _, features, tokens = state_and_inputs()
    state.collect(FakeCapture(features), tokens[:3])  # the forward's first 3 entries are verified
    kept, kept_tokens = state.pending()
    assert torch.equal(kept, features[:, :3]) and torch.equal(kept_tokens, tokens[None, :3])
    state.collect(FakeCapture(features), tokens[:0])  # nothing verified: nothing pending
    assert state.num_pending == 3


def test_feed_drops_speculative_entries_and_bookkeeping_is_checked():
    state, draft, features, tokens = state_and_inputs()
    with torch.no_grad():
        state.add(features[:, :5], tokens[:5])
        out = state.feed()
        for p in (5, 6):  # drafted (speculative) entries
            out = state.step(chain_step, tokens[p : p + 1][None], out.hidden_states[:, -1:], p)
        assert state.cache.get_seq_length() == 7
        state.add(features[:, 5:6], tokens[5:6])
        state.feed()
    assert state.cache.get_seq_length() == 6 == state.fed
    with pytest.raises(RuntimeError, match="bookkeeping"):
        state.collect(FakeCapture(features[:, :2]), tokens[:1], end=3)  # would start at 1, the draft has 6

