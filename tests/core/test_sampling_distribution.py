"""Sampling with an EAGLE-3 draft keeps the target's distribution (temperature, top-k and top-p set).

A 2-layer target with a 24-token vocabulary and a draft with a 16-token vocabulary (``d2t`` in use). The first four
new tokens are sampled many times with the draft (one sequence per call, as assisted decoding requires) and, in one
batched call, without it; a chi-square test of homogeneity compares the two. Two drafts are used: the random draft
(low acceptance: mostly the residual distribution is exercised) and a target-like draft whose scores are the target's
own logits over the draft vocabulary (high acceptance, and the configuration in which misapplied processors bias the
output most). Two deliberately broken generators (candidate logits that are not the distribution the drafts were
sampled from) must fail the same test.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import (
    assisted_continuations,
    chi_square_homogeneity,
    plain_continuations,
    sampling_models,
    token_p_values,
)

from hf_eagle3 import Eagle3CandidateGenerator

ORIGINAL_SELECT = Eagle3CandidateGenerator._select
PROMPT = torch.tensor([[5, 7, 9, 11]])
SAMPLING = dict(do_sample=True, max_new_tokens=4, temperature=0.7, top_k=8, top_p=0.9)
K = 2  # drafted tokens of the first round: the 2nd and 3rd new tokens (the 1st comes from the prefill)
ALPHA = 1e-3  # family-wise: each of the three tests below uses ALPHA / 3


@functools.lru_cache(maxsize=None)
def plain_samples(n: int = 40000) -> list[list[int]]:
    """``n`` continuations sampled from the target alone, in one batched call."""
    target, _ = sampling_models()
    return plain_continuations(target, PROMPT, n, **SAMPLING)


def target_like(select):
    """Wrap a ``_select`` so that the draft's scores are the target's own logits over the draft vocabulary.

    The logits come from an unhooked copy of the target; target tokens outside the draft vocabulary still get
    probability zero, so the draft differs from the target and rejections happen.
    """
    target, draft = sampling_models()
    oracle = copy.deepcopy(target)
    target_ids = torch.arange(draft.config.draft_vocab_size) + draft.d2t

    def _select(self, seq, draft_scores):
        with torch.no_grad():
            scores = oracle(seq).logits[:, -1, target_ids]
        return select(self, seq, scores)

    return _select


def assisted_samples(n: int, seed: int = 1000) -> tuple[list[list[int]], float]:
    """``n`` continuations sampled with the draft (one call each); also the mean accepted drafts per call."""
    target, draft = sampling_models()
    return assisted_continuations(target, draft, PROMPT, n, seed, num_assistant_tokens=K, **SAMPLING)


def test_chi_square_helper():
    """The statistic itself: identical samples give p = 1, clearly different ones p ~ 0."""
    a = [0] * 50 + [1] * 50
    assert chi_square_homogeneity(a, a)[2] == pytest.approx(1.0)
    assert chi_square_homogeneity(a, [0] * 90 + [1] * 10)[2] < 1e-6
    stat, df, p = chi_square_homogeneity([0] * 30 + [1] * 70, [0] * 40 + [1] * 60)
    assert df == 1 and 0.1 < p < 0.2  # 2x2 table without continuity correction: chi2 = 2.198


@pytest.mark.parametrize("draft_kind", ["random", "target_like"])
def test_sampling_keeps_target_distribution(draft_kind, monkeypatch):
    if draft_kind == "target_like":
        monkeypatch.setattr(Eagle3CandidateGenerator, "_select", target_like(ORIGINAL_SELECT))
    samples, accepted = assisted_samples(500, seed=1000)
    assert accepted > (1.0 if draft_kind == "target_like" else 0.2), "the drafts must often be accepted"
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) > ALPHA / 3, p


def _broken_processors(self, seq, draft_scores):
    """Bug: drafts sampled from the processed distribution, but the UNprocessed one returned as candidate logits."""
    scores = self.d2t(seq, draft_scores.float())
    processed = scores
    for processor in self.logits_processor:
        processed = processor(seq, processed)
    token = torch.multinomial(processed.softmax(-1), num_samples=1)[:, 0]
    return token, scores


def _broken_d2t(self, seq, draft_scores):
    """Bug: candidate logits placed at the draft ids (``d2t`` not applied) while the tokens are mapped correctly."""
    token, processed = ORIGINAL_SELECT(self, seq, draft_scores)
    wrong = torch.full_like(processed, float("-inf"))
    wrong[:, : draft_scores.shape[-1]] = draft_scores.float()
    for processor in self.logits_processor:
        wrong = processor(seq, wrong)
    return token, wrong


@pytest.mark.parametrize("broken", [_broken_processors, _broken_d2t], ids=["processors", "d2t"])
def test_negative_control_detects_broken_generator(broken, monkeypatch):
    """The distribution test has power: misapplied processors or ``d2t`` make it fail (with fewer samples)."""
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", target_like(broken))
    samples, _ = assisted_samples(300, seed=5000)
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) < ALPHA / 3, p


def test_candidate_logits_are_the_processed_draft_distribution(monkeypatch):
    """Each round returns, over the full target vocabulary, the processed draft scores the drafts were drawn from."""
    target, draft = sampling_models()
    seen = []
    original = Eagle3CandidateGenerator.get_candidates

    def get_candidates(self, input_ids, **kwargs):
        seq, logits = original(self, input_ids, **kwargs)
        seen.append((input_ids.shape[1], seq, logits))
        return seq, logits

    monkeypatch.setattr(Eagle3CandidateGenerator, "get_candidates", get_candidates)
    torch.manual_seed(3)
    target.generate(PROMPT, assistant_model=draft, num_assistant_tokens=3, **dict(SAMPLING, max_new_tokens=12))
    in_draft_vocab = draft.t2d.clone()
    rounds = [(n, seq, logits) for n, seq, logits in seen if logits is not None]
    assert rounds and seen[0][2] is None  # the prefill round proposes nothing
    for n, seq, logits in rounds:
        k = seq.shape[1] - n
        assert logits.shape == (1, k, target.config.vocab_size)
        finite = torch.isfinite(logits[0])
        assert not finite[:, ~in_draft_vocab].any(), "tokens outside the draft vocabulary must get -inf"
        assert (finite.sum(-1) <= SAMPLING["top_k"]).all(), "top_k must be applied to the candidate logits"
        drafted = seq[0, n:]
        assert finite[torch.arange(k), drafted].all(), "each draft must have been possible under its distribution"


def test_d2t_processor_maps_scores_and_tokens():
    from hf_eagle3 import Eagle3D2TLogitsProcessor

    d2t = torch.tensor([0, 1, 1, 4])  # draft ids 0..3 -> target ids 0, 2, 3, 7
    processor = Eagle3D2TLogitsProcessor(d2t, 8)
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = processor(None, scores)
    assert out.shape == (1, 8)
    assert out[0, [0, 2, 3, 7]].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.isinf(out[0, [1, 4, 5, 6]]).all() and (out[0, [1, 4, 5, 6]] < 0).all()
    assert processor.map_tokens(torch.tensor([3, 0, 1])).tolist() == [7, 0, 2]
    assert int(processor.map_tokens(scores.argmax(-1))) == int(out.argmax(-1))  # greedy: map the argmax directly
    identity = Eagle3D2TLogitsProcessor(torch.zeros(4, dtype=torch.long), 4)
    assert identity(None, scores) is scores and identity.map_tokens(torch.tensor([2])).tolist() == [2]
