"""The cost model and the ``"auto"`` draft-length policy (``num_assistant_tokens_schedule="auto"``).

The policy is tested on stubbed costs (it drafts nothing when verification is costly and acceptance low, long drafts
when verification is free and acceptance high, and probes while it drafts nothing); decoding with it stays lossless
(greedy identity on four architectures with rounds that draft nothing between rounds that draft, the draft's cache
equal to a from-scratch forward after deferred feeds, the chi-square test with a negative control); an explicit
``num_assistant_tokens`` is never overridden. The cost table and the budgets are in ``test_budget.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import (
    assisted_continuations,
    greedy,
    known_costs,
    random_prompt,
    sampling_models,
    tiny_draft,
    token_p_values,
    unlimited_allowance,
)
from conftest import cached_target as target_of
from test_greedy_identity import check_recorded_scores, draft_covering, oracle_select
from test_sampling_distribution import ALPHA, PROMPT, SAMPLING, _broken_processors, plain_samples, target_like

from hf_eagle3 import Eagle3CandidateGenerator
from hf_eagle3.core import cost_model, draft_length_policy
from hf_eagle3.core.cost_model import Eagle3Costs, interpolate, measure_round_costs
from hf_eagle3.core.draft_length_policy import (
    PROBE_BUDGET,
    PROBE_EVERY,
    Eagle3AcceptanceEstimate,
    Eagle3DraftLengthPolicy,
    ProbeSchedule,
)

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
AUTO = {"num_assistant_tokens_schedule": "auto"}


def costs(verify_slope: float, step: float = 0.05) -> Eagle3Costs:
    """Stub costs: a one-token target forward takes 1 s, each further token ``verify_slope`` s; draft steps ``step``."""
    target = {n: 1.0 + verify_slope * (n - 1) for n in (1, 2, 4, 8, 16)}
    return Eagle3Costs(target=target, draft_feed={1: step, 16: 2 * step}, draft_step=step)


def estimate(rate: float, rounds: int = 200, k: int = 8) -> Eagle3AcceptanceEstimate:
    """An estimate that has seen ``rounds`` rounds of ``k`` drafts, each accepted with conditional rate ``rate``."""
    est = Eagle3AcceptanceEstimate(decay=1.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        accepted = 0
        while accepted < k and torch.rand((), generator=gen) < rate:
            accepted += 1
        est.observe(k, accepted)
    return est


# ------------------------------------------------------------------------------------------------ the policy alone
def test_interpolate():
    table = {1: 1.0, 2: 3.0, 4: 4.0}
    assert interpolate(table, 1) == 1.0 and interpolate(table, 0) == 1.0
    assert interpolate(table, 3) == pytest.approx(3.5)
    assert interpolate(table, 6) == pytest.approx(5.0)  # linear beyond the last size


def test_estimate_is_conditional_and_follows_the_prior():
    est = Eagle3AcceptanceEstimate(prior=0.5, prior_weight=2.0, decay=1.0)
    assert est.rates(3) == [0.5, 0.5, 0.5]
    assert est.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    for _ in range(8):
        est.observe(2, 2)  # both accepted
    for _ in range(8):
        est.observe(2, 0)  # the first rejected: position 2 not reached
    rates = est.rates(3)
    assert rates[0] == pytest.approx((8 + 1) / (16 + 2))
    assert rates[1] == pytest.approx((8 + 2 * rates[0]) / (8 + 2))  # 8 of the 8 rounds that reached it
    assert rates[2] == pytest.approx(rates[1])  # never drafted: inherits the position before it
    decayed = Eagle3AcceptanceEstimate(decay=0.5)
    for _ in range(10):
        decayed.observe(1, 1)
    for _ in range(3):
        decayed.observe(1, 0)
    assert decayed.rates(1)[0] < 0.5  # recent rejections dominate older acceptances


def test_probe_schedule_counts_rounds_and_backs_off():
    probes = ProbeSchedule()
    decisions = [probes.probe_now() for _ in range(PROBE_EVERY * 8)]  # probes that cost nothing: the count decides
    at = [i for i, probe in enumerate(decisions) if probe]
    assert at[0] == PROBE_EVERY - 1  # a probe after PROBE_EVERY rounds without a draft
    assert at[1] - at[0] == 2 * PROBE_EVERY  # that did not change the decision: the next one comes twice as late
    assert len(at) <= 3
    futile = ProbeSchedule()
    assert not any(futile.probe_now(useful=False) for _ in range(PROBE_EVERY * 2))
    assert futile.probe_now()  # the rounds counted while a probe could not change the decision


@pytest.mark.parametrize("max_k", [1, 5, 8])
def test_policy_drafts_nothing_when_verification_is_costly_and_acceptance_low(max_k):
    """Drafting clearly does not pay: the policy drafts nothing, and its probes wait until the rounds without a draft
    have paid for what a probe is expected to lose, so that probes cost at most PROBE_BUDGET of the time."""
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.6), estimate(0.3))
    assert policy.best(max_k) == 0
    plain = policy.costs.round_seconds(0)  # 1 s, one token
    choices, lost, waited = [], 0.0, 0.0
    for _ in range(PROBE_EVERY * 16):
        choices.append(policy.choose(max_k))
        tokens, seconds = policy.round_of(choices[-1])
        if choices[-1]:
            lost += seconds - tokens * plain
        else:
            policy.observe_time(0, plain, feed=0)
            waited += plain
    probes = [i for i, k in enumerate(choices) if k > 0]
    tokens, seconds = policy.round_of(choices[probes[0]])
    loss = seconds - tokens * plain
    assert loss / PROBE_BUDGET > PROBE_EVERY  # more than the count schedule waits: the budget sets the probes' pace
    assert probes[0] == math.ceil(loss / PROBE_BUDGET)  # the first probe once the time waited pays for it
    assert probes[1] - probes[0] - 1 >= loss / PROBE_BUDGET
    assert 2 <= len(probes) and lost <= PROBE_BUDGET * waited


def test_policy_drafts_long_when_verification_is_free_and_acceptance_high():
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.0, step=0.02), estimate(0.85))
    assert policy.choose(7) == 7
    assert policy.choose(3) == 3


def rows_estimate(rate: float, rows: int, rounds: int = 60, k: int = 3, one_by_one: bool = False):
    """An estimate after ``rounds`` batch rounds of ``rows`` rows drafting ``k`` each (conditional rate ``rate``),
    recorded as batch rounds, or (``one_by_one``) as one-row rounds one after the other."""
    est, gen = Eagle3AcceptanceEstimate(), torch.Generator().manual_seed(1)
    for _ in range(rounds):
        drafts = []
        for _ in range(rows):
            accepted = 0
            while accepted < k and torch.rand((), generator=gen) < rate:
                accepted += 1
            drafts.append((k, accepted))
        if one_by_one:
            for drafted, accepted in drafts:
                est.observe(drafted, accepted)
        else:
            est.observe_rows(drafts)
    return est


def test_a_batch_round_is_one_round_of_evidence():
    """A batch round decays the older drafts once, as a round of one sequence does, and adds one draft per row: one
    lucky round of eight rows barely moves an estimate of many such rounds. Taken as eight rounds of one row each, the
    older drafts would decay eight times a round, and the same lucky round would move the estimate far more."""
    est, apart = rows_estimate(0.5, rows=8), rows_estimate(0.5, rows=8, one_by_one=True)
    before, before_apart = est.rates(1)[0], apart.rates(1)[0]
    assert before == pytest.approx(0.5, abs=0.05) and before_apart == pytest.approx(0.5, abs=0.15)
    est.observe_rows([(3, 3)] * 8)
    for _ in range(8):
        apart.observe(3, 3)
    moved, moved_apart = est.rates(1)[0] - before, apart.rates(1)[0] - before_apart
    assert 0 < moved < 0.04 and moved_apart > 0.1
    counts = (list(est.reached), list(est.accepted))
    est.observe_rows([(0, 0)] * 8)  # a round that drafted nothing records nothing and ages nothing
    assert (est.reached, est.accepted) == counts
    est.observe_rows([(0, 0), (2, 1)])  # rows that drafted nothing are left out of a round that drafted
    assert est.reached[0] == pytest.approx(counts[0][0] * est.decay + 1)
    assert est.accepted[1] == pytest.approx(counts[1][1] * est.decay)


def test_a_batch_estimate_carries_rounds_of_its_rows():
    """What carries to the next call is :data:`CARRIED_WEIGHT` rounds of as many rows as the call's rounds had:
    for eight rows, eight times what one sequence carries."""
    weight = draft_length_policy.CARRIED_WEIGHT
    wide, one = rows_estimate(0.6, rows=8).carried(), rows_estimate(0.6, rows=1).carried()
    assert max(wide.reached) == pytest.approx(8 * weight) and max(one.reached) == pytest.approx(weight)
    assert wide.width == one.width == 1  # the next call's rows set its own width


def test_policy_picks_an_interior_length_and_returns_after_a_probe_that_pays():
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.15), estimate(0.6))
    k = policy.choose(8)
    assert 1 <= k < 8  # each token verified costs 0.15: long drafts stop paying
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.6), estimate(0.3, rounds=4))
    while policy.choose(5) == 0:  # plain rounds until the probe
        policy.observe_time(0, policy.costs.round_seconds(0), feed=0)
    for _ in range(60):  # the text turns easy: every probe token accepted
        policy.observe(5, 5)
    assert policy.choose(5) > 0
    assert policy.probe_every == PROBE_EVERY


def test_policy_learns_the_pace_of_its_rounds():
    """Drafting rounds that run slower than their costs say (the loop's bookkeeping) are priced at their measured
    pace, and drafting stops paying; a machine slower as a whole (both kinds of round alike) changes no decision."""
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.1), estimate(0.5))
    best = policy.best(4)
    assert best > 0
    for _ in range(20):  # drafting rounds take twice what the costs say; plain rounds what they say
        policy.observe_time(2, 2.0 * policy.costs.round_seconds(2, 1), feed=1)
        policy.observe_time(0, policy.costs.round_seconds(0), feed=0)
    assert policy.pace[True] == pytest.approx(2.0, rel=0.05) and policy.best(4) == 0
    slower = Eagle3DraftLengthPolicy(costs(verify_slope=0.1), estimate(0.5))
    for _ in range(20):  # everything 3x slower than when the costs were measured
        slower.observe_time(2, 3.0 * slower.costs.round_seconds(2, 1), feed=1)
        slower.observe_time(0, 3.0 * slower.costs.round_seconds(0), feed=0)
    assert slower.best(4) == best


def test_a_kind_of_round_not_yet_measured_runs_at_the_other_kinds_pace():
    """Until the call has run a plain round, it is priced at the pace of the rounds with a draft (and the other way
    round): the machine's pace is common to both, so no decision flips on a kind not yet measured."""
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.1), estimate(0.5))
    for _ in range(20):  # drafting rounds run at 1.5x their costs; no plain round yet
        policy.observe_time(2, 1.5 * policy.costs.round_seconds(2, 1), feed=1)
    assert policy.pace[False] is None
    tokens, seconds = policy.round_of(0)
    assert seconds == pytest.approx(1.5 * policy.costs.round_seconds(0), rel=1e-3)
    fresh = Eagle3DraftLengthPolicy(costs(verify_slope=0.1), estimate(0.5))
    assert fresh.round_of(2, feed=1)[1] == pytest.approx(fresh.costs.round_seconds(2, 1))  # nothing measured: costs


def test_policy_state_carries_to_the_next_call():
    policy = Eagle3DraftLengthPolicy(costs(verify_slope=0.6), estimate(0.3))
    for _ in range(60):
        if not policy.choose(5):
            policy.observe_time(0, policy.costs.round_seconds(0), feed=0)
    carried = policy.carried()
    nxt = Eagle3DraftLengthPolicy.from_carried(policy.costs, carried)
    assert nxt.probe_every == policy.probe_every > PROBE_EVERY
    assert nxt.probes.waited == policy.probes.waited > 0  # the time waited since the last probe counts in the next call
    assert nxt.estimate.rates(1)[0] == pytest.approx(policy.estimate.rates(1)[0], abs=0.03)
    assert max(nxt.estimate.reached) <= draft_length_policy.CARRIED_WEIGHT + 1e-9  # a prior, not the whole history


# ---------------------------------------------------------------------------------------- decoding with "auto"
def scripted_choices(pattern):
    """A ``choose`` that follows ``pattern`` (cycled, capped at ``max_k``) instead of the clock."""
    it = itertools.cycle(pattern)

    def choose(self, max_k, feed=1, **batch):
        return min(next(it), max_k)

    return choose


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_greedy_identity_with_rounds_that_draft_nothing(arch, monkeypatch):
    target = target_of(arch)
    draft = tiny_draft(target, 48, seed=2)
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose", scripted_choices([0, 0, 3, 0, 1, 0, 0, 0, 4, 2]))
    for length, max_new in [(5, 17), (11, 30)]:
        ids = random_prompt(length, seed=length)
        ref = greedy(target, ids, max_new_tokens=max_new)
        out = greedy(target, ids, max_new_tokens=max_new, assistant_model=draft, **AUTO)
        assert torch.equal(out, ref)
        stats = draft.last_stats
        assert stats.num_drafts > 0 and stats.num_rounds_without_draft > 0
        assert stats.num_target_forwards == stats.num_drafts + stats.num_rounds_without_draft + 1


def test_auto_real_policy_greedy_identity():
    """The unscripted policy (real timing of a tiny target) decodes losslessly and records its choices."""
    target = target_of("llama")
    draft = tiny_draft(target, seed=2)
    ids = random_prompt(9, seed=3)
    ref = greedy(target, ids, max_new_tokens=40)
    out = greedy(target, ids, max_new_tokens=40, assistant_model=draft, num_assistant_tokens=4, **AUTO)
    assert torch.equal(out, ref)
    stats = draft.last_stats
    assert stats.num_target_forwards == stats.num_drafts + stats.num_rounds_without_draft + 1
    assert len(stats.drafted_per_position) <= 4
    assert draft.drafting_memory.chain["estimate"] is not None  # carried to the next call


def test_deferred_feed_matches_scratch_forward(monkeypatch):
    """After rounds that draft nothing, the draft consumes all the verified positions at once: its scores equal a
    from-scratch forward over the whole sequence, at every draft step."""
    unlimited_allowance(monkeypatch)
    target = target_of("llama")
    length, k = 14, 3
    ids = random_prompt(length, seed=21)
    ref = greedy(target, ids, max_new_tokens=24)
    draft = draft_covering(target, ref[0, length:].tolist(), 48, seed=5)
    record = []
    monkeypatch.setattr(Eagle3CandidateGenerator, "_select", oracle_select(target, draft, {length + 2, length + 9},
                                                                             record=record))
    original_get = Eagle3CandidateGenerator.get_candidates

    def get_candidates(self, input_ids, **kwargs):
        record.append(("round", input_ids.shape[1]))
        return original_get(self, input_ids, **kwargs)

    monkeypatch.setattr(Eagle3CandidateGenerator, "get_candidates", get_candidates)
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose", scripted_choices([0, 0, 0, k, 0, 2, 0, 0, k]))
    with torch.no_grad():
        out = greedy(target, ids, max_new_tokens=24, assistant_model=draft, num_assistant_tokens=k, **AUTO)
    assert torch.equal(out, ref)
    assert draft.last_stats.num_accepted_tokens > 0

    assert check_recorded_scores(target, draft, out, record, k) >= 2 * k


def test_explicit_num_assistant_tokens_is_never_overridden(monkeypatch):
    target = target_of("llama")
    draft = tiny_draft(target, seed=3)
    draft.generation_config.num_assistant_tokens_schedule = "auto"
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose", scripted_choices([0]))  # "auto" would never draft
    known_costs(target, draft, masked=False)  # (no rounds spent learning costs)
    ids = random_prompt(6, seed=1)
    greedy(target, ids, max_new_tokens=12, assistant_model=draft)  # the saved "auto"
    assert draft.last_stats.num_drafts == 0
    greedy(target, ids, max_new_tokens=12, assistant_model=draft, num_assistant_tokens=3)
    stats = draft.last_stats
    assert stats.drafted_per_position == [10, 9, 8]  # 3 per round (the random draft's are rejected), to the end
    assert stats.num_rounds_without_draft == 1  # only the last round, with max_length reached
    assert draft.generation_config.num_assistant_tokens_schedule == "auto"
    with pytest.raises(ValueError, match="auto"):
        greedy(target, ids, max_new_tokens=4, assistant_model=draft, num_assistant_tokens_schedule="fastest")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_loops_forwards_are_timed_with_the_loops_mask(arch, monkeypatch):
    """Every target forward of the package's loop carries a 4D attention mask, and an attention kernel may run a
    one-token step at another speed without one: ``masked=True`` times each forward with the loop's mask (every row
    sees the cached context, the new tokens a causal triangle; one mask per layer kind where sliding and full layers
    mix); ``masked=False`` times them as Transformers' loop runs an unpadded row, with no mask given."""
    target = target_of(arch)
    given, forward = [], target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: given.append(k) or forward(*a, **k))
    ids = random_prompt(20, seed=3).repeat(3, 1)
    seconds = cost_model.measure_target_seconds(target, ids, sizes=(1, 3), repeats=1, masked=True)
    assert set(seconds) == {1, 3} and all(s > 0 for s in seconds.values())
    timed = [k for k in given if "position_ids" in k]  # the prefill is not timed
    assert len(timed) == 4  # a warm-up and a timed forward per size
    for kwargs in timed:
        n = kwargs["input_ids"].shape[1]
        masks = kwargs["attention_mask"]
        masks = masks if isinstance(masks, dict) else {"full_attention": masks}
        assert ("sliding_attention" in masks) == (arch == "gemma3")
        for kind, mask in masks.items():
            allowed = mask == 0
            assert mask.dtype == target.dtype and allowed.shape[:3] == (3, 1, n)
            assert torch.equal(allowed[..., -n:], torch.ones(n, n, dtype=torch.bool).tril().expand(3, 1, n, n))
            if kind == "full_attention":
                assert allowed.shape[-1] == 20 + n and allowed[..., :20].all()
    given.clear()
    cost_model.measure_target_seconds(target, ids, sizes=(1, 3), repeats=1)
    assert [k.get("attention_mask") for k in given if "position_ids" in k] == [None] * 4


# ---------------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("broken", [False, True], ids=["auto", "negative_control"])
def test_auto_sampling_keeps_target_distribution(broken, monkeypatch):
    """Rounds that draft 0, 1 or 2 tokens, sampled: the target's distribution (and a broken generator is caught)."""
    target, draft = sampling_models()
    monkeypatch.setattr(Eagle3DraftLengthPolicy, "choose", scripted_choices([0, 2, 1, 2, 0, 2]))
    if broken:
        monkeypatch.setattr(Eagle3CandidateGenerator, "_select", target_like(_broken_processors))
    old = draft.generation_config.num_assistant_tokens_schedule
    draft.generation_config.num_assistant_tokens_schedule = "auto"
    try:
        samples, accepted = assisted_continuations(target, draft, PROMPT, 300 if broken else 500, seed=7000,
                                                   num_assistant_tokens=2, num_assistant_tokens_schedule="auto",
                                                   **SAMPLING)
    finally:
        draft.generation_config.num_assistant_tokens_schedule = old
    p = token_p_values(samples, plain_samples())
    if broken:
        assert min(p.values()) < ALPHA / 3, p
    else:
        assert accepted > 0.2
        assert min(p.values()) > ALPHA / 3, p


def test_static_steps_are_timed_on_a_cache_of_the_calls_capacity(monkeypatch):
    """Static drafting steps attend over their cache's whole capacity: the draft is timed on a cache of the call's
    capacity bucket (and its buffers are the ones the call uses). Steps that are not static attend over the columns in
    use: no capacity is asked for."""
    target = target_of("llama")
    draft = tiny_draft(target, seed=4)
    draft.bind_target(target)
    timed, measure_draft = [], cost_model.measure_draft_seconds
    monkeypatch.setattr(cost_model, "measure_draft_seconds",
                        lambda d, **k: timed.append(k["capacity"]) or measure_draft(d, **k))
    ids = random_prompt(20, seed=3)
    dynamic = measure_round_costs(target, draft, ids, sizes=(1, 2), capacity=1000)
    assert timed == [None] and dynamic.draft_step > 0
    monkeypatch.setattr(type(draft), "static_steps", lambda self: True)  # as a compile config with static shapes
    draft.static_kv_buffers.clear()
    measure_round_costs(target, draft, ids, sizes=(1, 2), capacity=100)
    measure_round_costs(target, draft, ids, sizes=(1, 2), capacity=1000)
    assert timed == [None, 256, 1024]
    assert sorted(key[2] for key in draft.static_kv_buffers) == [256, 1024]


def test_synchronize_waits_for_every_device_of_a_sharded_model(monkeypatch):
    """A model's parameters on several GPUs: each device is waited for (a target spread by device_map queues work on
    each); a CPU device or model waits for nothing."""
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))

    class Sharded(torch.nn.Module):
        def parameters(self, recurse=True):
            return iter([torch.nn.Parameter(torch.empty(1, device="meta")), *fake])

    class FakeParameter:
        def __init__(self, device):
            self.device = torch.device(device)

    fake = [FakeParameter("cuda:0"), FakeParameter("cuda:1"), FakeParameter("cuda:1")]
    cost_model.synchronize(Sharded())
    assert sorted(waited) == ["cuda:0", "cuda:1"]
    waited.clear()
    cost_model.synchronize("cpu")
    cost_model.synchronize(torch.nn.Linear(2, 2))
    assert waited == []
    cost_model.synchronize("cuda:1")
    assert waited == ["cuda:1"]
