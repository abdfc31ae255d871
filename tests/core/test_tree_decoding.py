"""EAGLE-3 with dynamic draft trees (``tree_total_tokens`` / ``tree_depth`` / ``tree_top_k``) is lossless.

Greedy: token identity with the target alone on tiny random targets of four architectures (gemma3 has sliding-window
layers and prompts longer than its window), for several tree shapes including a single node and chains written as
trees; an oracle draft that puts the target's own continuation somewhere in the tree (high acceptance, so the KV
gathers of both caches are exercised); EOS and ``max_new_tokens`` inside a round; logits processors; streamers;
``return_dict_in_generate``; ``tree_total_tokens="auto"``. Sampling: a chi-square test of the first new tokens with
vs without the draft, with a broken acceptance rule as negative control. Bad settings fail before any work.
SmolLM2-135M-Instruct runs under ``slow``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math

import pytest
import torch
from conftest import (
    assisted_continuations,
    break_tree_sampling,
    greedy,
    known_costs,
    plain_continuations,
    random_prompt,
    sampling_models,
    tiny_draft,
    token_p_values,
)
from conftest import cached_draft as draft_of
from conftest import cached_target as target_of

import hf_eagle3.core.target_cache as target_cache
import hf_eagle3.core.tree_policy as tree_policy
from hf_eagle3.core import cost_model, draft_length_policy
from hf_eagle3.core import drafter as drafter_module
from hf_eagle3.core.draft_state import Eagle3DraftState
from hf_eagle3.core.generate_hook import _ACTIVE
from hf_eagle3.core.tree_candidates import DraftTree

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
SHAPES = [(1, 1, 1), (1, 4, 4), (2, 3, 1), (4, 4, 8), (3, 3, 12)]  # (top_k, depth, total_tokens)


def tree(top_k, depth, total):
    return dict(tree_top_k=top_k, tree_depth=depth, tree_total_tokens=total)


def prompt(length: int, seed: int = 0) -> torch.LongTensor:
    return random_prompt(length, seed=2000 + seed)


def no_hooks_left(target) -> bool:
    layers = target.model.layers
    return _ACTIVE.get() is None and all(not layer._forward_pre_hooks for layer in layers)


# ------------------------------------------------------------------------------------------------ greedy identity
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identity_random_draft(arch):
    target = target_of(arch)
    for i, shape in enumerate(SHAPES):
        draft = draft_of(arch, None if i % 2 else 48)
        ids = prompt((5, 19, 1, 23, 9)[i], seed=i)  # 19 and 23 exceed gemma3's sliding window (16)
        ref = greedy(target, ids, max_new_tokens=12)
        out = greedy(target, ids, max_new_tokens=12, assistant_model=draft, **tree(*shape))
        assert torch.equal(out, ref), (arch, shape, out[0, ids.shape[1]:].tolist(), ref[0, ids.shape[1]:].tolist())
        stats = draft.last_stats
        assert stats.num_output_tokens == 12
        assert stats.num_target_forwards == 12 - stats.num_accepted_tokens
        assert no_hooks_left(target)


def oracle(draft, reference: list[int], second_every: int = 2):
    """Make ``draft`` propose ``reference[q + 2]`` after a node at draft position q whose token is ``reference[q + 1]``
    (the target's own greedy continuation), as its best child, or as its second best at every ``second_every``-th
    position (then a fixed decoy ranks first). Other nodes get random scores. A feed's root scores (computed by the
    drafter from the last fed position's output) get the same treatment."""
    forward, compute_logits = draft.forward, draft.compute_logits
    vocab = draft.config.draft_vocab_size
    fed = []  # the last feed's final (position, token), for the root's scores

    def scores(positions: list, tokens: list, dtype) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int(positions[-1]))
        logits = torch.randn(1, len(positions), vocab, generator=gen)
        for row, (q, t) in enumerate(zip(positions, tokens)):
            if q + 2 < len(reference) and t == reference[q + 1]:
                logits[0, row, reference[q + 2]] = 20.0
                if q % second_every == 0:
                    logits[0, row, (reference[q + 2] + 7) % vocab] = 21.0
        return logits.to(dtype)

    def oracle_forward(input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):
        out = forward(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        if out.logits is None:  # a feed: the drafter computes the root's scores next
            fed[:] = [(int(position_ids[0, -1]), int(input_ids[0, -1]))]
            return out
        m = out.logits.shape[1]
        out.logits = scores(position_ids[0, -m:].tolist(), input_ids[0, -m:].tolist(), out.logits.dtype)
        return out

    def oracle_compute_logits(hidden_states):
        logits = compute_logits(hidden_states)
        if not fed:
            return logits
        (q, t), = fed
        fed.clear()
        return scores([q], [t], logits.dtype)

    draft.forward, draft.compute_logits = oracle_forward, oracle_compute_logits
    return draft


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("shape", [(2, 5, 10), (3, 4, 9), (1, 6, 6)])
def test_oracle_draft_is_accepted_and_caches_stay_exact(arch, shape):
    """High acceptance: the accepted nodes are rarely contiguous in the tree, so a crop instead of a gather of the
    target's (or the draft's) KV cache would change the output."""
    target = target_of(arch)
    ids = prompt(21, seed=7)
    ref = greedy(target, ids, max_new_tokens=30)
    draft = oracle(tiny_draft(target, seed=3), ref[0].tolist(), second_every=10**9 if shape[0] == 1 else 2)
    out = greedy(target, ids, max_new_tokens=30, assistant_model=draft, **tree(*shape))
    assert torch.equal(out, ref)
    stats = draft.last_stats
    assert stats.mean_acceptance_length > 0.7 * (shape[1] + 1), stats.to_dict()
    assert stats.accepted_per_position[shape[1] - 1] > 0


def test_tree_expansion_matches_sequential_draft_steps():
    """Each candidate's cumulative score equals that of the draft run step by step along its path (own cache copy,
    causal attention): the tree mask, positions and parent hidden states of the batched expansion are right."""
    target = target_of("llama")
    draft = tiny_draft(target, 48, seed=4)
    draft.bind_target(target)
    drafter = drafter_module.Eagle3Drafter(draft, 1, 64)
    sequential = Eagle3DraftState(draft)  # the reference: the draft's own cache, causal steps
    torch.manual_seed(0)
    features, tokens = torch.randn(1, 7, 3 * 64), prompt(7)
    with torch.no_grad():
        drafter.add(features, tokens, [7])
        drafter.feed()
        sequential.add(features, tokens[0])
        fed = sequential.feed()
        real = drafter.fed[0]
        torch.testing.assert_close(drafter._hidden, fed.hidden_states[:, -1:], atol=1e-5, rtol=1e-5)
        nodes = {0: (fed.hidden_states[:, -1:], torch.log_softmax(fed.logits[0, -1].float(), -1), sequential.cache)}
        scores, ids, parents, depths, levels = (value[0] if i < 3 else value
                                                for i, value in enumerate(drafter.expand(3, 3)))
        assert levels == 3 and scores.shape[0] == 3 + 2 * 9
        assert drafter.cache.get_seq_length() == real + 2 * 3  # tree entries, dropped at the next feed
        total = {0: 0.0}
        for c in range(scores.shape[0]):
            parent = int(parents[c])
            hidden, logp, cache = nodes[parent]
            total[c + 1] = total[parent] + float(logp[ids[c]])
            assert abs(float(scores[c]) - total[c + 1]) < 1e-4, (c, float(scores[c]), total[c + 1])
            if int(depths[c]) < levels:
                cache = copy.deepcopy(cache)
                out = draft(input_ids=drafter.d2t.map_tokens(ids[c : c + 1])[None], hidden_states=hidden,
                            position_ids=torch.tensor([[real - 1 + int(depths[c])]]), cache=cache)
                nodes[c + 1] = (out.hidden_states[:, -1:], torch.log_softmax(out.logits[0, -1].float(), -1), cache)
        drafter.add(torch.randn(1, 2, 3 * 64), prompt(2), [2])
        drafter.feed()
        assert drafter.cache.get_seq_length() == real + 2


def test_root_only_tree():
    tree = DraftTree.root_only(torch.tensor([7]))
    assert tree.tokens.tolist() == [7] and tree.parents.tolist() == [0] and tree.ancestors.tolist() == [[True]]


def test_eos_and_max_new_tokens_inside_a_round():
    target = target_of("llama")
    ids = prompt(6, seed=3)
    ref = greedy(target, ids, max_new_tokens=20)
    cont = ref[0, ids.shape[1]:].tolist()
    eos = next(t for j, t in enumerate(cont) if j >= 5 and t not in cont[:j])
    draft = oracle(tiny_draft(target, seed=3), ref[0].tolist())
    ref_eos = greedy(target, ids, max_new_tokens=20, eos_token_id=eos)
    out_eos = greedy(target, ids, max_new_tokens=20, eos_token_id=eos, assistant_model=draft, **tree(2, 5, 10))
    assert torch.equal(out_eos, ref_eos) and out_eos[0, -1] == eos
    for n in (1, 2, 7, 9):
        out = greedy(target, ids, max_new_tokens=n, assistant_model=draft, **tree(2, 5, 10))
        assert torch.equal(out, ref[:, : ids.shape[1] + n])
        assert draft.last_stats.num_output_tokens == n


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_masked_positions_inside_the_prompt(arch):
    """One row whose mask has zeros between real tokens (as ``generate`` infers from pad tokens inside a prompt given
    without a mask): they stay masked, as in plain ``generate``."""
    target = target_of(arch)
    ids = prompt(18, seed=9)
    mask = torch.ones_like(ids)
    mask[:, [4, 5, 11]] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=16, return_dict_in_generate=True, output_logits=True)
    ref = greedy(target, ids, **kwargs)
    unmasked = greedy(target, ids, max_new_tokens=1, return_dict_in_generate=True, output_logits=True)
    assert not torch.allclose(ref.logits[0], unmasked.logits[0], atol=1e-3)  # the mask matters
    out = greedy(target, ids, assistant_model=draft_of(arch), **kwargs, **tree(2, 4, 8))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_left_padded_prompt(arch):
    """A 2D attention mask with zeros (left padding, batch of one) stays masked in the tree forwards."""
    target = target_of(arch)
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt(18, seed=9)], dim=-1)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=20, return_dict_in_generate=True, output_logits=True)
    ref = greedy(target, ids, **kwargs)
    draft = oracle(tiny_draft(target, seed=3), ref.sequences[0, 3:].tolist())  # the draft's positions: real tokens
    out = greedy(target, ids, assistant_model=draft, **kwargs, **tree(2, 4, 8))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):  # the logits too: a mask that let pads through would move them
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert draft.last_stats.mean_acceptance_length > 2


def test_logits_processors_and_scores():
    """Processors see each node's own prefix (repetition penalty); scores/logits match plain generate's."""
    target, draft = target_of("qwen3"), draft_of("qwen3")
    ids = prompt(8, seed=4)
    kwargs = dict(max_new_tokens=10, repetition_penalty=1.5, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    ref = greedy(target, ids, **kwargs)
    ref_seq = greedy(target, ids, max_new_tokens=30, repetition_penalty=1.5)
    out = greedy(target, ids, assistant_model=oracle(tiny_draft(target, seed=3), ref_seq[0].tolist()),
                 **kwargs, **tree(3, 4, 8))
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 10 and len(out.logits) == 10
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    out2 = greedy(target, ids, max_new_tokens=10, repetition_penalty=1.5, assistant_model=draft, **tree(4, 3, 8))
    assert torch.equal(out2, ref.sequences)


def test_settings_from_draft_generation_config_and_auto():
    target = target_of("mistral")
    draft = tiny_draft(target, seed=5)
    ids = prompt(10, seed=5)
    ref = greedy(target, ids, max_new_tokens=16)
    draft.generation_config.tree_top_k = 3
    draft.generation_config.tree_depth = 4
    draft.generation_config.tree_total_tokens = "auto"
    oracle(draft, ref[0].tolist())
    out = greedy(target, ids, max_new_tokens=16, assistant_model=draft)
    assert torch.equal(out, ref)

    learnt = cost_model.cost_table().entries
    assert any(key.endswith("|rows1|package") for key in learnt), "auto learnt the costs of the loop's own forwards"
    assert draft.last_stats.mean_acceptance_length > 1.5


def test_size_chooser():
    chooser = tree_policy.TreeSizeChooser({1: 1.0, 8: 1.0, 16: 1.2, 64: 3.0})
    assert chooser.target_seconds(4) == 1.0 and chooser.target_seconds(12) == pytest.approx(1.1)
    assert chooser.choose([0.9] * 7 + [0.01] * 60) == 7  # up to 8 inputs cost the same; more only pays if accepted
    assert chooser.choose([0.95] * 40) > 7
    chooser.update(predicted=100.0, accepted=0, draft_seconds=0.0)  # the draft is badly over-confident
    assert chooser.choose([0.9] * 40) <= 7


def test_size_chooser_drafts_nothing_while_trees_do_not_pay():
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for _ in range(tree_policy.MIN_ROUNDS_BEFORE_SKIPPING):
        assert chooser.draft_this_round()  # too little measured yet
        chooser.update(predicted=1.0, accepted=0, draft_seconds=0.02, round_seconds=0.08)  # 1 token in 80 ms
    while chooser.draft_this_round():  # the benefit of the doubt, for one sequence's few rounds
        chooser.update(predicted=1.0, accepted=0, draft_seconds=0.02, round_seconds=0.08)
    assert 4 < chooser.rounds <= tree_policy.SETTLED_ROUNDS
    decisions = [False]  # the decision that ended the rounds above
    while not decisions[-1]:
        chooser.update_plain(0.04)  # a plain step: 1 token in 40 ms
        decisions.append(chooser.draft_this_round())
    assert len(decisions) >= draft_length_policy.PROBE_EVERY  # a probe, not before the schedule
    loss = chooser.recent_seconds - 1.0 * 0.04  # at most: the tree's measured round against a plain step's token
    assert len(decisions) - 1 <= math.ceil(loss / draft_length_policy.PROBE_BUDGET / 0.04)
    assert chooser.probes.waited == 0.0
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for _ in range(5):
        chooser.update(predicted=3.0, accepted=3, draft_seconds=0.02, round_seconds=0.08)  # 4 tokens in 80 ms
        chooser.update_plain(0.04)
    assert chooser.draft_this_round()


def skipping_chooser(tokens: float) -> tree_policy.TreeSizeChooser:
    """A chooser whose twenty rounds with a tree made ``tokens`` a round in 80 ms, against plain steps of 40 ms."""
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for _ in range(20):
        chooser.update(predicted=1.0, accepted=tokens - 1, draft_seconds=0.02, round_seconds=0.08)
        chooser.update_plain(0.04)
    return chooser


def test_a_probe_waits_until_it_could_change_the_decision():
    """Trees far below a plain step's rate: a probe whose every row accepts the whole tree could not bring the recent
    rounds up to SKIP_BELOW until the rounds before it have aged; one only just below is probed on schedule."""
    far, near = skipping_chooser(1.0), skipping_chooser(1.7)  # 0.5 and 0.85 of a plain step's tokens per second
    decisions = {}
    for name, chooser in (("far", far), ("near", near)):
        decisions[name] = []
        for _ in range(40):
            decisions[name].append(chooser.draft_this_round(depth=1))
            if decisions[name][-1]:
                break
            chooser.update_plain(0.04)
    assert len(decisions["near"]) == draft_length_policy.PROBE_EVERY  # on schedule: a perfect probe would pay
    assert len(decisions["far"]) > draft_length_policy.PROBE_EVERY + 4  # a probe of two tokens: futile for a while
    assert decisions["far"][-1] and not any(decisions["far"][:-1])
    assert far.next_weight() > 0.5  # by then the probe weighs as the many rounds it stands for
    assert skipping_chooser(1.0).draft_this_round() is False  # without a depth, the schedule alone decides
    just = skipping_chooser(1.0)
    just.update(predicted=1.0, accepted=0, draft_seconds=0.02, round_seconds=0.08)
    assert just.next_weight() == pytest.approx(tree_policy.SMOOTHING)  # right after a round with a tree


@pytest.mark.parametrize("tokens, feed", [(1.0, 0), (1.7, 0), (1.0, 40)])
def test_a_probe_waits_until_the_rounds_without_a_tree_pay_for_it(tokens, feed):
    """A round with a tree is expected to lose its time less that of the plain steps that bring as many tokens, and
    the feed the rounds without a tree deferred beyond a usual one: the probe waits until the rounds without a tree
    have taken that loss over PROBE_BUDGET, past the count schedule."""
    chooser = skipping_chooser(tokens)
    chooser.usual_feed, chooser.deferred_feed = 0.005, 0.001  # seconds a usual feed, seconds a deferred position
    chooser.probes.waited = 0.0
    plain_rounds = 0
    while not chooser.draft_this_round(feed=feed):
        chooser.update_plain(0.04)
        plain_rounds += 1
    loss = 0.08 - tokens * 0.04 + (0.001 * feed - 0.005 if feed else 0.0)
    assert plain_rounds > draft_length_policy.PROBE_EVERY
    assert plain_rounds == pytest.approx(loss / draft_length_policy.PROBE_BUDGET / 0.04, abs=1)
    carried = tree_policy.TreeSizeChooser.from_carried(chooser.costs, skipping_chooser(tokens).carried())
    assert carried.probes.waited == pytest.approx(20 * 0.04)  # the time waited carries to the next call


def test_a_probe_after_many_rounds_without_a_tree_can_bring_trees_back():
    chooser = skipping_chooser(1.0)
    while not chooser.draft_this_round(depth=4):
        chooser.update_plain(0.04)
    chooser.update(predicted=1.0, accepted=4, draft_seconds=0.02, round_seconds=0.08)  # the text turned easy
    assert chooser.draft_this_round(depth=4)  # one probe, weighed by the rounds it stands for, brings trees back
    stale = skipping_chooser(1.0)  # the same probe right after the last round with a tree weighs SMOOTHING
    stale.update(predicted=1.0, accepted=4, draft_seconds=0.02, round_seconds=0.08)
    assert not stale.draft_this_round(depth=4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_auto_tree_rounds_without_a_tree_stay_lossless(arch, monkeypatch):
    """Rounds that draft no tree defer the draft's feed; the next tree is drafted from all the features at once."""
    target = target_of(arch)
    ids = prompt(9, seed=8)
    ref = greedy(target, ids, max_new_tokens=24)
    draft = oracle(tiny_draft(target, seed=8), ref[0].tolist())
    pattern = iter([True, False, False, True, False, True, True, False, False, False] * 5)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *batch: next(pattern))
    fed = []
    original_feed = drafter_module.Eagle3Drafter.feed
    monkeypatch.setattr(drafter_module.Eagle3Drafter, "feed",
                        lambda self: fed.append(self._merged()[:2]) or original_feed(self))
    out = greedy(target, ids, max_new_tokens=24, assistant_model=draft, tree_top_k=3, tree_depth=4,
                 tree_total_tokens="auto")
    assert torch.equal(out, ref)
    stats = draft.last_stats
    assert stats.num_rounds_without_draft > 0 and stats.num_accepted_tokens > 0
    assert stats.num_target_forwards == stats.num_drafts + stats.num_rounds_without_draft + 1
    # What the draft consumed, feeds after deferrals included, is exactly the target's features of the final sequence
    # at positions 0..n-1, each paired with the token that follows it.
    from test_greedy_identity import target_features

    from hf_eagle3 import find_decoder_layers

    features = torch.cat([f for f, _ in fed], dim=1)
    tokens = torch.cat([t[0] for _, t in fed])
    n = features.shape[1]
    assert len(fed) < stats.num_target_forwards and n == tokens.shape[0]
    assert torch.equal(tokens, out[0, 1 : n + 1])
    layer_ids = draft.config.resolve_feature_layer_ids(len(find_decoder_layers(target)))
    torch.testing.assert_close(features, target_features(target, out, layer_ids)[:, :n], atol=1e-4, rtol=1e-4)


def test_size_chooser_drafts_the_levels_whose_frontier_can_pay():
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    assert chooser.levels([0.001, 0.0], 5) == 5  # nothing measured yet: every level
    # 10 rounds of 0.05 s each (0.01 s drafting with 2 forwards), 1 accepted token per round: 40 tokens/s.
    for _ in range(10):
        chooser.update(predicted=1.0, accepted=1, draft_seconds=0.01, draft_forwards=2, round_seconds=0.05)
    # One level costs 5 ms, i.e. 0.2 tokens at 40 tokens/s: a level is drafted while the frontier before it holds more.
    assert chooser.levels([0.9, 0.5, 0.3, 0.1], 5) == 4
    assert chooser.levels([0.9, 0.5, 0.0, 0.0], 5) == 3  # one level past the ones drafted last round, at most
    assert chooser.levels([0.9, 0.5, 0.3, 0.3], 3) == 3  # never past tree_depth
    assert chooser.levels([0.1, 0.9], 5) == 1


class Recorder:
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_streamer_gets_exactly_the_output():
    target = target_of("llama")
    ids = prompt(7, seed=8)
    ref = greedy(target, ids, max_new_tokens=15)
    streamer = Recorder()
    draft = oracle(tiny_draft(target, seed=3), ref[0].tolist())
    out = greedy(target, ids, max_new_tokens=15, assistant_model=draft, streamer=streamer, **tree(2, 4, 8))
    assert torch.equal(out, ref)
    assert streamer.chunks[0] == ids[0].tolist() and streamer.ended == 1
    assert sum(streamer.chunks[1:], []) == ref[0, ids.shape[1]:].tolist()
    assert max(len(c) for c in streamer.chunks[1:]) > 1  # several tokens per round really happened


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (tree(4, 4, 0), "tree_total_tokens"),
        (tree(4, 0, 8), "tree_depth"),
        (tree(0, 4, 8), "tree_top_k"),
        (tree(4, 4, "big"), "tree_total_tokens"),
    ],
)
def test_bad_settings_fail_before_work(kwargs, message, monkeypatch):
    target, draft = target_of("llama"), draft_of("llama")
    calls = []
    monkeypatch.setattr(draft, "forward", lambda *a, **k: calls.append(1))
    inputs = kwargs.pop("input_ids", prompt(5))
    with pytest.raises(ValueError, match=message):
        target.generate(inputs, max_new_tokens=5, assistant_model=draft, **kwargs)
    assert not calls and no_hooks_left(target)


def test_attention_implementation_without_4d_masks_is_refused(monkeypatch):
    target, draft = target_of("llama"), draft_of("llama")
    monkeypatch.setattr(target.config, "_attn_implementation", "flash_attention_2", raising=False)
    with pytest.raises(ValueError, match="attn_implementation"):
        target.generate(prompt(5), max_new_tokens=5, assistant_model=draft, **tree(2, 2, 4))
    assert no_hooks_left(target)


def test_gather_cache_keeps_the_selected_entries():
    target = target_of("gemma3")
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    key = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"  # 5.2x rename
    with torch.no_grad():
        target(prompt(20), use_cache=True, **{key: cache})
        cache.crop(0)
        before = [layer.keys.clone() for layer in cache.layers]
        target(prompt(6, seed=1), use_cache=True, **{key: cache})
        after = [layer.keys.clone() for layer in cache.layers]
    target_cache.gather_cache(cache, torch.tensor([0, 2, 5]), 6)
    assert cache.get_seq_length() == 23
    for layer, b, a in zip(cache.layers, before, after):
        keep = a[..., [-6, -4, -1], :]
        expected = torch.cat([b, keep], dim=-2)
        if target_cache.sliding_layer(layer):
            expected = expected[..., -(layer.sliding_window - 1):, :]
        torch.testing.assert_close(layer.keys, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ sampling
PROMPT = torch.tensor([[5, 7, 9, 11]])
SAMPLING = dict(do_sample=True, max_new_tokens=4, temperature=1.5, top_k=10, top_p=0.8)
TREE = tree(10, 2, 20)  # wide: its children carry much of the target's mass, so a broken rule shows
ALPHA = 1e-3


@functools.lru_cache(maxsize=None)
def plain_samples(n: int = 20000) -> list:
    target, _ = sampling_models()
    return plain_continuations(target, PROMPT, n, **SAMPLING)


def tree_samples(n: int, seed: int, shape: dict = TREE) -> tuple[list, float]:
    target, draft = sampling_models()
    return assisted_continuations(target, draft, PROMPT, n, seed, **SAMPLING, **shape)


def test_sampling_keeps_target_distribution():
    samples, accepted = tree_samples(500, seed=1000)
    assert accepted > 0.4, "the test needs drafts that are often accepted"
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) > ALPHA / 2, p


def test_sampling_with_auto_size_and_depth_keeps_target_distribution():
    """"auto" changes each round's tree (size and depth); the recursive rejection sampling stays exact."""
    samples, _ = tree_samples(500, seed=3000, shape=tree(4, 4, "auto"))
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) > ALPHA / 2, p


def test_sampling_with_rounds_without_a_tree_keeps_target_distribution(monkeypatch):
    """Rounds that draft no tree (the root alone is verified, the feed waits) between rounds with one: exact too."""
    pattern = iter([False, True, False, False, True] * 2000)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *batch: next(pattern))
    samples, accepted = tree_samples(500, seed=6000, shape=tree(4, 4, "auto"))
    assert accepted > 0.1, "some rounds must draft and be accepted"
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) > ALPHA / 2, p


def test_negative_control_detects_broken_acceptance(monkeypatch):
    break_tree_sampling(monkeypatch)
    samples, _ = tree_samples(500, seed=5000)
    p = token_p_values(samples, plain_samples())
    assert min(p.values()) < ALPHA / 2, p


# ------------------------------------------------------------------------------------------------ real model
CHAT = ["Write a haiku about autumn.", "Give me two tips for learning Python."]


@pytest.mark.slow
def test_smollm2_greedy_identity(smollm2):
    from hf_eagle3.loading import encode_prompt, load_draft, random_draft_for

    target, tokenizer = smollm2
    draft, _, _ = load_draft(None, target)
    for text in CHAT:
        ids = encode_prompt(tokenizer, text)
        ref = greedy(target, ids, max_new_tokens=24)
        for shape in [(1, 1, 1), (1, 4, 4), (4, 4, 8), (8, 6, 32)]:
            out = greedy(target, ids, max_new_tokens=24, assistant_model=draft, **tree(*shape))
            assert torch.equal(out, ref), (text, shape)
        ref_long = greedy(target, ids, max_new_tokens=40)
        oracle_draft = oracle(random_draft_for(target, seed=1), ref_long[0].tolist())
        out = greedy(target, ids, max_new_tokens=24, assistant_model=oracle_draft, **tree(3, 5, 12))
        assert torch.equal(out, ref), text
        assert oracle_draft.last_stats.mean_acceptance_length > 2.5


def test_auto_sizes_each_round_from_the_previous_rounds_candidates(monkeypatch):
    """"auto" reads nothing back mid-round: the first tree has the chooser's first size (``first_nodes``: at most
    AUTO_FIRST nodes) and all levels, each later one the size
    the chooser picked from the previous round's candidates (read back with that round's planes) and one level more
    than the deepest of them needs; a random draft's hopeless candidates shrink the trees, and the output is
    unchanged."""
    target = target_of("llama")
    ids = prompt(9, seed=11)
    ref = greedy(target, ids, max_new_tokens=24)
    sizes, chosen, levels = [], [], []
    select, choose = drafter_module.Eagle3Drafter.select, tree_policy.TreeSizeChooser.choose
    expand = drafter_module.Eagle3Drafter.expand

    def recording_expand(self, depth, top_k):
        levels.append(depth)
        return expand(self, depth, top_k)

    def recording_select(self, candidates, roots, total):
        sizes.append(total)
        return select(self, candidates, roots, total)

    def recording_choose(self, path_probs, *batch):
        assert isinstance(path_probs, list) and path_probs == sorted(path_probs, reverse=True)
        chosen.append(choose(self, path_probs, *batch))
        return chosen[-1]

    monkeypatch.setattr(drafter_module.Eagle3Drafter, "select", recording_select)
    monkeypatch.setattr(drafter_module.Eagle3Drafter, "expand", recording_expand)
    first, first_nodes = [], tree_policy.TreeSizeChooser.first_nodes
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "choose", recording_choose)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "first_nodes",
                        lambda self, most: first.append(first_nodes(self, most)) or first[-1])
    # a tree every round: whether trees pay on this machine (and when a probe comes) is not what is tested here
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *args: True)
    draft = tiny_draft(target, seed=12)
    known_costs(target, draft)  # sizes priced from known costs (not the first rounds that learn a size's cost)
    out = greedy(target, ids, max_new_tokens=24, assistant_model=draft, **tree(3, 5, "auto"))
    assert torch.equal(out, ref)
    assert sizes[0] == first[0] <= min(tree_policy.AUTO_FIRST, tree_policy.auto_most_nodes(5, 3))
    assert len(sizes) >= 5 and sizes[1:] == chosen[: len(sizes) - 1]
    assert min(sizes[1:]) < sizes[0]
    assert levels[0] == 5 and all(1 <= d <= min(5, n) for d, n in zip(levels, sizes)) and min(levels[1:]) < 5


def test_auto_trees_grow_back_after_a_small_one(monkeypatch):
    """A round of one node still drafts top_k-wide candidates, so the next round can keep more: sizes 1, then 8."""
    target = target_of("llama")
    ids = prompt(9, seed=13)
    script = itertools.cycle([1, 8])
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "choose", lambda self, probs, *batch: next(script))
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *args: True)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "levels", lambda self, frontier, most: most)
    nodes = []
    select = drafter_module.Eagle3Drafter.select

    def recording(self, candidates, roots, total):
        trees = select(self, candidates, roots, total)
        nodes.append(trees[0].tokens.shape[0] - 1)
        return trees

    monkeypatch.setattr(drafter_module.Eagle3Drafter, "select", recording)
    draft = tiny_draft(target, seed=14)
    known_costs(target, draft)  # sizes chosen from known costs (not the first rounds that learn a size's cost)
    out = greedy(target, ids, max_new_tokens=24, assistant_model=draft, **tree(3, 4, "auto"))
    assert torch.equal(out, greedy(target, ids, max_new_tokens=24))
    assert nodes[:5] == [16, 1, 8, 1, 8]
