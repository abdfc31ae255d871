"""``assistant_ensemble_weight`` (Transformers 5.24+: lossy static-ensemble verification against
``w * p_target + (1 - w) * q_draft``) is honoured where Transformers' loop verifies (batch-1 chains, greedy and sampled)
and refused before any target forward where the package's loop verifies (trees, batches); never ignored. On releases
without the setting Transformers itself refuses the unknown keyword before any work."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_draft, cached_target, random_prompt, tiny_draft
from transformers import GenerationConfig

from hf_eagle3 import Eagle3CandidateGenerator
from hf_eagle3.core.generate_hook import _ACTIVE, use_drafting

HAS_ENSEMBLE = hasattr(GenerationConfig(), "assistant_ensemble_weight")  # transformers 5.24+


class RoundSpy(Eagle3CandidateGenerator):
    """Records each round's drafted tokens and candidate logits, and the target's scores and accepted count."""

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RoundSpy.last = self
        self.rounds = []

    def get_candidates(self, input_ids, **kwargs):
        seq, logits = super().get_candidates(input_ids, **kwargs)
        self.rounds.append({"drafted": seq[0, input_ids.shape[1]:].clone(), "logits": logits})
        return seq, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.rounds[-1].update(scores=scores.clone(), accepted=int(num_matches))
        super().update_candidate_strategy(input_ids, scores, num_matches)


def forwards_of(target) -> tuple[list, object]:
    """A list that grows by one at every forward of ``target``, and the hook's handle."""
    seen = []
    return seen, target.register_forward_pre_hook(lambda module, args: seen.append(1))


def test_greedy_chain_verifies_against_the_ensemble():
    """Greedy, each round accepts the drafted tokens up to the first that differs from the argmax of
    ``w * softmax(target) + (1 - w) * softmax(draft)``, Transformers' rule: the chain hands Transformers the draft's
    logits greedy too (without them Transformers falls back to the lossless token match and ignores the weight)."""
    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=21)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    if not HAS_ENSEMBLE:
        seen, handle = forwards_of(target)
        try:
            with pytest.raises(ValueError, match="assistant_ensemble_weight"):
                target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24,
                                assistant_ensemble_weight=0.5)
        finally:
            handle.remove()
        assert seen == []
        return
    w = 0.5
    with use_drafting(chain=RoundSpy):
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24, num_assistant_tokens=4,
                              assistant_ensemble_weight=w)
    rounds = [r for r in RoundSpy.last.rounds if len(r["drafted"])]
    assert rounds and all(r["logits"] is not None for r in rounds), "greedy rounds handed no draft logits"
    beyond_lossless = 0
    for r in rounds:
        k = len(r["drafted"])
        p, q = r["scores"][0, :k].softmax(-1), r["logits"][0].softmax(-1)
        ensemble_choice = (w * p + (1 - w) * q).argmax(-1)
        expected = int((ensemble_choice == r["drafted"]).long().cumprod(0).sum())
        assert r["accepted"] == expected
        beyond_lossless += expected - int((p.argmax(-1) == r["drafted"]).long().cumprod(0).sum())
    assert beyond_lossless > 0, "no round accepted more than the lossless rule: the weight had no effect"
    assert not torch.equal(out, plain)  # lossy: the output leaves the target's own greedy tokens

    # A weight near 1 verifies against the target alone: the target's own tokens again.
    near_one = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24,
                               assistant_ensemble_weight=1 - 1e-6)
    assert torch.equal(near_one, plain)


def test_sampled_chain_verifies_against_the_ensemble():
    """Sampling, the acceptance ratio is ``1 - w + w * p / q``: with ``w`` near 0 every drafted token is accepted, where
    the lossless rule (the weight ignored) rejects most of a random draft's tokens."""
    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=22)
    if not HAS_ENSEMBLE:
        with pytest.raises(ValueError, match="assistant_ensemble_weight"):
            target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=8,
                            assistant_ensemble_weight=1e-6)
        return
    stats = {}
    for name, extra in (("lossless", {}), ("ensemble", dict(assistant_ensemble_weight=1e-6))):
        torch.manual_seed(0)
        target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=24, num_assistant_tokens=4,
                        **extra)
        stats[name] = draft.last_stats
    assert stats["ensemble"].num_accepted_tokens == stats["ensemble"].num_draft_tokens > 0
    assert stats["lossless"].num_accepted_tokens < stats["lossless"].num_draft_tokens


@pytest.mark.parametrize("path", ["tree", "batch", "tree batch"])
@pytest.mark.parametrize("given", ["kwarg", "generation_config"])
def test_trees_and_batches_refuse_the_ensemble_before_work(path, given):
    """The package's loop verifies losslessly only: the setting, given to ``generate`` or on a passed config, is
    refused before any target forward, naming the fix; nothing is left behind and plain ``generate`` still works."""
    target = cached_target("llama")
    draft = tiny_draft(target)
    rows = 2 if "batch" in path else 1
    ids = torch.cat([random_prompt(6, seed=23 + r) for r in range(rows)])
    tree = dict(tree_total_tokens=6, tree_depth=3, tree_top_k=2) if "tree" in path else {}
    setting = (dict(assistant_ensemble_weight=0.5) if given == "kwarg" else
               dict(generation_config=GenerationConfig(assistant_ensemble_weight=0.5, max_new_tokens=6)))
    reference = target.generate(ids, do_sample=False, max_new_tokens=6)
    seen, handle = forwards_of(target)
    try:
        with pytest.raises(ValueError, match="assistant_ensemble_weight") as err:
            target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=6, **tree, **setting)
    finally:
        handle.remove()
    assert seen == [], "refused after a target forward"
    assert all(not m._forward_pre_hooks for m in target.modules()) and _ACTIVE.get() is None
    assert draft.last_stats is None
    if HAS_ENSEMBLE:
        message = str(err.value)
        assert "not implemented for EAGLE-3" in message and "assistant_ensemble_weight=None" in message
        if "tree" in path:
            assert "drop the tree_* settings" in message
        if "batch" in path:
            assert "one row at a time" in message
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=6), reference)
    assert torch.equal(target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=6, **tree),
                       reference)


def test_a_chain_refuses_the_ensemble_where_transformers_would_not_read_it(monkeypatch):
    """On releases whose assisted loop never reads the setting (a passed config keeps it as a plain attribute), a
    batch-1 chain refuses it before any target forward, naming the release to install."""
    from hf_eagle3.core import transformers_compat

    monkeypatch.setattr(transformers_compat, "VERIFIES_ENSEMBLE", False)
    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=29)
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    config.assistant_ensemble_weight = 0.5
    seen, handle = forwards_of(target)
    try:
        with pytest.raises(ValueError, match=r"transformers>=5.24"):
            target.generate(ids, assistant_model=draft, generation_config=config)
    finally:
        handle.remove()
    assert seen == [], "refused after a target forward"
    assert _ACTIVE.get() is None
    assert torch.equal(target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=6),
                       target.generate(ids, do_sample=False, max_new_tokens=6))
