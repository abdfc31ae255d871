"""A batched call ends with its slowest row: ``"auto"`` in batches weighs a round by the tokens that bring the whole
batch nearer its end (``batch_tail.BatchRows.tokens``), not by the average row's.

The model is checked against simulations of rows that draw their tokens per round at random, alike and with
acceptance that differs from row to row; the rows' shares are shrunk towards the batch's where their rounds'
chance explains the difference; the chain policy and the tree-size chooser draft for one sequence where they draft
nothing for a wide batch with the same per-row gain, and for a batch of rows alike where they draft nothing for one
with a row the draft reads badly; the tree chooser's first size comes from the measured costs; the loop passes each
round's unfinished rows, their remainders and their acceptance so far.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import cached_draft as draft_of
from conftest import cached_target as target_of
from conftest import known_costs, tiny_draft, unlimited_allowance
from test_draft_length_policy import costs, estimate

from hf_eagle3.core import draft_length_policy, tree_policy
from hf_eagle3.core.batch_tail import ONE_ROW, BatchRows, expected_max_of_normals
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
def test_batch_tokens_match_a_simulated_batch_of_rows_alike(rows, remaining):
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
    assert BatchRows.alike(rows, remaining).tokens(mean, std) == pytest.approx(simulated, rel=0.04)
    assert simulated < 0.97 * mean  # the tail is real: what the model corrects


def test_batch_tokens_shape():
    assert BatchRows.alike(1, 48).tokens(2.5, 1.3) == 2.5  # one row: its own
    assert BatchRows().tokens(2.5, 1.3) == 2.5  # one sequence
    assert BatchRows.alike(8, 48).tokens(1.0, 0.0) == 1.0  # plain steps: every row one token a round
    wider = [BatchRows.alike(rows, 48).tokens(2.5, 1.3) for rows in (1, 2, 4, 8)]
    assert wider == sorted(wider, reverse=True) and wider[-1] < 0.88 * 2.5
    assert BatchRows.alike(8, 1000).tokens(2.5, 1.3) > BatchRows.alike(8, 48).tokens(2.5, 1.3)  # long remainders


def row_history(rng: random.Random, rates: list, rounds: int) -> BatchRows:
    """Rows that drafted ``rounds`` chains of 4 at their own acceptance rates, 48 tokens to go each."""
    draws = [[chain_tokens(rng, rate, 4) - 1 for _ in range(rounds)] for rate in rates]
    accepted, squares = tuple(sum(row) for row in draws), tuple(sum(a * a for a in row) for row in draws)
    return BatchRows((48,) * len(rates), accepted, squares, (rounds,) * len(rates))


def test_batch_tokens_match_a_simulated_batch_of_rows_that_differ():
    rng = random.Random(7)
    rates = [0.35, 0.8, 0.8, 0.8]  # the draft reads one prompt badly
    draws = [chain_tokens(rng, rates[i % 4], 4) for i in range(80_000)]  # over rows and rounds together
    mean = sum(draws) / len(draws)
    std = math.sqrt(sum((d - mean) ** 2 for d in draws) / len(draws))
    rounds = []
    for _ in range(2000):
        need, count = [48] * 4, 0
        while max(need) > 0:
            need = [n - chain_tokens(rng, rate, 4) if n > 0 else n for n, rate in zip(need, rates)]
            count += 1
        rounds.append(count)
    simulated = 48 / (sum(rounds) / len(rounds))
    history = row_history(rng, rates, 200)
    assert history.tokens(mean, std) == pytest.approx(simulated, rel=0.06)
    assert BatchRows.alike(4, 48).tokens(mean, std) > 1.15 * simulated  # rows taken alike: far too hopeful


def chain_accepted(rate: float, k: int = 4) -> float:
    """Expected accepted tokens of a chain of ``k`` at ``rate``."""
    return sum(rate ** i for i in range(1, k + 1))


@pytest.mark.parametrize("rows,pool", [(4, (0.35, 0.6, 0.85)), (8, (0.35, 0.6, 0.85)), (8, (0.5, 0.7))])
def test_batch_tokens_of_rows_not_seen_yet_from_the_spread_of_earlier_calls(rows, pool):
    """Each row reads at a rate drawn from ``pool``, which row is which unknown (the call's first round): the spread
    of the rows' shares found by earlier calls prices the chance that one of them is read badly."""
    rng = random.Random(rows * 100 + len(pool))
    grand = sum(chain_accepted(r) for r in pool) / len(pool)
    spread = sum((chain_accepted(r) / grand - 1) ** 2 for r in pool) / len(pool)
    draws = [chain_tokens(rng, pool[i % len(pool)], 4) for i in range(60_000)]
    mean = sum(draws) / len(draws)
    std = math.sqrt(sum((d - mean) ** 2 for d in draws) / len(draws))
    rounds = []
    for _ in range(2000):
        rates = [rng.choice(pool) for _ in range(rows)]
        need, count = [48] * rows, 0
        while max(need) > 0:
            need = [n - chain_tokens(rng, rate, 4) if n > 0 else n for n, rate in zip(need, rates)]
            count += 1
        rounds.append(count)
    simulated = 48 / (sum(rounds) / len(rounds))
    unseen = BatchRows((48,) * rows, prior=spread)
    assert unseen.estimate.doubts == [spread] * rows and unseen.estimate.within is None
    assert unseen.tokens(mean, std) == pytest.approx(simulated, rel=0.07)
    assert BatchRows.alike(rows, 48).tokens(mean, std) > 1.1 * simulated  # rows taken alike: too hopeful


def test_a_carried_spread_weighs_against_the_rows_of_the_call():
    rng = random.Random(13)
    differing = row_history(rng, [0.3, 0.85] * 4, 30)
    alike = BatchRows(differing.remaining, differing.accepted, differing.squares, differing.drafts, prior=0.0)
    assert 0 < alike.estimate.spread < differing.estimate.spread  # eight rows of prior alike pull it halfway
    assert alike.estimate.spread == pytest.approx(differing.estimate.spread / 2)
    few = row_history(rng, [0.6] * 8, 1)  # one round each: nothing to compare within a row yet
    assert BatchRows(few.remaining, few.accepted, few.squares, few.drafts, prior=0.2).estimate.doubts == [0.2] * 8
    many = row_history(rng, [0.3, 0.85] * 4, 200)
    carried = BatchRows(many.remaining, many.accepted, many.squares, many.drafts, prior=0.2).estimate
    assert max(carried.doubts) < 0.05 * carried.spread  # rows seen often: their own shares, hardly in doubt


def test_row_shares_shrink_towards_the_batch_where_chance_explains_the_difference():
    rng = random.Random(11)
    histories = [row_history(rng, [0.6] * 8, 8) for _ in range(200)]  # eight rounds of rows alike (std 1.4)
    lowest = [min(history.estimate.shares) for history in histories]
    assert sum(lowest) / len(lowest) > 0.9  # unshrunk, the unluckiest of eight rows would average about 0.5
    ratio = [history.tokens(2.3, 1.4) / BatchRows.alike(8, 48).tokens(2.3, 1.4) for history in histories]
    assert sum(ratio) / len(ratio) > 0.94  # chance costs the batch little (what it leaves unknown, about 5 %)
    shares, _, within, _ = row_history(rng, [0.3, 0.85] * 4, 30).estimate
    assert max(shares[0::2]) < 0.6 < 1.3 < min(shares[1::2])  # rows that keep differing keep their own
    assert within < 0.7  # their difference is not counted as chance again
    one = BatchRows((48, 48), (5, 0), (9, 0), (3, 0)).estimate  # one row with drafts: nothing to compare
    assert one == ([1.0, 1.0], [0.0, 0.0], None, 0.0)


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
    assert policy.best(4, batch=BatchRows.alike(8, 8)) == 0
    assert policy.best(4, batch=BatchRows.alike(8, 10_000)) > 0  # over a long remainder the tail hardly counts


def test_tree_chooser_counts_the_tail():
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for tokens in [1, 4, 1, 5, 2, 1, 4, 2] * 2:  # 2.5 tokens a row in 100 ms, widely spread
        chooser.update(predicted=2.0, accepted=tokens - 1, draft_seconds=0.02, round_seconds=0.1)
    assert chooser.tokens_std == pytest.approx(math.sqrt(2.25), rel=0.2)
    assert chooser.draft_this_round()  # one row: 25 tokens a second against a plain step's 25
    chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
    for tokens in [1, 4, 1, 5, 2, 1, 4, 2] * 2:
        chooser.update(predicted=2.0, accepted=tokens - 1, draft_seconds=0.02, round_seconds=0.1)
    decisions = [chooser.draft_this_round(BatchRows.alike(8, 24)) for _ in range(4)]
    assert decisions == [False] * 4  # eight rows, 24 tokens to go: the slowest row makes far less


def test_tree_chooser_skips_for_a_batch_with_a_row_the_draft_reads_badly():
    def measured():
        chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
        for tokens in [2, 3, 2, 4, 2, 3, 2, 4] * 2:  # 2.75 tokens a row in 100 ms, 1.1 plain steps' worth
            chooser.update(predicted=2.0, accepted=tokens - 1, draft_seconds=0.02, round_seconds=0.1)
        return chooser
    alike = BatchRows((400,) * 4, (28,) * 4, (60,) * 4, (16,) * 4)  # 1, 2, 1, 3 accepted, and again
    assert measured().draft_this_round(alike)
    one_bad = BatchRows((400,) * 4, (4, 36, 36, 36), (4, 92, 92, 92), (16,) * 4)  # the same mean, one far below
    assert [measured().draft_this_round(one_bad) for _ in range(4)] == [False] * 4


def test_a_wide_batch_stops_drafting_trees_that_do_not_pay_sooner():
    """Eight rows observe eight times what one row does a round: trees that clearly do not pay are found out in a
    few rounds, where one sequence with the same measures keeps drafting longer."""
    def rounds_until_skipping(rows: int) -> int:
        chooser = tree_policy.TreeSizeChooser({1: 0.04, 64: 0.08})
        batch = BatchRows.alike(rows, 400)
        while chooser.draft_this_round(batch) and chooser.rounds < 20:
            chooser.update(predicted=2.0, accepted=0.5, draft_seconds=0.05, round_seconds=0.1, tokens_square=2.5,
                           rows=rows)  # rows gaining 1 or 2 tokens
            chooser.update_plain(0.05)
        return chooser.rounds
    one, eight = rounds_until_skipping(1), rounds_until_skipping(8)  # 1.5 tokens in 100 ms against 1 in 50
    assert tree_policy.MIN_ROUNDS_BEFORE_SKIPPING <= eight <= one - 2 and one <= tree_policy.SETTLED_ROUNDS


def test_tree_chooser_first_size_follows_the_costs():
    flat = tree_policy.TreeSizeChooser({1: 0.05, 64: 0.06})
    assert flat.first_nodes(39) == tree_policy.AUTO_FIRST and flat.first_nodes(7) == 7
    steep = tree_policy.TreeSizeChooser({1: 0.1, 2: 0.13, 4: 0.16, 8: 0.22, 16: 0.34})  # compute-bound
    assert steep.first_nodes(39) == 5  # 6 tokens a row cost 0.19 s, 7 cost 0.205: at most two plain steps
    assert tree_policy.TreeSizeChooser({1: 0.1, 2: 0.3}).first_nodes(39) == 1


def test_the_loop_passes_the_batch_to_the_choices(monkeypatch):
    """Every round's decisions get the unfinished rows: what each still needs and its acceptance so far."""
    unlimited_allowance(monkeypatch)
    seen, batches, feeds = [], [], []
    draft_this_round = tree_policy.TreeSizeChooser.draft_this_round
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round",
                        lambda self, batch, depth, feed: seen.append((batch.rows, max(batch.remaining), depth)) or
                        batches.append(batch) or feeds.append(feed) or draft_this_round(self, batch, depth, feed))
    target, draft = target_of("llama"), draft_of("llama")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, target.config.vocab_size, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    known_costs(target, draft, rows=3)  # the first round is priced (not the plain step that learns a plain step)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=draft,
                          tree_top_k=3, tree_depth=3, tree_total_tokens="auto")
    assert torch.equal(out, ref)
    assert seen[0] == (3, 19, 3)  # after the prefill every row has its first token; the tree's depth
    assert feeds[0] == 6 and all(f >= 1 for f in feeds)  # the prompts wait for the draft: 4, 7 and 7 positions
    assert all(a[1] >= b[1] for a, b in zip(seen, seen[1:])) and all(1 <= r <= 3 for r, _, _ in seen)
    assert seen[-1][1] >= 2  # a round is only drafted while a row can still use a drafted token
    assert all(1 <= d <= min(3, n - 1) for _, n, d in seen)  # no deeper than the roomiest row can use
    assert batches[0].drafts == (0, 0, 0) and all(len(b.accepted) == len(b.drafts) == b.rows for b in batches)
    last = batches[-1]
    assert sum(last.drafts) > 0 and all(a <= 3 * d for a, d in zip(last.accepted, last.drafts))  # depth 3


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
    assert len(draft.drafting_memory.trees) == 2


def test_a_batched_call_carries_how_far_its_rows_differed(monkeypatch):
    """A batched call leaves on the draft how far its rows' acceptance differed (the spread of their shares); the next
    batched call's rounds weigh their rows with it; a call of one row compares no rows and leaves it."""
    from test_batched_decoding import CHAIN, batch_draft, batch_target, oracle_generate, padded_batch

    unlimited_allowance(monkeypatch)
    target, draft = batch_target("llama"), batch_draft("llama")
    draft.drafting_memory.rows_spread = None
    ids, mask = padded_batch((4, 13, 8, 2, 10), seed=7)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    assert torch.equal(oracle_generate(target, draft, ids, mask, ref, max_new_tokens=30, **CHAIN), ref)
    accepted = [s.num_accepted_tokens / s.num_drafts for s in draft.last_batch_stats]
    spread = draft.drafting_memory.rows_spread  # the oracle's rows accept different shares of their drafts
    assert max(accepted) > 1.3 * min(accepted) and isinstance(spread, float) and spread > 0.0
    target.generate(ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=8, assistant_model=draft)
    assert draft.drafting_memory.rows_spread == spread  # one row: nothing compared
    priors = []
    choose = draft_length_policy.Eagle3DraftLengthPolicy.choose
    monkeypatch.setattr(draft_length_policy.Eagle3DraftLengthPolicy, "choose",
                        lambda self, max_k, feed=1, batch=ONE_ROW: priors.append(batch.prior) or choose(
                            self, max_k, feed, batch))
    out = oracle_generate(target, draft, ids, mask, ref, max_new_tokens=30, num_assistant_tokens=4,
                          num_assistant_tokens_schedule="auto")
    assert torch.equal(out, ref) and priors and all(p == spread for p in priors)
