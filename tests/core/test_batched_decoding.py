"""Batched EAGLE-3 decoding (``generate`` with a left-padded batch and ``assistant_model=draft``) is lossless.

Greedy: each row equals plain batched ``generate`` on the same padded batch, on tiny Llama, Qwen3, Mistral and Gemma3
targets, batch 1-8, prompts of different lengths, chains and trees, with a random draft (low acceptance) and with an
oracle drafter that drafts each row's own continuation right for a varying number of tokens (ragged acceptance, so
the per-row cache bookkeeping is exercised); EOS reached early in some rows; ``max_new_tokens`` reached mid-round;
logits processors; ``return_dict_in_generate``. Sampling: a chi-square test of rows sampled in batches (a padded
batch, rows independent) against the target alone, with a broken acceptance rule as negative control. Bad input is
refused before any work and leaves no hook behind. SmolLM2-135M-Instruct with the shipped draft runs under ``slow``.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import (
    break_tree_sampling,
    known_costs,
    plain_continuations,
    sampling_models,
    tiny_draft,
    tiny_target,
    token_p_values,
)
from conftest import cached_draft as draft_of
from conftest import cached_target as target_of
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from hf_eagle3 import Eagle3Drafter
from hf_eagle3.core import decoding_loop, draft_length_policy, generate_hook
from hf_eagle3.core.generate_hook import _ACTIVE, use_drafting

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
CHAIN = dict(num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
TREE = dict(tree_top_k=3, tree_depth=4, tree_total_tokens=8)


@functools.lru_cache(maxsize=None)
def batch_target(arch: str):
    """The tiny target of ``arch``; Gemma3's sliding window is widened so that a batch fits in it (see
    ``test_sliding_window_limit_is_refused_before_work`` for the narrow one)."""
    if arch != "gemma3":
        return target_of(arch)
    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              head_dim=16, sliding_window=96, eos_token_id=None, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=None)
def batch_draft(arch: str, draft_vocab_size: int | None = None):
    """A draft for :func:`batch_target` (Gemma3's own, since that target is not the shared one)."""
    if arch != "gemma3":
        return draft_of(arch, draft_vocab_size)
    return tiny_draft(batch_target(arch), draft_vocab_size)


def padded_batch(lengths, seed: int = 0):
    """Left-padded random prompts of the given lengths, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(4, 256, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def no_hooks_left(target) -> bool:
    return _ACTIVE.get() is None and all(not layer._forward_pre_hooks for layer in target.model.layers)


class OracleDrafter(Eagle3Drafter):
    """Drafts each row's reference continuation, right for a number of tokens that varies from round to round, then
    wrong (the draft itself is still fed every verified position, so its cache bookkeeping runs as usual)."""

    references: list = []

    def __init__(self, draft, rows, capacity):
        super().__init__(draft, rows, capacity)
        self.history = [[] for _ in range(rows)]

    def feed(self):
        _, tokens, counts = self._merged()
        for b, (row, c) in enumerate(zip(tokens.tolist(), counts)):
            self.history[b] += row[:c]
        super().feed()

    def keep_rows(self, keep):
        super().keep_rows(keep)
        self.history = [self.history[i] for i in keep]

    def right(self, row: int, fed: int, reference: list, depth: int) -> int:
        """How many of the row's drafted tokens are right this round (``fed``: its positions fed so far)."""
        return (fed * 7 + len(reference)) % (depth + 1)

    def expand(self, depth, top_k):
        chains = []
        for b, history in enumerate(self.history):
            h = len(history)
            ref = next(r for r in self.references if r[1 : 1 + h] == history)
            truth = (ref[1 + h : 1 + h + depth] + [4] * depth)[:depth]
            right = self.right(b, h, ref, depth)
            chains.append([t if i < right else (t + 1) % 256 for i, t in enumerate(truth)])
        device, rows = self.device, len(chains)
        return (-0.1 * torch.arange(1, depth + 1, dtype=torch.float, device=device).expand(rows, depth),
                torch.tensor(chains, dtype=torch.long, device=device),
                torch.arange(depth, dtype=torch.long, device=device).expand(rows, depth),
                torch.arange(1, depth + 1, dtype=torch.long, device=device), depth)


def oracle_generate(target, draft, ids, mask, ref, **kwargs):
    """Batched EAGLE-3 with :class:`OracleDrafter` reading the rows of ``ref`` (plain batched output)."""
    OracleDrafter.references = [[t for t, m in zip(row, mk) if m] + row[len(mk):]
                                for row, mk in zip(ref.tolist(), mask.tolist())]
    with use_drafting(drafter=OracleDrafter):
        return target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, **kwargs)


# ------------------------------------------------------------------------------------------------ greedy identity
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_rows_equal_plain_batched_generate(arch, settings):
    target = batch_target(arch)
    for i, lengths in enumerate([(5, 9), (3, 12, 7, 1), (6, 2, 11, 8, 4, 9, 3, 10)]):
        draft = batch_draft(arch, None if i % 2 else 48)
        ids, mask = padded_batch(lengths, seed=i)
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=11)
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=11, assistant_model=draft,
                              **settings)
        assert torch.equal(out, ref), (arch, lengths, out.tolist(), ref.tolist())
        assert len(draft.last_batch_stats) == len(lengths)
        assert all(s.num_output_tokens == 11 for s in draft.last_batch_stats)
        assert draft.last_stats.num_output_tokens == 11 * len(lengths)
        assert no_hooks_left(target)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_ragged_acceptance_keeps_every_row_exact(arch, settings):
    """High, different acceptance per row and round: holes in the target cache, compaction, per-row positions."""
    target = batch_target(arch)
    draft = batch_draft(arch)
    ids, mask = padded_batch((4, 13, 8, 2, 10), seed=7)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    out = oracle_generate(target, draft, ids, mask, ref, max_new_tokens=40, **settings)
    assert torch.equal(out, ref)
    accepted = [s.num_accepted_tokens for s in draft.last_batch_stats]
    assert sum(accepted) > 40 and len(set(accepted)) > 1, accepted


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_auto_schedule_with_rounds_that_draft_nothing_stays_exact(arch, monkeypatch):
    """``"auto"`` picks one length per round for all rows, 0 included (a plain batched step; the feed waits)."""
    pattern = itertools.cycle([0, 3, 0, 0, 2, 4, 1])
    monkeypatch.setattr(draft_length_policy.Eagle3DraftLengthPolicy, "choose",
                        lambda self, max_k, feed=1, **batch: min(next(pattern), max_k))
    observed, observe_rows = [], draft_length_policy.Eagle3AcceptanceEstimate.observe_rows
    monkeypatch.setattr(draft_length_policy.Eagle3AcceptanceEstimate, "observe_rows",
                        lambda self, rows: observed.append(list(rows)) or observe_rows(self, rows))
    target, draft = batch_target(arch), batch_draft(arch)
    ids, mask = padded_batch((4, 13, 8, 2), seed=9)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    out = oracle_generate(target, draft, ids, mask, ref, max_new_tokens=30, num_assistant_tokens=4,
                          num_assistant_tokens_schedule="auto")
    assert torch.equal(out, ref)
    stats = draft.last_batch_stats
    assert all(s.num_rounds_without_draft > 1 for s in stats) and sum(s.num_accepted_tokens for s in stats) > 10
    # the acceptance is recorded once a round, every unfinished row in it (one round of evidence, not one per row)
    rounds = max(s.num_drafts + s.num_rounds_without_draft for s in stats)
    assert len(observed) == rounds and len(observed[0]) == 4 and all(1 <= len(rows) <= 4 for rows in observed)
    assert sum(d for rows in observed for d, _ in rows) > 0


def test_auto_schedule_is_lossless_with_its_own_choices():
    target, draft = batch_target("qwen3"), batch_draft("qwen3")
    ids, mask = padded_batch((5, 9, 3), seed=10)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, assistant_model=draft,
                          num_assistant_tokens=4, num_assistant_tokens_schedule="auto")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tree_auto_sizes_every_round_and_stays_exact(arch, monkeypatch):
    """``tree_total_tokens="auto"`` in a batch: one size per round for all rows, chosen by the tree-size chooser
    (sizes of 1 to the most candidates, and rounds without a tree), every row exact."""
    from hf_eagle3.core import tree_policy

    sizes, skips = itertools.cycle([1, 5, 20, 2, 36]), itertools.cycle([True, True, False, True])
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "choose",
                        lambda self, probs, *batch: min(next(sizes), len(probs)))
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *batch: next(skips))
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "levels", lambda self, frontier, most: most)  # every level
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "first_nodes", lambda self, most: 16)
    target, draft = batch_target(arch), batch_draft(arch)
    ids, mask = padded_batch((4, 13, 8, 2), seed=12)
    known_costs(target, draft, rows=4)  # priced from the first round
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    settings = dict(tree_top_k=3, tree_depth=4, tree_total_tokens="auto")  # 30 candidates a round
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=draft,
                          **settings)
    assert torch.equal(out, ref)
    rounds = []  # nodes per row of each round's verify forward
    original = decoding_loop.batch_tree_mask
    monkeypatch.setattr(decoding_loop, "batch_tree_mask",
                        lambda cache, valid, trees, nodes, dtype: rounds.append(nodes) or original(cache, valid, trees,
                                                                                                 nodes, dtype))
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=draft,
                          **settings)
    assert torch.equal(out, ref)
    assert rounds[0] == 17 and {1, 2, 3, 6, 21, 31} <= set(rounds), rounds  # first round, skips, each size + root
    assert sum(s.num_rounds_without_draft for s in draft.last_batch_stats) > 0


def test_tree_auto_in_batches_is_lossless_with_its_own_choices():
    target, draft = batch_target("qwen3"), batch_draft("qwen3")
    ids, mask = padded_batch((5, 9, 3, 7), seed=13)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=draft,
                          tree_top_k=4, tree_depth=3, tree_total_tokens="auto")
    assert torch.equal(out, ref)


def test_sliding_window_target_compacts_before_the_window(monkeypatch):
    """With a window just above max_length + a round, holes alone would push entries out of it: the loop compacts
    first, and every row stays exact."""
    calls = []
    original = decoding_loop.compact
    monkeypatch.setattr(decoding_loop, "compact", lambda cache, valid: calls.append(1) or original(cache, valid))
    config = batch_target("gemma3").config
    target = AutoModelForCausalLM.from_config(Gemma3TextConfig(**{**config.to_dict(), "sliding_window": 48})).eval()
    target.load_state_dict(batch_target("gemma3").state_dict())
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    ids, mask = padded_batch((4, 13, 8, 2, 10), seed=11)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=28)
    out = oracle_generate(target, draft, ids, mask, ref, max_new_tokens=28, **CHAIN)
    assert torch.equal(out, ref) and calls


def test_compaction_keeps_rows_exact(monkeypatch):
    monkeypatch.setattr(decoding_loop, "COMPACT_SLACK", -1000)  # compact every round
    calls = []
    original = decoding_loop.compact
    monkeypatch.setattr(decoding_loop, "compact", lambda cache, valid: calls.append(1) or original(cache, valid))
    target, draft = batch_target("llama"), draft_of("llama")
    ids, mask = padded_batch((4, 13, 8), seed=8)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    out = oracle_generate(target, draft, ids, mask, ref, max_new_tokens=30, **CHAIN)
    assert torch.equal(out, ref) and len(calls) > 3


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_eos_early_in_some_rows_and_max_new_tokens_mid_round(settings):
    target = tiny_target("llama")
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target, seed=3)
    ids, mask = padded_batch((6, 3, 9, 5), seed=3)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    gen = free[:, ids.shape[1]:].tolist()
    eos = gen[0][6]  # row 0 ends at its 7th new token (or earlier); other rows where this token appears
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    ref = target.generate(ids, **kwargs)
    lengths = [(row.index(eos) + 1 if eos in row else 24) for row in gen]
    assert min(lengths) < 24, "some row must end early"
    rows_verified = []
    forward = target.forward
    target.forward = lambda *a, **k: rows_verified.append(k["input_ids"].shape[0]) or forward(*a, **k)
    try:
        out = oracle_generate(target, draft, ids, mask, free, max_new_tokens=24, eos_token_id=eos, pad_token_id=0,
                              **settings)
    finally:
        del target.forward
    assert torch.equal(out, ref)
    assert [s.num_output_tokens for s in draft.last_batch_stats] == lengths
    assert rows_verified[0] == 4 and rows_verified[-1] < 4  # finished rows left the batch: they stop costing
    for n in (1, 3, 7):  # max_new_tokens reached inside a round
        out = oracle_generate(target, draft, ids, mask, free, max_new_tokens=n, **settings)
        assert torch.equal(out, free[:, : ids.shape[1] + n])


def test_processors_scores_and_dict_output():
    target, draft = batch_target("llama"), draft_of("llama")
    ids, mask = padded_batch((5, 9, 2), seed=4)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, repetition_penalty=1.3,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = target.generate(ids, **kwargs)
    out = oracle_generate(target, draft, ids, mask, ref.sequences, max_new_tokens=12, repetition_penalty=1.3,
                          return_dict_in_generate=True, output_scores=True, output_logits=True, **TREE)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_batch_of_one_chains_run_in_transformers_loop_and_trees_in_the_package_loop(monkeypatch):
    """Batch-1 chains run Transformers' assisted loop; batch-1 trees run the package's loop, as batches do."""
    entered = []
    loop = generate_hook.eagle3_decoding
    monkeypatch.setattr(generate_hook, "eagle3_decoding", lambda *a, **k: entered.append(1) or loop(*a, **k))
    target, draft = batch_target("llama"), draft_of("llama")
    ids, mask = padded_batch((6,), seed=1)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    for settings, runs_ours in ((CHAIN, False), (TREE, True)):
        entered.clear()
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, assistant_model=draft,
                              **settings)
        assert torch.equal(out, ref) and bool(entered) == runs_ours


# ------------------------------------------------------------------------------------------------ bad input
def test_padding_without_attention_mask_is_refused():
    target, draft = batch_target("llama"), draft_of("llama")
    ids, _ = padded_batch((3, 6), seed=2)
    with pytest.raises(ValueError, match="attention_mask"):
        target.generate(ids, assistant_model=draft, max_new_tokens=4, pad_token_id=0)
    assert no_hooks_left(target)


def test_right_padding_is_refused():
    target, draft = batch_target("llama"), draft_of("llama")
    ids, mask = padded_batch((3, 6), seed=2)
    with pytest.raises(ValueError, match="left"):
        target.generate(ids.flip(-1), attention_mask=mask.flip(-1), assistant_model=draft, max_new_tokens=4)
    assert no_hooks_left(target)


def test_streamer_with_a_batch_is_refused_before_work():
    class Streamer:
        def put(self, value):
            raise AssertionError("no token may be streamed")

        def end(self):
            pass

    target, draft = batch_target("llama"), draft_of("llama")
    ids, mask = padded_batch((3, 6), seed=2)
    with pytest.raises(ValueError, match="streamer"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, streamer=Streamer())
    assert no_hooks_left(target)


@pytest.mark.parametrize("setting", [dict(num_assistant_tokens_schedule="heuristic"),
                                     dict(num_assistant_tokens_schedule="heuristic_transient"),
                                     dict(assistant_confidence_threshold=0.3)], ids=["heuristic", "transient", "confidence"])
def test_chain_settings_batches_lack_are_refused_before_work(setting):
    """Settings a batched chain does not implement are refused, never silently ignored; the refusal comes before any
    target forward and names what to use."""
    target, draft = batch_target("llama"), draft_of("llama")
    ids, mask = padded_batch((3, 6), seed=2)
    forwards = []
    handle = target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="not implemented for batches.*one row at a time"):
            target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, **setting)
    finally:
        handle.remove()
    assert forwards == [] and no_hooks_left(target)
    # Batch 1 honours them (Transformers' loop).
    one = target.generate(ids[:1, -3:], assistant_model=draft, max_new_tokens=4, do_sample=False, **setting)
    assert torch.equal(one, target.generate(ids[:1, -3:], max_new_tokens=4, do_sample=False))


def test_sliding_window_limit_is_refused_before_work():
    target = tiny_target("gemma3")  # sliding window 16
    draft = tiny_draft(target)
    ids, mask = padded_batch((3, 6), seed=2)
    with pytest.raises(ValueError, match="sliding window"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=20)
    assert no_hooks_left(target)
    with pytest.raises(ValueError, match="sliding window"):  # without padding (no mask) too
        target.generate(torch.randint(4, 256, (2, 6)), assistant_model=draft, max_new_tokens=20)
    assert no_hooks_left(target)


# ------------------------------------------------------------------------------------------------ sampling
PROMPT = torch.tensor([[5, 7, 9, 11]])
SAMPLING = dict(do_sample=True, max_new_tokens=4, temperature=1.5, top_k=10, top_p=0.8)
ALPHA = 1e-3


@functools.lru_cache(maxsize=None)
def plain_samples(n: int = 20000) -> list:
    target, _ = sampling_models()
    return plain_continuations(target, PROMPT, n, **SAMPLING)


def batched_samples(n: int, seed: int, settings: dict) -> tuple[list, float]:
    """``n`` continuations of PROMPT from batches of 8 rows where PROMPT is left-padded in half of them (the other
    rows have a longer prompt): the rows must be independent, each with the target's distribution. Each call starts
    without the tree-size state of the one before, so that ``"auto"`` drafts trees in its first rounds (carried, it
    would soon find that trees do not pay for 8 rows a few tokens from their end)."""
    target, draft = sampling_models()
    longer = torch.tensor([[6, 8, 10, 12, 13, 14]])
    ids = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), PROMPT], -1), longer] * 4)
    mask = (torch.arange(6)[None] >= torch.tensor([2, 0] * 4)[:, None]).long()
    outs, accepted = [], 0
    for i in range(n // 4):
        torch.manual_seed(seed + i)
        draft.drafting_memory.trees = {}
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, **SAMPLING, **settings)
        outs += [row[6:] for row in out[0::2].tolist()]
        accepted += draft.last_stats.num_accepted_tokens
    return outs, accepted / (2 * n)


@pytest.mark.parametrize(("settings", "least_accepted"),
                         [(CHAIN, 0.05), (dict(tree_top_k=10, tree_depth=2, tree_total_tokens=20), 0.2),
                          (dict(tree_top_k=10, tree_depth=2, tree_total_tokens="auto"), 0.2)],
                         ids=["chain", "tree", "tree-auto"])
def test_batched_sampling_keeps_target_distribution(settings, least_accepted):
    samples, accepted = batched_samples(480, seed=100, settings=settings)
    assert accepted > least_accepted, "the test needs drafts that are accepted"
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) > ALPHA / 2, p


def test_batched_negative_control_detects_broken_acceptance(monkeypatch):
    break_tree_sampling(monkeypatch)
    samples, _ = batched_samples(480, seed=200, settings=dict(tree_top_k=10, tree_depth=2, tree_total_tokens=20))
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) < ALPHA / 2, p


# ------------------------------------------------------------------------------------------------ real model
CHAT = ["Write a haiku about autumn.", "Give me two tips for learning Python.", "What is 17 times 23?",
        "Name three rivers in Europe and one fact about each.", "Translate 'good morning' into French.",
        "Write a Python function that reverses a string.", "Why is the sky blue?", "List four prime numbers."]


@pytest.mark.slow
def test_smollm2_batched_greedy_identity(smollm2):
    from hf_eagle3.loading import load_draft

    target, tok = smollm2
    draft, _, _ = load_draft(None, target)
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in CHAT]
    tok.padding_side = "left"
    for rows, settings in ((2, dict(num_assistant_tokens=5)), (4, TREE), (8, dict(num_assistant_tokens=3)), (8, {})):
        enc = tok(texts[:rows], return_tensors="pt", padding=True)
        kwargs = dict(attention_mask=enc.attention_mask, do_sample=False, max_new_tokens=40)
        ref = target.generate(enc.input_ids, **kwargs)
        out = target.generate(enc.input_ids, assistant_model=draft, **kwargs, **settings)  # {}: the saved "auto"
        assert torch.equal(out, ref), (rows, settings)
        assert len(draft.last_batch_stats) == rows
        if settings:
            assert draft.last_stats.mean_acceptance_length > 1.2
