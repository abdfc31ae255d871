"""How much to draft: one budget, asked the same question by both decoding loops.

Glossary:

- **plan** (:class:`RoundPlan`): the shape of the next round: ``depth`` levels, ``top_k`` children per expanded node,
  ``total`` drafted nodes verified (a chain is a tree with one child per node; ``total = 0``: a plain round, the
  target's own step, nothing drafted).
- **feed**: verified positions the draft has not consumed yet (one forward consumes them when the next draft starts).
- **outcome** (:class:`RoundOutcome`): what a round brought (accepted tokens per row) and took (its timings).
- **costs**: the seconds of the forwards a round is made of (:class:`~hf_eagle3.core.cost_model.Eagle3Costs`), from
  the process's :class:`~hf_eagle3.core.cost_model.CostTable`: calibrated ahead of time, or learnt once from the
  rounds of the first calls that lacked them; no call times anything beyond its own rounds.
- **pace**: how much slower (or faster) the call's rounds run than their costs say, per kind of round (the policy's).
- **probe**: a round drafted to learn, where the current estimate says not to draft.
- **allowance** (:class:`LossAllowance`): what the rounds that draft may lose, all together, in one call, against
  the target's own steps; spent, the call's rounds are plain steps.
- **memory** (:class:`~hf_eagle3.core.drafting_memory.DraftingMemory`): what one call leaves to the next call of the
  same draft (acceptance estimates, the rows' spread), the one object the draft holds across calls.

A budget answers :meth:`Budget.plan` before each round and learns from :meth:`Budget.observe` after it;
:func:`budget_for` builds the one a call's settings ask for: :class:`FixedBudget` (a draft length or tree given),
:class:`ChainBudget` (``num_assistant_tokens_schedule="auto"``) or :class:`TreeBudget` (``tree_total_tokens="auto"``).
Chains and trees weigh a round by the same measure: its expected tokens (by which the batch nears its end) per second,
against a plain step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .batch_tail import ONE_ROW, BatchRows
from .cost_model import Eagle3Costs, cost_key, cost_table
from .drafting_memory import DraftingMemory
from .draft_length_policy import USUAL_FEED, Eagle3DraftLengthPolicy, smooth
from .settings import DEFAULT_DRAFT_LENGTH, resolve_draft_settings
from .tree_policy import TreeSizeChooser, auto_most_nodes


class RoundPlan(NamedTuple):
    """The shape of one round (see the module's glossary).

    Attributes:
        depth (`int`): levels drafted (a chain: its length).
        top_k (`int`): children per expanded node (1: a chain).
        total (`int`): drafted nodes verified per row (0: a plain round).
    """

    depth: int
    top_k: int
    total: int

    @property
    def drafts(self) -> bool:
        """Whether the round drafts anything."""
        return self.total > 0 and self.depth > 0


PLAIN = RoundPlan(0, 1, 0)

# The most a call's drafted rounds may lose, all together, against plain steps, as a fraction of the call's time in
# plain steps (its new tokens): what is left of the floor (a call >= 0.95x plain `generate`) after the timing's own
# spread (+-3 % between runs of the same call on a 2-core CPU). At 0.03 the first call after loading ran 0.947x plain
# with a cost table (median of 6: docs/bench_results/2026-12-07_first_calls_allowance_with_table_float32.json); at
# 0.02, with rounds cut to fit, 0.96x and 0.97x without a table (2026-12-07_first_calls_fit_*_float32.json).
MAX_LOSS = 0.02
PLAIN_SMOOTHING = 0.2  # exponential smoothing of the plain rounds' seconds, the price of a token (about 5 rounds)


@dataclass
class RoundOutcome:
    """What a finished round brought and took, as both loops hand it to :meth:`Budget.observe`.

    Args:
        plan (`RoundPlan`): the round's plan.
        drafted (`list[int]`): per row, the levels its draft reached, as far as usable (0: none).
        accepted (`list[int]`): per row, drafted tokens the target accepted.
        feed (`int`): positions per row (mean) the draft consumed at the start of the round (0: no feed).
        nodes (`int`): tokens per row the target's forward verified (the root included).
        seconds (`float`): the round's wall time (drafting, verification, bookkeeping).
        verify_seconds (`float`): the target's forward (and what the loop does with its logits before the read-back).
        draft_seconds (`float`): drafting, the feed included.
        feed_seconds (`float`): the feed.
        levels (`int`): draft forwards, the feed included (the levels drafted).
        ranking (*optional*): ``"tree_auto"``: the read-back candidates' ranking
            (``tree_candidates.candidate_ranking``).
        batch (`BatchRows`): the rows the next round drafts for.
    """

    plan: RoundPlan
    drafted: list
    accepted: list
    feed: int
    nodes: int
    seconds: float
    verify_seconds: float
    draft_seconds: float = 0.0
    feed_seconds: float = 0.0
    levels: int = 0
    ranking: object = None
    batch: BatchRows = ONE_ROW


class Budget:
    """The protocol: :meth:`plan` before a round, :meth:`observe` after it, :meth:`finish` at the end of the call.

    Attributes:
        depth (`int`): the most levels a round drafts.
        top_k (`int`): children per expanded node.
        most (`int`): the most drafted nodes a round verifies.
        timed (`bool`): whether the loop times its rounds for :meth:`observe`.
        needs_ranking (`bool`): whether :meth:`observe` reads the drafted candidates' ranking.
    """

    depth: int = 0
    top_k: int = 1
    most: int = 0
    timed: bool = False
    needs_ranking: bool = False

    def plan(self, batch: BatchRows = ONE_ROW, feed: int = 1, room: int | None = None) -> RoundPlan:
        """
        The next round's shape.

        Args:
            batch (`BatchRows`): the unfinished rows.
            feed (`int`): positions per row (mean) waiting for the draft.
            room (`int`, *optional*): the most levels the roomiest row can still use.
        """
        raise NotImplementedError

    def observe(self, outcome: RoundOutcome) -> None:
        """
        Learn from a finished round (only called when :attr:`timed`).

        Args:
            outcome (`RoundOutcome`): the round.
        """

    def finish(self, memory: DraftingMemory) -> None:
        """
        The end of the call: leave what the next call starts from.

        Args:
            memory (`DraftingMemory`): the draft's memory.
        """


class FixedBudget(Budget):
    """The shape the user gave (``num_assistant_tokens``, or a tree's ``tree_total_tokens``), every round, no
    deeper than the rows can use.

    Args:
        depth (`int`): levels (a chain: its length).
        top_k (`int`): children per expanded node.
        total (`int`): drafted nodes verified.
    """

    def __init__(self, depth: int, top_k: int = 1, total: int | None = None):
        total = depth if total is None else total
        self.depth, self.top_k, self.total = min(depth, total), min(top_k, total), total
        self.most = total

    def plan(self, batch: BatchRows = ONE_ROW, feed: int = 1, room: int | None = None) -> RoundPlan:
        """The given shape, its depth cut to ``room`` (see :meth:`Budget.plan`)."""
        depth = self.depth if room is None else min(self.depth, room)
        return RoundPlan(depth, self.top_k, self.total) if depth >= 1 else PLAIN


class LossAllowance:
    r"""
    What drafting may lose in one call: :data:`MAX_LOSS` of the call's time in plain steps (``horizon`` tokens at a
    plain round's seconds). Each round that drafted gains its tokens (per row, the mean) at a plain round's price
    and pays its seconds; a round drafts only while its loss, should it accept nothing (its predicted seconds less one
    plain step), keeps the call within the allowance. A prompt the draft reads badly thus costs the call at most
    about that fraction, whatever the estimates say; a prompt it reads well banks a gain that later rounds may spend.

    Args:
        horizon (`int`): the most tokens the call generates per row (``max_length`` less the prompt).
    """

    def __init__(self, horizon: int):
        self.horizon = max(int(horizon), 1)
        self.net = 0.0  # seconds the drafted rounds gained (negative: lost) against plain steps
        self.plain = None  # a plain round's seconds, smoothed (None: none timed in this call yet)
        self.predicted = None  # the seconds predicted for the round that was last allowed to draft
        self.pace = 1.0  # how much longer the call's drafted rounds took than predicted (the costs price bare
        # forwards: a tree's wider levels and the loop's own work are not in them), the latest round's at least

    def price(self, costs: Eagle3Costs) -> float:
        """A plain round's seconds: the call's own, else the costs' one-token forward."""
        return self.plain if self.plain is not None else costs.target_seconds(1)

    def permits(self, worst: float, costs: Eagle3Costs) -> bool:
        """
        Whether a round may draft.

        Args:
            worst (`float`): the round's predicted seconds (what it costs should it accept nothing, less the plain step
                it replaces, is the most it can lose), scaled by the call's pace.
            costs (`Eagle3Costs`): the call's costs.
        """
        plain = self.price(costs)
        if self.net - max(worst * self.pace - plain, 0.0) < -MAX_LOSS * plain * self.horizon:
            return False
        self.predicted = worst
        return True

    def spend(self, outcome: "RoundOutcome", costs: Eagle3Costs) -> None:
        """
        Account for a finished round.

        Args:
            outcome (`RoundOutcome`): the round.
            costs (`Eagle3Costs`): the call's costs.
        """
        if not outcome.plan.drafts:
            self.plain = smooth(self.plain, outcome.seconds, PLAIN_SMOOTHING)
            return
        tokens = 1.0 + sum(outcome.accepted) / max(len(outcome.accepted), 1)
        self.net += tokens * self.price(costs) - outcome.seconds
        if self.predicted:
            self.pace = max(outcome.seconds / self.predicted, 1.0)


class _LearntCosts(Budget):
    """A budget that prices rounds with the call's costs, learns those the table lacks from its rounds and stores
    them at the end.

    Args:
        costs (`Eagle3Costs`): the call's costs (from the table; learnt on).
        key (`str`): their :func:`~hf_eagle3.core.cost_model.cost_key`.
        context (`int`): the call's prompt length, the bucket its costs are stored under.
        horizon (`int`): the most tokens the call generates per row (its :class:`LossAllowance`).
    """

    timed = True

    def __init__(self, costs: Eagle3Costs, key: str, context: int, horizon: int):
        self.costs, self.key, self.context = costs, key, context
        self.known = self._known()  # what the table gave the call (learnt costs are added to it, never changed)
        self.allowance = LossAllowance(horizon)

    def fit(self, plan: RoundPlan, feed: int) -> RoundPlan:
        """
        ``plan``, or the largest round within it that the call's :class:`LossAllowance` lets draft after feeding
        ``feed`` positions (its seconds predicted from the costs: the feed, a draft forward per further level, the
        target's forward over its nodes): its nodes halved (its depth no more than its nodes) until it fits; a plain
        round when not even one node does. A call whose allowance runs low keeps drafting small rounds, which lose
        little when rejected and rebuild the allowance when accepted.

        Args:
            plan (`RoundPlan`): the round the estimates chose.
            feed (`int`): positions per row the draft consumes first.
        """
        costs, total = self.costs, plan.total
        while plan.drafts and total >= 1:
            depth = min(plan.depth, total)
            worst = (costs.feed_seconds(feed) + (depth - 1) * (costs.draft_step or 0.0)
                     + costs.target_seconds(total + 1))
            if self.allowance.permits(worst, costs):
                return plan if total == plan.total else RoundPlan(depth, plan.top_k, total)
            total //= 2
        return PLAIN

    def _known(self) -> tuple:
        """How many costs of each kind are known."""
        return len(self.costs.target), len(self.costs.draft_feed), self.costs.draft_step is not None

    def learn(self, outcome: RoundOutcome, chain: bool = True) -> None:
        """
        Teach the costs the round's forwards (see :meth:`~hf_eagle3.core.cost_model.Eagle3Costs.learn`).

        Args:
            outcome (`RoundOutcome`): the round.
            chain (`bool`): a chain budget's round: also the draft's one-token step (a tree's levels are wider), and
                the target's forward relative to the plain step timed just before (the lengths take turns).
        """
        self.allowance.spend(outcome, self.costs)
        drafts = outcome.plan.drafts
        self.costs.learn(outcome.nodes, outcome.verify_seconds, fed=outcome.feed if drafts else 0,
                         feed_seconds=outcome.feed_seconds,
                         steps=max(outcome.levels - 1, 0) if drafts and chain else 0,
                         step_seconds=outcome.draft_seconds - outcome.feed_seconds, relative=chain)

    def store(self) -> None:
        """Put the costs the call learnt back in the process's table and its file (nothing learnt: nothing written)."""
        if self._known() != self.known:
            table = cost_table()
            table.store(self.key, self.context, self.costs)
            table.save()


class ChainBudget(_LearntCosts):
    """``num_assistant_tokens_schedule="auto"``: each round the chain length, 0 included, with the most expected
    tokens per second (:class:`~hf_eagle3.core.draft_length_policy.Eagle3DraftLengthPolicy`). A call whose costs lack
    a length's target forward first lets the lengths take turns until each is timed (:meth:`learning_round`: a few
    rounds, on a machine with no table only). No round drafts past the call's :class:`LossAllowance` (:meth:`fit`).

    Args:
        policy (`Eagle3DraftLengthPolicy`): the decision, on ``costs``.
        costs, key, context, horizon: see :class:`_LearntCosts`.
        most (`int`): the longest chain.
    """

    def __init__(self, policy: Eagle3DraftLengthPolicy, costs: Eagle3Costs, key: str, context: int, horizon: int,
                 most: int):
        super().__init__(costs, key, context, horizon)
        self.policy, self.depth, self.most = policy, most, most

    def plan(self, batch: BatchRows = ONE_ROW, feed: int = 1, room: int | None = None) -> RoundPlan:
        """See :meth:`Budget.plan`."""
        most = self.most if room is None else min(self.most, room)
        if most < 1:
            return PLAIN
        k = self.learning_round(most)
        if k is None:  # a deferred feed (the prompt's, or after plain steps) is priced as a usual one: it is paid
            # once, whenever drafting resumes, and would otherwise keep drafting off the longer it waits
            k = self.policy.choose(most, feed=min(feed, USUAL_FEED), batch=batch)
        return self.fit(RoundPlan(k, 1, k), feed) if k > 0 else PLAIN

    def learning_round(self, most: int) -> int | None:
        """While the costs lack a chain length's target forward (no calibration, and no earlier call learnt it), the
        length whose forward this call has timed least (the shortest of equals): the plain step and the lengths not
        yet known take turns, so that each is timed next to a plain step. ``None`` once every length's cost is known.

        Args:
            most (`int`): the longest chain this round may draft.
        """
        unknown = [k for k in range(1, most + 1) if k + 1 not in self.costs.target]
        if not unknown and 1 in self.costs.target:
            return None
        counts = {k: self.costs.observations(k + 1, known=False) for k in [0] + unknown}
        return min(counts, key=lambda k: (counts[k], k))

    def observe(self, outcome: RoundOutcome) -> None:
        """See :meth:`Budget.observe`."""
        self.learn(outcome)
        self.policy.observe_rows(list(zip(outcome.drafted, outcome.accepted)))
        if outcome.feed <= USUAL_FEED or not outcome.plan.drafts:  # a long feed's round is not the usual pace
            self.policy.observe_time(outcome.plan.total, outcome.seconds, feed=outcome.feed)

    def finish(self, memory: DraftingMemory) -> None:
        """See :meth:`Budget.finish`."""
        memory.chain = self.policy.carried()
        self.store()


class TreeBudget(_LearntCosts):
    """``tree_total_tokens="auto"``: each round's tree sized by
    :class:`~hf_eagle3.core.tree_policy.TreeSizeChooser` from the previous round's candidates, or no tree while
    trees do not pay; like :class:`ChainBudget`, a plain step first when no plain step is known, and then, while the
    plain step is the only target forward known, trees of the first size at full depth until that size's cost is
    learnt (:meth:`learning`): one known size would price every size alike, and sizes that vary are never timed often
    enough to be learnt. No round drafts past the call's :class:`LossAllowance` (:meth:`fit`).

    Args:
        chooser (`TreeSizeChooser`): the decision, on ``costs.target``.
        costs, key, context, horizon: see :class:`_LearntCosts`.
        depth (`int`): ``tree_depth``.
        top_k (`int`): ``tree_top_k``.
    """

    needs_ranking = True

    def __init__(self, chooser: TreeSizeChooser, costs: Eagle3Costs, key: str, context: int, horizon: int,
                 depth: int, top_k: int):
        super().__init__(costs, key, context, horizon)
        self.chooser, self.depth, self.top_k = chooser, depth, top_k
        self.most = auto_most_nodes(depth, top_k)
        self.total = None  # the first tree's size, once a plain step is known (`TreeSizeChooser.first_nodes`)
        self.first = None  # that size: the trees' size while it is learnt
        self.next_depth = depth  # the levels of the next round's trees

    def plan(self, batch: BatchRows = ONE_ROW, feed: int = 1, room: int | None = None) -> RoundPlan:
        """See :meth:`Budget.plan`."""
        depth = self.depth if room is None else min(self.depth, room)
        if depth < 1 or not self.costs.ready:
            return PLAIN
        if self.total is None:
            self.total = self.first = self.chooser.first_nodes(self.most)
        if not self.chooser.draft_this_round(batch, depth, feed):
            return PLAIN
        if self.learning:
            plan = RoundPlan(depth, self.top_k, self.first)
        else:
            plan = RoundPlan(min(depth, self.next_depth), self.top_k, self.total)
        return self.fit(plan, feed)

    @property
    def learning(self) -> bool:
        """Whether the plain step is the only target forward whose cost is known (no table, first rounds)."""
        return len(self.costs.target) < 2

    def observe(self, outcome: RoundOutcome) -> None:
        """See :meth:`Budget.observe`."""
        self.learn(outcome, chain=False)
        if not outcome.plan.drafts:
            self.chooser.update_plain(outcome.seconds)
            return
        self.total, self.next_depth = self.chooser.observe_tree_round(
            outcome.ranking, outcome.nodes - 1, outcome.accepted, outcome.draft_seconds, max(1, outcome.levels),
            outcome.seconds, self.depth, feed_seconds=outcome.feed_seconds, fed=outcome.feed, batch=outcome.batch)

    def finish(self, memory: DraftingMemory) -> None:
        """See :meth:`Budget.finish`."""
        memory.trees[self.key] = self.chooser.carried()
        self.store()


def _call_costs(target, draft, input_ids, masked: bool, target_forward: str = "eager") -> tuple[Eagle3Costs, str]:
    """The call's costs from the process's table, and their key (see :func:`cost_key`)."""
    key = cost_key(target, draft, input_ids.shape[0], masked, target_forward)
    return cost_table().costs(key, input_ids.shape[1]), key


def chain_budget(target, draft, input_ids, most: int, masked: bool, horizon: int,
                 target_forward: str = "eager") -> ChainBudget:
    """
    The ``"auto"`` chain budget of a call: its costs from the table, the acceptance the draft's last call left.

    Args:
        target (`PreTrainedModel`): the target.
        draft (`Eagle3DraftModel`): the draft.
        input_ids (`torch.LongTensor` [B, L]): the call's prompts.
        most (`int`): the longest chain (``num_assistant_tokens``).
        masked (`bool`): the package's loop (its target forwards carry a 4D mask), not Transformers'.
        horizon (`int`): the most tokens the call generates per row (``max_length`` less the prompt).
        target_forward (`str`): how the target's forwards run (see :func:`~hf_eagle3.core.cost_model.cost_key`).
    """
    costs, key = _call_costs(target, draft, input_ids, masked, target_forward)
    policy = Eagle3DraftLengthPolicy.from_carried(costs, draft.drafting_memory.chain)
    return ChainBudget(policy, costs, key, input_ids.shape[1], horizon, most)


def budget_for(call, target, input_ids, horizon: int, target_forward: str = "eager") -> Budget:
    """
    The budget of a call of the package's loop (trees at any batch size, chains for batches), from its settings.

    Args:
        call: the active EAGLE-3 call (``draft``, ``tree``: the tree settings or ``None``, ``settings``: the
            call's draft-length settings).
        target (`PreTrainedModel`): the target.
        input_ids (`torch.LongTensor` [B, L]): the call's prompts.
        horizon (`int`): the most tokens the call generates per row (``max_length`` less the prompt).
        target_forward (`str`): how the target's forwards run (see :func:`~hf_eagle3.core.cost_model.cost_key`).

    Raises:
        ValueError: for chain settings batches do not implement (``"heuristic"`` schedules, a confidence threshold),
            before any work, naming what to use.
    """
    draft = call.draft
    if call.tree is not None:
        depth, top_k, total = call.tree["depth"], call.tree["top_k"], call.tree["total_tokens"]
        if total != "auto":
            return FixedBudget(depth, top_k, total)
        costs, key = _call_costs(target, draft, input_ids, True, target_forward)
        chooser = TreeSizeChooser.from_carried(costs.target, draft.drafting_memory.trees.get(key))
        return TreeBudget(chooser, costs, key, input_ids.shape[1], horizon, depth, top_k)
    settings = resolve_draft_settings(draft.generation_config, call.settings)
    schedule = settings.get("num_assistant_tokens_schedule", "constant")
    if schedule in ("heuristic", "heuristic_transient"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} (one sequence's draft length, adapted to its acceptance) is "
            "not implemented for batches: pass num_assistant_tokens_schedule='auto' (one length per round for the "
            "batch, from measured costs and acceptance) or 'constant', or generate one row at a time."
        )
    if float(settings.get("assistant_confidence_threshold") or 0.0) > 0:
        raise ValueError(
            f"assistant_confidence_threshold={settings['assistant_confidence_threshold']} is not implemented for "
            "batches: pass assistant_confidence_threshold=0 (or num_assistant_tokens_schedule='auto', which chooses "
            "the draft length from the acceptance seen), or generate one row at a time."
        )
    k = int(settings.get("num_assistant_tokens", DEFAULT_DRAFT_LENGTH))
    if schedule == "auto":
        return chain_budget(target, draft, input_ids, k, True, horizon, target_forward)
    return FixedBudget(k)
