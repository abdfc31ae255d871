"""Draft dtypes, draft-length settings and their precedence, and the acceptance statistics."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_target as target
from conftest import random_prompt as prompt
from conftest import tiny_draft, tiny_target
from transformers import GenerationConfig

from hf_eagle3 import Eagle3CandidateGenerator, Eagle3Stats

ORIGINAL_SELECT = Eagle3CandidateGenerator._select


def generate(draft=None, max_new_tokens: int = 12, seed: int = 0, **kwargs):
    """Greedy ``generate`` on the cached target (with ``draft`` as assistant when given)."""
    if draft is not None:
        kwargs["assistant_model"] = draft
    return target().generate(prompt(seed=seed), do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


def confident_select(confidence: float):
    """A ``_select`` replacement whose draft puts probability ``confidence`` on the target's greedy token."""
    oracle = tiny_target("llama")  # same seed as target(): identical weights, but no hooks

    def _select(self, seq, draft_scores):
        with torch.no_grad():
            token = int(oracle(seq).logits[0, -1].argmax())
        scores = torch.zeros_like(draft_scores)
        n = scores.shape[-1]
        scores[:, token] = torch.log(torch.tensor(confidence * (n - 1) / (1 - confidence)))
        return ORIGINAL_SELECT(self, seq, scores)

    return _select


# ------------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_draft_dtypes(dtype, draft_vocab):
    draft = tiny_draft(target(), draft_vocab, seed=2).to(dtype)
    assert draft.dtype == dtype and draft.fc.weight.dtype == dtype
    for seed in (0, 1):
        ref = generate(seed=seed)
        assert torch.equal(generate(draft, seed=seed, num_assistant_tokens=3), ref)
    assert draft.last_stats.num_drafts > 0


def test_low_precision_rope_stays_float32():
    """A dtype cast must not round the RoPE frequencies (bf16 has 8 mantissa bits: far positions would drift)."""
    d32 = tiny_draft(target(), seed=2, rope_theta=500000.0)
    d16 = tiny_draft(target(), seed=2, rope_theta=500000.0).to(torch.bfloat16)
    pos = torch.tensor([[0, 1, 100, 4000]])
    cos32, sin32 = d32.rope(pos, torch.float32)
    cos16, sin16 = d16.rope(pos, torch.float32)
    torch.testing.assert_close(cos16, cos32, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin16, sin32, rtol=0, atol=1e-6)
    assert d16.inv_freq.dtype == torch.float32


# ----------------------------------------------------------------------------------------- draft length
def test_num_assistant_tokens_precedence():
    t = target()
    draft = tiny_draft(t, seed=3)
    assert draft.generation_config.num_assistant_tokens == 5  # default
    generate(draft)
    assert len(draft.last_stats.drafted_per_position) == 5
    draft.generation_config.num_assistant_tokens = 2
    generate(draft)
    assert len(draft.last_stats.drafted_per_position) == 2  # the draft's generation config
    generate(draft, num_assistant_tokens=4)
    assert len(draft.last_stats.drafted_per_position) == 4  # generate's argument wins
    generate(draft, generation_config=GenerationConfig(num_assistant_tokens=3, do_sample=False, max_new_tokens=12))
    assert len(draft.last_stats.drafted_per_position) == 3  # so does a generation config passed to generate
    assert draft.generation_config.num_assistant_tokens == 2  # and neither changes the draft's setting


@pytest.mark.parametrize("where", ["draft_config", "generate_kwarg"])
def test_heuristic_schedules(where):
    t = target()
    drafted = {}
    for schedule in ("constant", "heuristic", "heuristic_transient"):
        draft = tiny_draft(t, seed=3)  # random: its drafts are rejected, so the heuristic shrinks k by 1 per round
        draft.generation_config.num_assistant_tokens = 6
        kwargs = {}
        if where == "draft_config":
            draft.generation_config.num_assistant_tokens_schedule = schedule
        else:
            kwargs["num_assistant_tokens_schedule"] = schedule
        assert torch.equal(generate(draft, max_new_tokens=10, **kwargs), generate(max_new_tokens=10))
        assert draft.last_stats.num_accepted_tokens == 0
        drafted[schedule] = draft.last_stats.drafted_per_position
        assert draft.generation_config.num_assistant_tokens == (1 if schedule == "heuristic" else 6), schedule
    # After the prefill, 9 tokens are left; a round drafts min(k, tokens left - 1): constant 6, 6, 6, 5, 4, 3, 2, 1
    # (then a round with none); heuristic 6, 5, 4, 3, 2, 1, 1, 1.
    assert drafted["constant"] == [8, 7, 6, 5, 4, 3]
    assert drafted["heuristic"] == drafted["heuristic_transient"] == [8, 5, 4, 3, 2, 1]


def test_heuristic_grows_after_full_acceptance(monkeypatch):
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", confident_select(0.99))
    draft = tiny_draft(target(), seed=3)
    draft.generation_config.num_assistant_tokens = 2
    draft.generation_config.num_assistant_tokens_schedule = "heuristic"
    assert torch.equal(generate(draft, max_new_tokens=20), generate(max_new_tokens=20))
    # Rounds of k = 2, 4, 6, all accepted (1 + 3 + 5 + 7 = 16 tokens), then one capped to 3 drafts (20 - 16 - 1).
    assert draft.last_stats.drafted_per_position == [4, 4, 3, 2, 1, 1]
    assert draft.last_stats.accepted_per_position == [4, 4, 3, 2, 1, 1]
    # +2 after each fully accepted round (as Transformers: all the round's candidates accepted), kept on the draft.
    assert draft.generation_config.num_assistant_tokens == 10


def sharp_draft(sharpness: float):
    """A random draft whose own logits are scaled by ``sharpness`` (large: it is sure of its tokens)."""
    draft = tiny_draft(target(), seed=3)
    with torch.no_grad():
        draft.lm_head.weight.mul_(sharpness)
    return draft


@pytest.mark.parametrize("where", ["draft_config", "generate_kwarg"])
def test_confidence_threshold_stops_rounds(where):
    def run(sharpness, threshold):
        draft = sharp_draft(sharpness)
        kwargs = {"num_assistant_tokens": 4}
        if where == "draft_config":
            draft.generation_config.assistant_confidence_threshold = threshold
        else:
            kwargs["assistant_confidence_threshold"] = threshold
        assert torch.equal(generate(draft, max_new_tokens=12, **kwargs), generate(max_new_tokens=12))
        return draft.last_stats

    unsure = run(sharpness=1.0, threshold=0.5)  # probabilities ~1/256
    assert len(unsure.drafted_per_position) == 1  # every round stops after its first (unsure) token
    assert unsure.num_drafts == unsure.drafted_per_position[0] == 10
    sure = run(sharpness=1e4, threshold=0.5)
    assert len(sure.drafted_per_position) == 4
    off = run(sharpness=1.0, threshold=0.0)
    assert len(off.drafted_per_position) == 4


# --------------------------------------------------------------------------------------------------- stats
def test_stats_per_call_cumulative_and_report(monkeypatch):
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", confident_select(0.99))
    draft = tiny_draft(target(), seed=3)
    assert draft.last_stats is None and draft.cumulative_stats is None
    generate(draft, max_new_tokens=9, num_assistant_tokens=3)
    first = draft.last_stats
    # prefill 1 token, then rounds of 3 drafts + 1 bonus: 1 + 4 + 4 = 9.
    assert first == Eagle3Stats(num_drafts=2, drafted_per_position=[2, 2, 2], accepted_per_position=[2, 2, 2],
                                num_target_forwards=3, num_output_tokens=9)
    assert first.mean_acceptance_length == 4.0 and first.acceptance_rate_per_position == [1.0, 1.0, 1.0]
    generate(draft, max_new_tokens=6, num_assistant_tokens=2, seed=1)
    second = draft.last_stats
    assert second is not first and second.num_output_tokens == 6
    total = draft.cumulative_stats
    assert total.num_drafts == first.num_drafts + second.num_drafts
    assert total.num_output_tokens == 15
    assert total.accepted_per_position == [a + b for a, b in zip(first.accepted_per_position,
                                                                 second.accepted_per_position + [0])]
    report = total.report()
    assert "mean acceptance length" in report and "acceptance at token 0" in report
    assert f"mean acceptance length: {total.mean_acceptance_length:.2f}" in report
    d = total.to_dict()
    assert d["num_accepted_tokens"] == total.num_accepted_tokens and d["num_drafts"] == total.num_drafts
    draft.reset_stats()
    assert draft.last_stats is None and draft.cumulative_stats is None
    generate(draft, max_new_tokens=6, num_assistant_tokens=2, seed=1)
    assert draft.cumulative_stats == draft.last_stats == second
