"""Greedy EAGLE-3 decoding is lossless: token-identical to the target alone.

Covers tiny random targets of four architectures (drafts with the full and with a smaller vocabulary, k in {1, 3, 7},
several prompt lengths, EOS inside a draft round, ``max_new_tokens`` reached mid-round), an oracle draft whose tokens
are really accepted (exact statistics bookkeeping), the consistency of the draft's incremental KV cache with a
from-scratch forward, and the real SmolLM2-135M-Instruct (``slow``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import cached_draft as draft_of
from conftest import cached_target as target_of
from conftest import greedy, random_prompt, tiny_draft

from hf_eagle3 import Eagle3CandidateGenerator, Eagle3Stats

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
SMALL_VOCAB = 48  # draft vocabulary of the "smaller vocab" drafts (target vocab: 256)
ORIGINAL_SELECT = Eagle3CandidateGenerator._select


def prompt(length: int, seed: int = 0) -> torch.LongTensor:
    """Random prompt ids of ``length`` tokens (avoiding the special ids 0-3)."""
    return random_prompt(length, seed=1000 + seed)


# ------------------------------------------------------------------------------------------ random drafts
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_vocab", [None, SMALL_VOCAB], ids=["full_vocab", "small_vocab"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_identity_random_draft(arch, draft_vocab, k):
    target, draft = target_of(arch), draft_of(arch, draft_vocab)
    length = {1: 1, 3: 6, 7: 19}[k]  # 19 > gemma3's sliding window (16)
    ids = prompt(length, seed=k)
    ref = greedy(target, ids, max_new_tokens=10)
    out = greedy(target, ids, max_new_tokens=10, assistant_model=draft, num_assistant_tokens=k)
    assert torch.equal(out, ref), f"{arch} k={k}: {out[0, length:].tolist()} != {ref[0, length:].tolist()}"
    stats = draft.last_stats
    assert stats.num_output_tokens == 10
    assert stats.num_target_forwards == 10 - stats.num_accepted_tokens  # one token per forward + accepted drafts
    assert stats.num_drafts >= 8 - stats.num_accepted_tokens  # prefill and a last k=0 round propose nothing
    assert len(stats.drafted_per_position) == k

    # EOS set to a token the target produces mid-continuation: generation stops there, exactly as without draft.
    cont = ref[0, length:].tolist()
    eos = cont[4]
    ref_eos = greedy(target, ids, max_new_tokens=10, eos_token_id=eos)
    out_eos = greedy(target, ids, max_new_tokens=10, eos_token_id=eos, assistant_model=draft, num_assistant_tokens=k)
    assert ref_eos.shape[1] == length + cont.index(eos) + 1 <= length + 5
    assert torch.equal(out_eos, ref_eos)


# ------------------------------------------------------------------------------------------ oracle drafts
def oracle_select(target, draft, wrong_positions=(), record=None):
    """A replacement for ``Eagle3CandidateGenerator._select`` that makes the draft an oracle.

    The draft scores are replaced by a one-hot on the target's own greedy next token (found by an unhooked copy
    of the target), expressed in the DRAFT vocabulary so that the real ``d2t`` mapping is exercised. At sequence
    positions in ``wrong_positions`` the one-hot is put on another draft token instead (a guaranteed rejection).
    ``record``, when a list, receives ``(seq, raw_draft_scores)`` of every call.
    """
    oracle = copy.deepcopy(target)
    target_ids = (torch.arange(draft.config.draft_vocab_size) + draft.d2t).tolist()
    index = {t: i for i, t in enumerate(target_ids)}

    def _select(self, seq, draft_scores):
        if record is not None:
            record.append((seq.clone(), draft_scores.detach().clone()))
        with torch.no_grad():
            token = int(oracle(seq).logits[0, -1].argmax())
        if token in index:
            i = index[token]
            if seq.shape[1] in wrong_positions:
                i = (i + 1) % len(target_ids)
            draft_scores = torch.full_like(draft_scores, -20.0)
            draft_scores[:, i] = 20.0
        return ORIGINAL_SELECT(self, seq, draft_scores)

    return _select


def simulate_stats(prompt_len: int, max_new: int, k: int, wrong_positions=(), eos_index: int | None = None,
                   details: dict | None = None):
    """The statistics an oracle draft must produce (wrong exactly at ``wrong_positions``), by direct simulation.

    ``eos_index`` is the index (among the new tokens) of the first EOS; ``details["eos_drafted"]`` tells whether
    that EOS was an accepted DRAFTED token (rather than the target's bonus token of its round).
    """
    stats = Eagle3Stats()
    stats.record(0, 0)  # prefill
    cur, end = prompt_len + 1, prompt_len + max_new
    if details is not None:
        details["eos_drafted"] = False
    if eos_index is not None and eos_index == 0:
        return stats
    while cur < end:
        drafted = min(k, end - cur - 1)
        accepted = 0
        while accepted < drafted and cur + accepted not in wrong_positions:
            accepted += 1
        if eos_index is not None and prompt_len + eos_index < cur + accepted + 1:
            if details is not None:
                details["eos_drafted"] = prompt_len + eos_index < cur + accepted
            stats.record(drafted, prompt_len + eos_index - cur)
            break
        stats.record(drafted, accepted)
        cur += accepted + 1
    return stats


def draft_covering(target, tokens, draft_vocab: int, seed: int = 3):
    """A random small-vocabulary draft whose vocabulary contains ``tokens`` (so an oracle never misses)."""
    v = target.config.vocab_size
    draft = tiny_draft(target, draft_vocab, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    others = [t for t in torch.randperm(v, generator=gen).tolist() if t not in set(tokens)]
    used = sorted(set(tokens) | set(others[: draft_vocab - len(set(tokens))]))
    used = torch.tensor(used)
    draft.d2t.copy_(used - torch.arange(draft_vocab))
    draft.t2d.zero_()
    draft.t2d[used] = True
    return draft


@pytest.mark.parametrize("arch,k", [("llama", 1), ("llama", 4), ("qwen3", 3), ("mistral", 7), ("gemma3", 3)])
def test_oracle_draft_is_accepted_with_exact_stats(arch, k, monkeypatch):
    target = target_of(arch)
    length, max_new = 7, 23
    ids = prompt(length, seed=11)
    ref = greedy(target, ids, max_new_tokens=max_new)
    cont = ref[0, length:].tolist()
    draft = draft_covering(target, cont, SMALL_VOCAB)

    # 1. A perfect oracle: every drafted token is accepted; the last round is cut short by max_new_tokens.
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", oracle_select(target, draft))
    out = greedy(target, ids, max_new_tokens=max_new, assistant_model=draft, num_assistant_tokens=k)
    assert torch.equal(out, ref)
    expected = simulate_stats(length, max_new, k)
    stats = draft.last_stats
    assert stats == expected
    assert stats.accepted_per_position == stats.drafted_per_position
    assert stats.num_drafts == expected.num_drafts > 0
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    if k > 1:
        assert stats.mean_acceptance_length > 2
        assert (max_new - 1) % (k + 1) != 0, "choose max_new so that the last round is cut short"

    # 2. Wrong at some positions: partial acceptance, rejection and cache cropping; still identical.
    wrong = {length + 3, length + 4, length + 10, length + 15}
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", oracle_select(target, draft, wrong))
    out = greedy(target, ids, max_new_tokens=max_new, assistant_model=draft, num_assistant_tokens=k)
    assert torch.equal(out, ref)
    assert draft.last_stats == simulate_stats(length, max_new, k, wrong)

    # 3. EOS inside a draft round (an accepted drafted token, not the round's bonus token): generation stops at the
    # EOS like the target alone, and the drafts after it are dropped.
    def eos_is_drafted(j):
        details = {}
        simulate_stats(length, max_new, k, wrong, eos_index=j, details=details)
        return details["eos_drafted"]

    j = next(j for j in range(8, max_new) if cont[j] not in cont[:j] and eos_is_drafted(j))
    ref_eos = greedy(target, ids, max_new_tokens=max_new, eos_token_id=cont[j])
    out_eos = greedy(target, ids, max_new_tokens=max_new, eos_token_id=cont[j], assistant_model=draft,
                     num_assistant_tokens=k)
    assert torch.equal(out_eos, ref_eos)
    assert ref_eos.shape[1] == length + j + 1
    assert draft.last_stats == simulate_stats(length, max_new, k, wrong, eos_index=j)
    assert draft.last_stats.num_output_tokens == j + 1


def test_simulated_stats_cover_the_cases():
    """The simulator used above really produces mid-round cut-offs and EOS truncation (guards the test itself)."""
    s = simulate_stats(7, 23, 4)  # rounds of 5 from index 1: 1 + 5 * 4 = 21, then a round capped to k=1
    assert s.drafted_per_position == [5, 4, 4, 4] and s.num_output_tokens == 23
    details = {}
    s = simulate_stats(7, 23, 4, eos_index=8, details=details)  # EOS is the 3rd token of the 2nd round
    assert s.num_output_tokens == 9 and s.accepted_per_position == [2, 2, 1, 1] and details["eos_drafted"]
    simulate_stats(7, 23, 4, eos_index=10, details=details)  # the 2nd round's bonus token
    assert not details["eos_drafted"]


# -------------------------------------------------------------------------------------- cache consistency
def target_features(target, seq, layer_ids):
    """Target features of every position of ``seq`` from one full forward: output_hidden_states[i], low -> high."""
    with torch.no_grad():
        hs = target(seq, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layer_ids], dim=-1)


def scratch_draft_logits(draft, feats, seq, cur_len):
    """Draft scores for the token after ``seq``, recomputed from scratch without any cache.

    Positions ``0 .. cur_len - 2`` pair the target's feature at t with token t + 1; each later (drafted) token is
    paired with the draft's own pre-norm output of the previous position, at position + 1.
    """
    hidden = draft.project_features(feats[:, : cur_len - 1])
    out = draft(input_ids=seq[:, 1:cur_len], hidden_states=hidden, position_ids=torch.arange(cur_len - 1)[None])
    for j in range(seq.shape[1] - cur_len):
        hidden = torch.cat([hidden, out.hidden_states[:, -1:]], dim=1)
        n = cur_len + j
        out = draft(input_ids=seq[:, 1 : n + 1], hidden_states=hidden, position_ids=torch.arange(n)[None])
    return out.logits[:, -1]


def check_recorded_scores(target, draft, out, record, k: int) -> int:
    """Compare every draft step recorded during a call (``("round", cur_len)`` markers, then ``(seq, scores)`` pairs)
    with a from-scratch draft forward over the final sequence ``out``; return how many steps were checked."""
    from hf_eagle3 import find_decoder_layers

    layer_ids = draft.config.resolve_feature_layer_ids(len(find_decoder_layers(target)))
    feats = target_features(target, out, layer_ids)
    checked, cur_len = 0, None
    with torch.no_grad():
        for seq, scores in record:
            if seq == "round":
                cur_len = scores
                continue
            assert 0 <= seq.shape[1] - cur_len < k
            assert torch.equal(seq[:, :cur_len], out[:, :cur_len])
            expected = scratch_draft_logits(draft, feats, seq, cur_len)
            torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-4)
            checked += 1
    return checked


@pytest.mark.parametrize("arch,draft_vocab", [("llama", SMALL_VOCAB), ("gemma3", None)])
def test_incremental_draft_matches_scratch_forward(arch, draft_vocab, monkeypatch):
    target = target_of(arch)
    length, k = 18, 3
    ids = prompt(length, seed=21)
    ref = greedy(target, ids, max_new_tokens=16)
    if draft_vocab is None:
        draft = tiny_draft(target, seed=5)
    else:
        draft = draft_covering(target, ref[0, length:].tolist(), draft_vocab, seed=5)
    record = []  # ("round", cur_len) markers from get_candidates, (seq, raw draft scores) pairs from _select
    wrong = {length + 2, length + 9}
    select = oracle_select(target, draft, wrong, record=record)
    original_get = Eagle3CandidateGenerator.get_candidates

    def get_candidates(self, input_ids, **kwargs):
        record.append(("round", input_ids.shape[1]))
        return original_get(self, input_ids, **kwargs)

    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", select)
    monkeypatch.setattr(Eagle3CandidateGenerator, "get_candidates", get_candidates)
    with torch.no_grad():
        out = greedy(target, ids, max_new_tokens=16, assistant_model=draft, num_assistant_tokens=k)
    assert torch.equal(out, ref)
    assert draft.last_stats.num_accepted_tokens > 0  # the cache was cropped after partial acceptance

    checked = check_recorded_scores(target, draft, out, record, k)
    assert checked >= 3 * k  # several rounds, each with all its draft steps


# ------------------------------------------------------------------------------------------- real model
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
]


@pytest.mark.slow
def test_greedy_identity_smollm2(smollm2):
    model, tok = smollm2
    text = model.config.get_text_config()
    assert text.hidden_size == 576
    draft = tiny_draft(model, 4096, seed=7, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1536)
    assert bool((draft.d2t != 0).any())
    draft.reset_stats()
    for question in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ref = model.generate(ids, do_sample=False, max_new_tokens=24)
        out = model.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=draft, num_assistant_tokens=3)
        assert torch.equal(out, ref), f"{question!r}: {tok.decode(out[0, ids.shape[1]:])!r}"
    assert draft.cumulative_stats.num_target_forwards >= len(CHAT_PROMPTS)
