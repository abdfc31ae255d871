"""The budget (``core/budget.py``) and the cost table it prices rounds with (``core/cost_model.py``).

A call times nothing beyond its own rounds: it looks its costs up in the process's table (calibrated ahead of time,
or learnt by earlier calls), runs a plain step first when no plain step is known, and teaches the table what its
rounds took; the table persists to the user's cache directory and interpolates between context lengths. With a fake
clock, the budget learns from its rounds alone that drafting pays where verification is free and does not where it is
dear. What the draft keeps across calls is one declared object, ``draft.drafting_memory``.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import greedy, random_prompt, tiny_draft, unlimited_allowance
from conftest import cached_target as target_of
from test_greedy_identity import draft_covering, oracle_select

from hf_eagle3 import Eagle3CandidateGenerator
from hf_eagle3.core import cost_model
from hf_eagle3.core.budget import PLAIN, ChainBudget, DraftingMemory, FixedBudget, RoundPlan
from hf_eagle3.core.cost_model import CostTable, Eagle3Costs, calibrate, cost_key, cost_table
from hf_eagle3.core.draft_length_policy import Eagle3DraftLengthPolicy

AUTO = {"num_assistant_tokens_schedule": "auto"}
TREE_AUTO = {"tree_top_k": 2, "tree_depth": 3, "tree_total_tokens": "auto"}


def counting_forwards(target, monkeypatch) -> list:
    """Record the number of new tokens of every forward of ``target``."""
    seen, forward = [], target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: seen.append(k["input_ids"].shape[1]) or forward(*a, **k))
    return seen


def no_timing(monkeypatch) -> None:
    """Make every dedicated timing of a forward an error."""
    def refuse(*args, **kwargs):
        raise AssertionError("a generate call timed a forward of its own")

    monkeypatch.setattr(cost_model, "measure_target_seconds", refuse)
    monkeypatch.setattr(cost_model, "measure_draft_seconds", refuse)


@pytest.mark.parametrize("rows,settings", [(1, AUTO), (2, AUTO), (1, TREE_AUTO), (2, TREE_AUTO)],
                         ids=["chain", "batched-chain", "tree", "batched-tree"])
def test_a_call_times_nothing_beyond_its_rounds(rows, settings, monkeypatch):
    """Every target forward of an ``"auto"`` call is one of its rounds (the prefill and one per round), with no table
    and with one: no forward is timed for the budget, in either loop."""
    target = target_of("llama")
    draft = tiny_draft(target, seed=2)
    ids = torch.cat([random_prompt(9, seed=3 + b) for b in range(rows)])
    mask = torch.ones_like(ids)
    ref = greedy(target, ids, attention_mask=mask, max_new_tokens=12)
    no_timing(monkeypatch)
    for call in range(2):  # an empty table, then the one the first call left
        seen = counting_forwards(target, monkeypatch)
        out = greedy(target, ids, attention_mask=mask, max_new_tokens=12, assistant_model=draft, **settings)
        assert torch.equal(out, ref)
        assert len(seen) == draft.last_batch_stats[0].num_target_forwards if rows > 1 else \
            len(seen) == draft.last_stats.num_target_forwards
        assert seen[0] == 9  # the prefill, then rounds of a few tokens
        monkeypatch.undo()
        no_timing(monkeypatch)
    assert any(key.endswith("|transformers" if rows == 1 and settings is AUTO else "|package")
               for key in cost_table().entries)


def test_a_new_context_length_times_nothing(monkeypatch):
    """A call at a context length no call has seen (here 300 tokens after a 9-token call) is priced from the costs
    stored for the shorter one: no forward timed, no round beyond its own."""
    target = target_of("llama")
    draft = tiny_draft(target, seed=2)
    no_timing(monkeypatch)
    greedy(target, random_prompt(9, seed=3), max_new_tokens=24, assistant_model=draft, **AUTO)
    seen = counting_forwards(target, monkeypatch)
    long = random_prompt(300, seed=4)
    out = greedy(target, long, max_new_tokens=12, assistant_model=draft, **AUTO)
    assert len(seen) == draft.last_stats.num_target_forwards and seen[0] == 300
    monkeypatch.undo()
    assert torch.equal(out, greedy(target, long, max_new_tokens=12))


def test_the_first_round_without_costs_is_plain_and_teaches_the_table(monkeypatch, tmp_path):
    """With an empty table the first round after the prefill is the target's own step (its time is the plain step's
    cost); the call leaves its learnt costs in the table and its file, and the next call drafts from its first round."""
    unlimited_allowance(monkeypatch)
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_model, "_TABLE", [])  # the process's table, read afresh from the new directory
    target = target_of("llama")
    draft = tiny_draft(target, seed=2)
    ids = random_prompt(9, seed=3)
    events, plan, choose = [], ChainBudget.plan, Eagle3DraftLengthPolicy.choose
    monkeypatch.setattr(ChainBudget, "plan", lambda self, *a, **k: events.append("plan") or plan(self, *a, **k))
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose",
                        lambda self, *a, **k: events.append("priced") or choose(self, *a, **k))
    greedy(target, ids, max_new_tokens=10, assistant_model=draft, **AUTO)
    assert events[:2] == ["plan", "plan"]  # the first round: no costs to price it with, a plain step timed
    key = cost_key(target, draft, 1, masked=False)
    stored = json.loads((tmp_path / "costs.json").read_text())["entries"][key]
    assert "1" in stored["128"]["target"]
    events.clear()
    greedy(target, ids, max_new_tokens=30, assistant_model=draft, num_assistant_tokens=2, **AUTO)
    assert "priced" in events  # every length's cost learnt: the budget prices the rounds after
    events.clear()
    greedy(target, ids, max_new_tokens=10, assistant_model=draft, num_assistant_tokens=2, **AUTO)
    assert events[:2] == ["plan", "priced"]  # the costs known: the first round is priced


def test_the_table_persists_and_reloads(tmp_path):
    """What one process stores, the next reads (a shipped or passed table merges the same way); a bad file is
    refused with the fix; reset forgets and deletes."""
    path = tmp_path / "costs.json"
    table = CostTable(path)
    table.store("k", 300, Eagle3Costs({1: 0.1, 4: 0.2}, {1: 0.01}, 0.005))
    assert table.save() == path
    again = CostTable(path)
    costs = again.costs("k", 512)
    assert costs.target == {1: 0.1, 4: 0.2} and costs.draft_feed == {1: 0.01} and costs.draft_step == 0.005
    assert CostTable(None).load(path).costs("k", 512).target == {1: 0.1, 4: 0.2}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="hf-eagle3 calibrate"):
        CostTable(tmp_path / "bad.json")
    again.reset()
    assert not path.exists() and again.costs("k", 512).target == {}
    blocked = CostTable(tmp_path / "a-file" / "costs.json")  # its folder cannot be made: warned once, nothing left
    (tmp_path / "a-file").write_text("")
    blocked.store("k", 300, Eagle3Costs({1: 0.1}, {}, None))
    with pytest.warns(UserWarning, match="HF_EAGLE3_CACHE"):
        assert blocked.save() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bad.json"]


def test_costs_are_interpolated_across_context_lengths():
    """Costs stored at two context buckets give a line in the context length: between them, beyond them (never
    below the smallest stored), and a size stored at one bucket only keeps its value."""
    table = CostTable(None)
    table.store("k", 100, Eagle3Costs({1: 1.0, 8: 2.0}, {}, None))
    table.store("k", 1000, Eagle3Costs({1: 2.0}, {}, None))  # buckets 128 and 1024
    assert table.costs("k", 576).target[1] == pytest.approx(1.5)
    assert table.costs("k", 1920).target[1] == pytest.approx(3.0)
    assert table.costs("k", 16).target[1] == pytest.approx(1.0)
    assert table.costs("k", 576).target[8] == pytest.approx(2.0)


def test_learning_from_rounds():
    """A cost the table lacks is learnt from rounds: the first timing set aside (one-time costs), the fastest of the
    next two kept, then fixed; a forward of n tokens counts at most n plain steps; a known cost is never changed."""
    costs = Eagle3Costs()
    for seconds in (5.0, 1.2, 1.0):
        assert not costs.ready and costs.observations(1) < 3
        costs.learn(1, seconds)
    assert costs.target == {1: 1.0} and costs.observations(1) == 3
    costs.learn(1, 0.1)
    costs.learn(1, 9.0)
    assert costs.target[1] == 1.0  # fixed
    for _ in range(3):
        costs.learn(4, 9.0, fed=3, feed_seconds=0.3, steps=2, step_seconds=0.2)
    assert costs.target[4] == pytest.approx(4.0)  # at most 4 plain steps
    assert costs.draft_feed[3] == pytest.approx(0.3) and costs.draft_step == pytest.approx(0.1)
    # relative (chains, whose lengths take turns): a forward learnt as a multiple of the plain step timed before it,
    # so a machine slower for a while (here 5x, from the second turn on) slows both alike
    for plain, three in ((1.0, 1.5), (5.0, 7.5), (5.0, 8.0)):
        costs.learn(1, plain)
        costs.learn(3, three, relative=True)
    assert costs.target[3] == pytest.approx(1.5 * costs.target[1])


def test_calibrate_fills_the_table_ahead_of_time(tmp_path, monkeypatch):
    """``calibrate`` times every forward at each context length for each loop and writes the table; a call then
    starts priced (its first round is not the plain step that learns a missing one)."""
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_model, "_TABLE", [])
    monkeypatch.setattr(cost_model, "TARGET_SIZES", (1, 2, 4))
    target = target_of("qwen3")
    draft = tiny_draft(target, seed=4)
    draft.bind_target(target)
    lines = []
    out = calibrate(target, draft, batch_sizes=(1, 3), contexts=(16, 64), progress=lines.append)
    keys = {cost_key(target, draft, 1, False), cost_key(target, draft, 1, True), cost_key(target, draft, 3, True)}
    assert set(out) == keys and len(lines) == 6  # rows 3: the package's loop only (Transformers' takes one row)
    stored = json.loads((tmp_path / "costs.json").read_text())["entries"]
    for key in keys:
        assert set(stored[key]) == {"128"} or set(stored[key]) == {"16", "64"}
    costs = cost_table().costs(cost_key(target, draft, 1, False), 40)
    assert costs.ready and set(costs.target) >= {1, 2, 4} and costs.draft_step > 0
    events, choose = [], Eagle3DraftLengthPolicy.choose
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose",
                        lambda self, *a, **k: events.append("priced") or choose(self, *a, **k))
    (tmp_path / "costs.json").unlink()
    greedy(target, random_prompt(9, seed=3), max_new_tokens=6, assistant_model=draft, num_assistant_tokens=1, **AUTO)
    assert len(events) == draft.last_stats.num_target_forwards - 2  # every round priced but the last (no room)
    assert not (tmp_path / "costs.json").exists()  # nothing learnt: nothing written


class FakeClock:
    """A clock that only target forwards move: ``1 + slope * (n - 1)`` seconds for ``n`` new tokens."""

    def __init__(self, slope: float):
        self.now, self.slope = 0.0, slope

    def forward_of(self, forward):
        def timed(*args, **kwargs):
            self.now += 1.0 + self.slope * (kwargs["input_ids"].shape[1] - 1)
            return forward(*args, **kwargs)
        return timed


@pytest.mark.parametrize("slope", [0.0, 3.0], ids=["free-verification", "dear-verification"])
def test_the_budget_learns_from_its_rounds_whether_drafting_pays(slope, monkeypatch):
    """An oracle draft (accepted but at a few positions) on a fake clock: where verifying more tokens costs nothing
    the budget learns to draft long chains; where each further token costs three plain steps it learns to draft
    (almost) nothing. Nothing but the rounds of a first call taught it, and every output is the target's."""
    target = target_of("llama")
    length, new = 7, 60
    ids = random_prompt(length, seed=11)
    ref = greedy(target, ids, max_new_tokens=new)
    draft = draft_covering(target, ref[0, length:].tolist(), 48)
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", oracle_select(target, draft, {length + 9, length + 40}))
    clock = FakeClock(slope)
    monkeypatch.setattr(cost_model.Stopwatch, "mark", lambda self: clock.now)
    monkeypatch.setattr(target, "forward", clock.forward_of(target.forward))
    no_timing(monkeypatch)
    for call in range(2):  # the first learns the costs (the lengths take turns), the second decides from them
        out = greedy(target, ids, max_new_tokens=new, assistant_model=draft, num_assistant_tokens=4, **AUTO)
        assert torch.equal(out, ref)
    stats = draft.last_stats
    if slope == 0.0:
        assert stats.num_drafts > 3 * stats.num_rounds_without_draft and stats.mean_draft_length > 3
    else:
        assert stats.num_rounds_without_draft > 3 * stats.num_drafts


def test_fixed_budgets_and_plans():
    """A given shape is kept, its depth cut to the room left; a chain is a tree with one child per node; the draft
    declares its memory, which reset forgets."""
    assert FixedBudget(5).plan(room=3) == RoundPlan(3, 1, 5) and FixedBudget(5).plan(room=0) == PLAIN
    assert FixedBudget(4, 4, 8).plan() == RoundPlan(4, 4, 8) and not FixedBudget(4).timed
    assert not PLAIN.drafts and RoundPlan(1, 1, 1).drafts
    target = target_of("llama")
    draft = tiny_draft(target, seed=2)
    assert isinstance(draft.drafting_memory, DraftingMemory) and draft.drafting_memory.chain is None
    greedy(target, random_prompt(9, seed=3), max_new_tokens=6, assistant_model=draft, **AUTO)
    assert draft.drafting_memory.chain is not None
    draft.drafting_memory.reset()
    assert draft.drafting_memory == DraftingMemory()


def test_calibrate_command_times_shows_ships_loads_and_resets(tmp_path, monkeypatch, capsys):
    """``hf-eagle3 calibrate`` on saved tiny models: it times into this machine's table, ``--out`` writes a copy to
    ship, ``--show`` prints the table, ``--reset`` forgets it and ``--load`` merges the shipped copy back."""
    from hf_eagle3 import cli

    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_model, "_TABLE", [])
    monkeypatch.setattr(cost_model, "TARGET_SIZES", (1, 2))
    target = target_of("llama")
    draft = tiny_draft(target, seed=4)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    shipped = tmp_path / "shipped.json"
    assert cli.main(["calibrate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                     "--contexts", "16,32", "--out", str(shipped)]) == 0
    table = json.loads((tmp_path / "cache" / "costs.json").read_text())
    assert table == json.loads(shipped.read_text()) and len(table["entries"]) == 2  # both loops, one row
    capsys.readouterr()
    assert cli.main(["calibrate", "--show"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(tmp_path / "cache" / "costs.json")
    assert cli.main(["calibrate", "--reset"]) == 0
    assert not (tmp_path / "cache" / "costs.json").exists() and not cost_table().entries
    assert cli.main(["calibrate", "--load", str(shipped)]) == 0
    assert json.loads((tmp_path / "cache" / "costs.json").read_text()) == table
    with pytest.raises(SystemExit, match="positive integers"):
        cli.main(["calibrate", "--contexts", "0"])


def test_a_chain_asked_for_wins_over_a_saved_tree(monkeypatch):
    """A draft that saves a tree (as the shipped one saves tree "auto") still drafts exactly the chain a call asks for:
    a given ``num_assistant_tokens`` is never overridden by a saved setting."""
    target = target_of("llama")
    draft = tiny_draft(target, seed=3)
    draft.generation_config.tree_top_k, draft.generation_config.tree_depth = 4, 5
    draft.generation_config.tree_total_tokens = "auto"
    ids = random_prompt(6, seed=1)
    ref = greedy(target, ids, max_new_tokens=12)
    out = greedy(target, ids, max_new_tokens=12, assistant_model=draft, num_assistant_tokens=3)
    assert torch.equal(out, ref) and draft.last_stats.drafted_per_position == [10, 9, 8]  # 3 a round, chains
    seen = counting_forwards(target, monkeypatch)
    assert torch.equal(greedy(target, ids, max_new_tokens=12, assistant_model=draft), ref)  # the saved tree
    assert any(n > 4 for n in seen[1:])  # a tree round verifies more nodes than a chain of 3 would


def test_a_tree_budget_without_costs_learns_its_first_size_before_sizing(monkeypatch):
    """With an empty table, tree ``"auto"`` drafts trees of its first size (at full depth) once the plain step is
    known, until that size's cost is learnt (one known size would price every size alike, and varying sizes are never
    timed often enough to be learnt); then it sizes its trees from the learnt costs. Every output is the target's."""
    unlimited_allowance(monkeypatch)
    from hf_eagle3.core.budget import TreeBudget

    target = target_of("llama")
    draft = tiny_draft(target, seed=2)
    ids = random_prompt(9, seed=5)
    clock = FakeClock(0.05)
    monkeypatch.setattr(cost_model.Stopwatch, "mark", lambda self: clock.now)
    monkeypatch.setattr(target, "forward", clock.forward_of(target.forward))
    no_timing(monkeypatch)
    plans, plan = [], TreeBudget.plan

    def record(self, *args, **kwargs):
        chosen = plan(self, *args, **kwargs)
        plans.append((chosen, sorted(self.costs.target)))
        return chosen

    monkeypatch.setattr(TreeBudget, "plan", record)
    wide = {"tree_top_k": 4, "tree_depth": 3, "tree_total_tokens": "auto"}  # up to 36 nodes; the first tree has 16
    out = greedy(target, ids, max_new_tokens=40, assistant_model=draft, **wide)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=40))
    trees = [(p, known) for p, known in plans if p.drafts]
    first = trees[0][0].total
    while_learning = [p for p, known in trees if known == [1]]
    assert first == 16 and len(while_learning) >= 3
    assert all(p.total == first and p.depth == wide["tree_depth"] for p in while_learning)
    assert first + 1 in plans[-1][1]  # the first size's target forward was learnt within the call


@pytest.mark.allowance
def test_the_loss_allowance_accounts_and_refuses():
    """A round that drafted gains its tokens at a plain round's price and pays its seconds; a round may draft only
    while its loss, should it accept nothing (its predicted seconds, scaled by how much longer the call's last drafted
    round took than predicted), keeps the call within ``MAX_LOSS`` of its horizon in plain steps."""
    from hf_eagle3.core.budget import MAX_LOSS, LossAllowance, RoundOutcome

    costs = Eagle3Costs({1: 1.0, 8: 2.0}, {}, None)
    allowance = LossAllowance(horizon=100)
    limit = MAX_LOSS * 1.0 * 100  # seconds the call may lose at the costs' plain step
    assert not allowance.permits(1.0 + limit + 0.01, costs) and allowance.permits(1.0 + limit - 0.01, costs)
    allowance.spend(RoundOutcome(PLAIN, [0], [0], 0, 1, 0.5, 0.5), costs)  # the call's plain rounds set the price
    assert allowance.price(costs) == 0.5 and allowance.net == 0.0
    limit = MAX_LOSS * 0.5 * 100
    allowance.spend(RoundOutcome(RoundPlan(3, 1, 3), [3], [3], 1, 4, 1.5, 1.0), costs)  # 4 tokens in 1.5 s: +0.5 s
    assert allowance.net == pytest.approx(0.5)
    seconds = 1.25 + limit / 2  # 1.5 tokens (0.75 s at the price) in these seconds: the net at -limit / 2
    allowance.spend(RoundOutcome(RoundPlan(3, 2, 6), [3, 3], [0, 1], 1, 7, seconds, 1.0), costs)
    assert allowance.net == pytest.approx(-limit / 2) and allowance.pace == 1.0  # no slower than predicted
    assert allowance.permits(0.5 + 0.4 * limit, costs)  # at worst -0.9 limit
    assert not allowance.permits(0.5 + 0.6 * limit, costs)  # at worst -1.1 limit
    assert allowance.permits(0.6, costs)
    allowance.spend(RoundOutcome(RoundPlan(1, 1, 1), [1], [1], 1, 2, 1.2, 1.0), costs)  # predicted 0.6 s, took 1.2 s
    assert allowance.pace == pytest.approx(2.0)
    assert not allowance.permits(0.5 + 0.3 * limit, costs)  # twice that: 0.5 + 0.6 limit, lost past the limit


@pytest.mark.allowance
@pytest.mark.parametrize("settings", [AUTO, TREE_AUTO], ids=["chain", "tree"])
def test_a_call_the_draft_reads_badly_loses_at_most_its_allowance(settings, monkeypatch):
    """Every drafted token rejected (a random draft) where a target forward of ``n`` tokens costs ``1 + 0.4 (n - 1)``
    plain steps (a fake clock), no table, and estimates that always say "draft": the call's rounds that draft lose no
    more than ``MAX_LOSS`` of its plain time and the round that crossed it; with no allowance the same call loses
    several times that (the test can fail). The output is the target's."""
    from hf_eagle3.core import budget, tree_policy

    target = target_of("llama")
    ids = random_prompt(9, seed=7)
    new = 160
    ref = greedy(target, ids, max_new_tokens=new)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *a, **k: True)
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose", lambda self, most, **k: most)
    losses, allowed = {}, budget.MAX_LOSS
    for limit in (allowed, float("inf")):
        monkeypatch.setattr(budget, "MAX_LOSS", limit)
        cost_table().reset()
        draft = tiny_draft(target, seed=2)
        clock = FakeClock(0.4)
        with monkeypatch.context() as m:
            m.setattr(cost_model.Stopwatch, "mark", lambda self: clock.now)
            m.setattr(target, "forward", clock.forward_of(target.forward))
            out = greedy(target, ids, max_new_tokens=new, assistant_model=draft, **settings)
        assert torch.equal(out, ref)
        plain_time = (1 + 0.4 * (ids.shape[1] - 1)) + (new - 1)  # the prefill, then a plain step per token
        losses[limit] = clock.now - plain_time
        assert draft.last_stats.num_accepted_tokens <= 2  # the random draft: (almost) every token rejected
    worst_round = 0.4 * (budget.auto_most_nodes(3, 2) if settings is TREE_AUTO else 4)  # less the plain step
    assert 0 < losses[allowed] <= allowed * new + worst_round
    assert losses[float("inf")] > 3 * (allowed * new + worst_round)


@pytest.mark.allowance
def test_a_round_too_dear_for_the_allowance_is_cut_to_fit(monkeypatch):
    """The estimates' round is cut (nodes halved, depth no more than nodes) to the largest that keeps the call
    within its allowance should it accept nothing; a plain round when not even one node fits."""
    from hf_eagle3.core import budget

    monkeypatch.setattr(budget, "MAX_LOSS", 0.02)  # 2 plain steps of a 100-token call at 1 s a step
    costs = Eagle3Costs({1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0, 16: 5.0, 32: 9.0}, {1: 0.0}, 0.0)
    fitting = budget._LearntCosts(costs, "k", 128, horizon=100)
    assert fitting.fit(RoundPlan(3, 1, 3), 1) == RoundPlan(3, 1, 3)  # at worst 2.0 - 1.0: fits as it is
    assert fitting.fit(RoundPlan(5, 4, 16), 1) == RoundPlan(4, 4, 4)  # 17 nodes lose 4.25, 9 lose 2.25, 5 lose 1.25
    fitting.allowance.net = -1.9  # lost nearly all of it: only a round that costs at most 0.1 more than a plain step
    assert fitting.fit(RoundPlan(5, 4, 16), 1) == PLAIN  # even one drafted node (2 tokens, 1.5 s) loses 0.5
    assert fitting.fit(PLAIN, 1) == PLAIN
