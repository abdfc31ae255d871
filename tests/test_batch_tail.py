"""A batched call ends with its slowest row: ``"auto"`` in batches weighs a round by the tokens that bring the whole
batch nearer its end (``batch_tail.batch_tokens``), not by the average row's.

The model is checked against a simulation of rows that draw their tokens per round at random; the chain policy and
the tree-size chooser draft for one sequence where they draft nothing for a wide batch with the same per-row gain;
the tree chooser's first size comes from the measured costs; the loop passes each round's
unfinished rows and the longest remainder.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import cached_draft as draft_of
from conftest import cached_target as target_of
from conftest import tiny_draft
from test_cost_model import costs, estimate

from hf_eagle3.core import tree_policy
from hf_eagle3.core.batch_tail import batch_tokens, expected_max_of_normals
from hf_eagle3.core.draft_length_policy import Eagle3AcceptanceEstimate, Eagle3DraftLengthPolicy


def test_expected_max_of_normals():
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)  # exact: 0.5642
    assert expected_max_of_normals(4) == pytest.approx(1.0294, abs=1e-3)
    assert expected_max_of_normals(8) == pytest.approx(1.4236, abs=1e-3)


def chain_tokens(rng: random.Random, rate: float, k: int) -> int:
    """A round's tokens when each of ``k`` drafted tokens is accepted with ``rate`` given the ones before it."""
    tokens = 1
    while tokens <= k and rng.random() < rate:
        tokens += 1
    return tokens


@pytest.mark.parametrize("rows,remaining", [(2, 48), (4, 48), (8, 48), (8, 256)])
def test_batch_tokens_match_a_simulated_batch(rows, remaining):
    rng = random.Random(rows * 1000 + remaining)
    draws = [chain_tokens(rng, 0.6, 4) for _ in range(50_000)]
    mean = sum(draws) / len(draws)
    std = math.sqrt(sum((d - mean) ** 2 for d in draws) / len(draws))
    rounds = []
    for _ in range(2000):  # rounds until every row has its tokens
        need, count = [remaining] * rows, 0
        while max(need) > 0:
            need = [n - chain_tokens(rng, 0.6, 4) if n > 0 else n for n in need]
            count += 1
        rounds.append(count)
    simulated = remaining / (sum(rounds) / len(rounds))
    assert batch_tokens(mean, std, remaining, rows) == pytest.approx(simulated, rel=0.04)
    assert simulated < 0.97 * mean  # the tail is real: what the model corrects


def test_batch_tokens_shape():
    assert batch_tokens(2.5, 1.3, 48, 1) == 2.5  # one row: its own
    assert batch_tokens(1.0, 0.0, 48, 8) == 1.0  # plain steps: every row one token a round
    wider = [batch_tokens(2.5, 1.3, 48, rows) for rows in (1, 2, 4, 8)]
    assert wider == sorted(wider, reverse=True) and wider[-1] < 0.88 * 2.5
    assert batch_tokens(2.5, 1.3, 1000, 8) > batch_tokens(2.5, 1.3, 48, 8)  # the tail weighs less on long remainders


def test_tokens_std_of_a_chain():
    est = Eagle3AcceptanceEstimate(prior=0.6, prior_weight=1.0)
    rates, k = est.rates(3), 3
    reach = [1.0]  # P(T >= t) for t = 1..k+1
    for rate in rates:
        reach.append(reach[-1] * rate)
    probs = [reach[t] - (reach[t + 1] if t + 1 <= k else 0.0) for t in range(k + 1)]  # P(T = t + 1)
    mean = sum((t + 1) * p for t, p in enumerate(probs))
    var = sum((t + 1) ** 2 * p for t, p in enumerate(probs)) - mean ** 2
    assert est.expected_tokens(k) == pytest.approx(mean)
    assert est.tokens_std(k) == pytest.approx(math.sqrt(var))
    assert est.tokens_std(0) == 0.0


def test_chain_policy_drafts_for_one_row_and_not_for_a_wide_batch_with_a_short_remainder():
    # Verification costs 0.25 a token: k = 1 makes 1.5 tokens in 1.3 s, 1.15 a second against a plain step's 1
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.25, step=0.05), estimate(0.5))
    assert policy.best(4) > 0
    assert policy.best(4, rows=8, remaining=8) == 0
    assert policy.best(4, rows=8, remaining=10_000) > 0  # over a long remainder the tail hardly counts


def test_tree_chooser_counts_the_tail():
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for tokens in [1, 4, 1, 5, 2, 1, 4, 2] * 2:  # 2.5 tokens a row in 100 ms, widely spread
        chooser.update(predicted=2.0, accepted=tokens - 1, draft_seconds=0.02, round_seconds=0.1)
    assert chooser.tokens_std == pytest.approx(math.sqrt(2.25), rel=0.2)
    assert chooser.draft_this_round()  # one row: 25 tokens a second against a plain step's 25
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for tokens in [1, 4, 1, 5, 2, 1, 4, 2] * 2:
        chooser.update(predicted=2.0, accepted=tokens - 1, draft_seconds=0.02, round_seconds=0.1)
    decisions = [chooser.draft_this_round(rows=8, remaining=24) for _ in range(4)]
    assert decisions == [False] * 4  # eight rows, 24 tokens to go: the slowest row makes far less


def test_tree_chooser_first_size_follows_the_costs():
    flat = tree_policy.TreeSizeChooser({1: 0.05, 64: 0.06})
    assert flat.first_nodes(39) == tree_policy.AUTO_FIRST and flat.first_nodes(7) == 7
    steep = tree_policy.TreeSizeChooser({1: 0.1, 2: 0.13, 4: 0.16, 8: 0.22, 16: 0.34})  # compute-bound
    assert steep.first_nodes(39) == 5  # 6 tokens a row cost 0.19 s, 7 cost 0.205: at most two plain steps
    assert tree_policy.TreeSizeChooser({1: 0.1, 2: 0.3}).first_nodes(39) == 1


def test_the_loop_passes_the_batch_to_the_choices(monkeypatch):
    """Every round's decisions get the unfinished rows and what the row furthest from its end still needs."""
    seen = []
    draft_this_round = tree_policy.TreeSizeChooser.draft_this_round
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round",
                        lambda self, rows, remaining: seen.append((rows, remaining)) or draft_this_round(
                            self, rows, remaining))
    target, draft = target_of("llama"), draft_of("llama")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, target.config.vocab_size, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=draft,
                          tree_top_k=3, tree_depth=3, tree_total_tokens="auto")
    assert torch.equal(out, ref)
    assert seen[0] == (3, 19)  # after the prefill every row has its first token
    assert all(a[1] >= b[1] for a, b in zip(seen, seen[1:])) and all(1 <= r <= 3 for r, _ in seen)
    assert seen[-1][1] >= 2  # a round is only drafted while a row can still use a drafted token


def test_tree_chooser_state_carries_to_the_next_call():
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for _ in range(20):
        chooser.update(predicted=2.0, accepted=0, draft_seconds=0.02, round_seconds=0.1)  # 1 token in 100 ms
    assert not chooser.draft_this_round()
    carried = chooser.carried()
    nxt = tree_policy.TreeSizeChooser.from_carried(chooser.costs, carried)
    assert nxt.rounds == tree_policy.CARRIED_ROUNDS and nxt.calibration < 0.2  # a prior, not the whole history
    assert nxt.recent_seconds == chooser.recent_seconds and nxt.probes.every == chooser.probes.every
    assert not nxt.draft_this_round()  # no rounds spent finding again that trees do not pay
    assert tree_policy.TreeSizeChooser.from_carried(chooser.costs, None).draft_this_round()


def test_a_call_starts_from_the_last_one_at_its_batch_size(monkeypatch):
    """The tree-size state is kept on the draft per batch (device, dtype, rows, context length): a second call of the
    same batch size starts from the first's, one of another batch size fresh."""
    target = target_of("llama")
    draft = tiny_draft(target, seed=21)
    started = []
    from_carried = tree_policy.TreeSizeChooser.from_carried.__func__
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "from_carried",
                        classmethod(lambda cls, costs, carried: started.append(carried) or from_carried(cls, costs,
                                                                                                       carried)))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, target.config.vocab_size, (3, 7), generator=gen)
    settings = dict(do_sample=False, max_new_tokens=12, assistant_model=draft, tree_top_k=3, tree_depth=3,
                    tree_total_tokens="auto")
    for batch in (ids, ids, ids[:2]):
        out = target.generate(batch, attention_mask=torch.ones_like(batch), **settings)
        assert torch.equal(out, target.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                                max_new_tokens=12))
    assert started[0] is None and started[2] is None
    assert started[1] is not None and 0 < started[1]["rounds"] <= tree_policy.CARRIED_ROUNDS
    assert len(draft._tree_size_state) == 2
