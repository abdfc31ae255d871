"""How big a tree to draft each round for ``tree_total_tokens="auto"``: :class:`TreeSizeChooser` weighs the expected
accepted tokens of the draft's best candidates against the measured cost of verifying them.
"""

from __future__ import annotations

from .batch_tail import ONE_ROW, BatchRows
from .cost_model import interpolate
from .draft_length_policy import USUAL_FEED, ProbeSchedule, smooth

# Every constant below is a design value (a prior, a statistical convention, a memory length), none chosen by a
# measurement within a machine's spread.
AUTO_MAX_NODES = 63  # largest tree "auto" chooses (64 target inputs with the root)
AUTO_PRIOR_WEIGHT = 2.0  # pseudo-tokens of the prior calibration 1.0 (see `TreeSizeChooser`)
MIN_ROUNDS_BEFORE_SKIPPING = 2  # rounds with a tree measured before "auto" may decide to draft none
SETTLED_ROUNDS = 8  # before this many rounds with a tree, "auto" skips only where trees are clearly below (DOUBT)
DOUBT = 2.0  # standard errors of a row's mean tokens a round granted to trees before SETTLED_ROUNDS (about 95 %)
SPREAD_FLOOR = 1.0  # the least spread of a row's tokens a round assumed for that standard error (one token)
# Draft no tree while trees make less than this fraction of a plain step's tokens per second: a margin for the noise of
# measured round rates (1.0 ran alike: docs/bench_results/2026-12-06_probe_budget_skip_below_1_8rows_float32.json).
SKIP_BELOW = 0.9
SMOOTHING = 0.1  # exponential smoothing of the recent rounds' tokens and seconds (a memory of about 10 rounds)
AUTO_FIRST = 16  # most nodes of the first round's tree (each later round is sized from the previous round's candidates)
FIRST_COST = 2.0  # the first round's tree costs the target at most this many plain steps
CARRIED_ROUNDS = 8  # at most this many rounds of a call's evidence carry over to the next call at its batch size
CARRIED = ("accepted", "predicted", "draft_seconds", "draft_forwards", "round_seconds", "rounds", "observed")  # scaled
KEPT = ("recent_tokens", "recent_seconds", "recent_square", "plain_seconds", "usual_feed", "deferred_feed",
        "since_tree")  # as they are


def auto_most_nodes(depth: int, top_k: int) -> int:
    """The most drafted nodes a ``tree_total_tokens="auto"`` round can verify: the candidates ``depth`` levels of
    ``top_k`` children per frontier node make, at most :data:`AUTO_MAX_NODES`.

    Args:
        depth (`int`): levels of the tree.
        top_k (`int`): children per expanded node.
    """
    return min(AUTO_MAX_NODES, top_k + (depth - 1) * top_k * top_k)


class TreeSizeChooser:
    r"""
    Chooses ``total_tokens`` each round for ``tree_total_tokens="auto"``: the size that maximises expected tokens per
    second, ``(1 + c * sum of the path probabilities of the N best candidates) / (draft time + target time(N + 1))``.

    The draft's own path probability of a node (``exp`` of its cumulative log-probability) estimates the chance that
    the target accepts it (the calibration EAGLE-2 builds on), so the sum over the tree estimates the accepted
    length. ``c`` corrects that estimate with the acceptance seen so far: ``(accepted + w) / (predicted + w)``, prior
    1.0 with weight ``w`` = :data:`AUTO_PRIOR_WEIGHT` tokens. The target's forward time for 1 to 64 tokens is measured
    once per target (and device / dtype) on the machine at hand, and interpolated linearly. In a batch the tokens
    that count are those by which the batch nears its end (:meth:`~hf_eagle3.core.batch_tail.BatchRows.tokens`: its
    slowest row sets its rounds), from the rows' acceptance and the spread of their tokens per round seen so far.

    Args:
        costs (`dict[int, float]`): seconds of a target forward of n tokens, for a few n.
    """

    def __init__(self, costs: dict):
        self.costs = costs  # the call's target costs, which its rounds keep teaching (not a copy)
        self.accepted = 0.0
        self.predicted = 0.0
        self.draft_seconds = 0.0
        self.draft_forwards = 0
        self.round_seconds = 0.0
        self.rounds = 0
        self.observed = 0  # rows' rounds with a tree (a round of a batch of B rows observes B)
        self.recent_tokens = None  # smoothed tokens and seconds of the recent rounds with a tree
        self.recent_seconds = None
        self.recent_square = None  # smoothed mean over the rows of a row's tokens squared, rounds with a tree
        self.plain_seconds = None  # smoothed seconds of the recent rounds without one
        self.usual_feed = None  # smoothed seconds of feeding the draft the positions of one round
        self.deferred_feed = None  # smoothed seconds per position of a feed deferred by rounds without a tree
        self.since_tree = 0  # rounds without a tree since the last round with one
        self.probes = ProbeSchedule()

    def carried(self) -> dict:
        """What the next call of the same draft at the same batch size starts from (:meth:`from_carried`): this
        call's totals scaled down to at most :data:`CARRIED_ROUNDS` rounds of evidence, its recent measures and its
        probe interval. So a call need not spend its first rounds learning what the last one found (whether trees
        pay at this batch size, how far the draft's probabilities are to be trusted), and still follows its own
        text."""
        scale = min(1.0, CARRIED_ROUNDS / self.rounds) if self.rounds else 0.0
        state = {name: getattr(self, name) * scale for name in CARRIED}
        state.update({name: getattr(self, name) for name in KEPT})
        state["probe_every"], state["probe_waited"] = self.probes.every, self.probes.waited
        return state

    @classmethod
    def from_carried(cls, costs: dict, carried: dict | None) -> "TreeSizeChooser":
        """
        A chooser for a new call, starting from what :meth:`carried` returned at the end of the last one at this
        batch size (or fresh).

        Args:
            costs (`dict[int, float]`): as the constructor takes them.
            carried (`dict`, *optional*): the previous call's state.
        """
        chooser = cls(costs)
        if carried:
            for name in CARRIED + KEPT:
                setattr(chooser, name, carried[name])
            chooser.probes = ProbeSchedule(carried["probe_every"], carried["probe_waited"])
        return chooser

    def target_seconds(self, n: int) -> float:
        """
        Interpolated (linearly extrapolated beyond the largest measured size) forward time for ``n`` tokens.

        Args:
            n (`int`): tokens of the target forward (the root included).
        """
        return interpolate(self.costs, n)

    @property
    def tokens_std(self) -> float:
        """The spread of a row's tokens from round to round (rounds with a tree, recent ones weighing most)."""
        if self.recent_square is None:
            return 0.0
        return max(self.recent_square - self.recent_tokens ** 2, 0.0) ** 0.5

    def first_nodes(self, most: int) -> int:
        """
        The first round's tree, sized before any candidates are seen: :data:`AUTO_FIRST` nodes, fewer where the
        target's forward of them would cost more than :data:`FIRST_COST` plain steps (wide batches on a
        compute-bound device), at least one.

        Args:
            most (`int`): the most nodes the tree's shape allows.
        """
        budget = FIRST_COST * self.target_seconds(1)
        fits = [n for n in range(1, min(AUTO_FIRST, most) + 1) if self.target_seconds(n + 1) <= budget]
        return max(fits, default=1)

    def draft_this_round(self, batch: BatchRows = ONE_ROW, depth: int | None = None, feed: int = 0) -> bool:
        """
        Whether to draft a tree this round: while the recent rounds with a tree made clearly fewer tokens per second
        than a plain target step would (below :data:`SKIP_BELOW` of it; the step measured, or the one-token forward
        time before any), draft nothing but the probes of a :class:`~hf_eagle3.core.draft_length_policy.ProbeSchedule`,
        and a probe only once it could change the decision: once a tree whose every row accepts all ``depth`` levels,
        weighed as the next round with a tree will be (:meth:`next_weight`: more, the longer trees have been skipped),
        would bring the recent rounds up to :data:`SKIP_BELOW`, and once the rounds without a tree have paid for its
        expected loss (a recent round with a tree and the feed the rounds without one deferred, against the plain
        steps that bring the batch as far, see :data:`~hf_eagle3.core.draft_length_policy.PROBE_BUDGET`). In a batch
        the tokens are those by which the batch nears its end (:meth:`~hf_eagle3.core.batch_tail.BatchRows.tokens`).

        Trees are judged from :data:`MIN_ROUNDS_BEFORE_SKIPPING` rounds on; before :data:`SETTLED_ROUNDS`, with the
        benefit of the doubt: a row's mean tokens a round taken :data:`DOUBT` standard errors higher (the rows' rounds
        observed so far, their spread at least :data:`SPREAD_FLOOR`). A wide batch observes many rows a round, so it
        stops drafting trees that clearly do not pay after a few rounds, where one sequence needs about eight.

        Args:
            batch (`BatchRows`): the unfinished rows (default: one sequence).
            depth (`int`, *optional*): the most levels this round's tree may have (default: a probe is never
                futile).
            feed (`int`): positions per row the draft would consume first (those of the rounds without a tree).
        """
        if self.rounds < MIN_ROUNDS_BEFORE_SKIPPING:
            return True  # too little measured yet
        plain = self.plain_seconds if self.plain_seconds is not None else self.target_seconds(1)
        std, mean = self.tokens_std, self.recent_tokens
        if self.rounds < SETTLED_ROUNDS:
            mean += DOUBT * max(std, SPREAD_FLOOR) / max(self.observed, 1) ** 0.5

        def pays(tokens: float) -> bool:
            return batch.tokens(tokens, std) / self.recent_seconds * plain >= SKIP_BELOW

        if pays(mean):
            self.probes.drafting()
            return True
        useful = depth is None or pays(mean + self.next_weight() * (depth + 1.0 - mean))
        deferred = 0.0  # a probe's feed beyond a usual one (the recent rounds count a usual one)
        if feed > USUAL_FEED and self.deferred_feed is not None:
            deferred = max(self.deferred_feed * feed - (self.usual_feed or 0.0), 0.0)
        return self.probes.probe_now(useful, self.recent_seconds + deferred, batch.tokens(mean, std), plain)

    def next_weight(self) -> float:
        """The weight of the next round with a tree in the recent measures: :data:`SMOOTHING` after a round with a
        tree, more after rounds without one (the measures before them aged by one round each, as a round with a tree
        would have aged them), a running mean over the first rounds."""
        aged = 1.0 - (1.0 - SMOOTHING) ** (1 + self.since_tree)
        return max(aged, 1.0 / (self.rounds + 1))

    def update_plain(self, seconds: float) -> None:
        """
        Record a round without a tree.

        Args:
            seconds (`float`): its wall time.
        """
        self.plain_seconds = smooth(self.plain_seconds, seconds, SMOOTHING)
        self.since_tree += 1
        self.probes.wait(seconds)

    @property
    def calibration(self) -> float:
        """Observed over predicted acceptance, shrunk towards 1.0."""
        return (self.accepted + AUTO_PRIOR_WEIGHT) / (self.predicted + AUTO_PRIOR_WEIGHT)

    def choose(self, path_probs: list[float], batch: BatchRows = ONE_ROW) -> int:
        """
        Return the number of drafted nodes N >= 1 with the most expected tokens per second.

        Args:
            path_probs (`list[float]`): the candidates' path probabilities, sorted in decreasing order.
            batch (`BatchRows`): the unfinished rows (default: one sequence).
        """
        best, best_rate, expected, c, std = 1, -1.0, 1.0, self.calibration, self.tokens_std
        draft = self.draft_seconds / self.rounds if self.rounds else 0.0
        for n, p in enumerate(path_probs[:AUTO_MAX_NODES], start=1):
            expected += c * p
            rate = batch.tokens(expected, std) / (draft + self.target_seconds(n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def levels(self, frontier_mass: list, most: int) -> int:
        """
        The levels to draft next round: the first, then each further one while the previous round's frontier there
        could pay for a draft forward: its children can add at most ``c * mass`` expected tokens (a child's path
        probability never exceeds its parent's), worth drafting while that beats the tokens per second of the rounds
        so far times the time of one level. Decided on the host from what the previous round's read-back brought
        (so a tree grows at most one level a round beyond what was drafted).

        Args:
            frontier_mass (`list[float]`): per level drafted last round, the path probability mass of its ``top_k`` best
                candidates (``tree_candidates.candidate_ranking``; zeros past the levels drafted).
            most (`int`): ``tree_depth``.
        """
        if not self.rounds or not self.draft_forwards or self.round_seconds <= 0:
            return most  # nothing measured yet
        level_seconds = self.draft_seconds / self.draft_forwards
        rate = (self.rounds + self.accepted) / self.round_seconds  # tokens per second so far
        levels = 1
        for mass in frontier_mass[: most - 1]:
            if self.calibration * mass <= level_seconds * rate:
                break
            levels += 1
        return levels

    def observe_tree_round(self, ranking: list, total: int, accepted: list, draft_seconds: float,
                           draft_forwards: int, round_seconds: float, most: int, feed_seconds: float = 0.0,
                           fed: int = 1, batch: BatchRows = ONE_ROW) -> tuple[int, int]:
        """
        Record a round that verified a tree and size the next one from its candidates (after the round's read-back).

        Args:
            ranking (`list`): the read-back ``tree_candidates.candidate_ranking``: sorted path probabilities, then
                frontier masses per level.
            total (`int`): drafted nodes of the round's tree (per row).
            accepted (`list[int]`): drafted tokens accepted, per row of the round.
            draft_seconds, draft_forwards, round_seconds, feed_seconds, fed: as :meth:`update` takes them.
            most (`int`): ``tree_depth``.
            batch (`BatchRows`): the rows the next round drafts for, as :meth:`choose` takes them.

        Returns:
            ``(nodes, levels)`` of the next round's tree.
        """
        probs, frontier = ranking
        mean = sum(accepted) / len(accepted)
        square = sum((a + 1.0) ** 2 for a in accepted) / len(accepted)
        self.update(sum(probs[:total]), mean, draft_seconds, draft_forwards=draft_forwards,
                    round_seconds=round_seconds, feed_seconds=feed_seconds, fed=fed, tokens_square=square,
                    rows=len(accepted))
        return self.choose(probs, batch), self.levels(frontier, most)

    def update(self, predicted: float, accepted: int, draft_seconds: float, draft_forwards: int = 1,
               round_seconds: float | None = None, feed_seconds: float = 0.0, fed: int = 1,
               tokens_square: float | None = None, rows: int = 1) -> None:
        """
        Record one round.

        Args:
            predicted (`float`): the chosen tree's predicted accepted length (sum of its path probabilities).
            accepted (`int`): drafted tokens the target accepted.
            draft_seconds (`float`): time spent drafting the round.
            draft_forwards (`int`): draft forwards in that time (the feed plus one per expanded level).
            round_seconds (`float`, *optional*): the whole round (drafting and verification); default
                ``draft_seconds``.
            feed_seconds (`float`): the part of it spent feeding the draft.
            fed (`int`): positions fed. A feed after rounds without a tree covers many positions at once: for the
                decision to draft (:meth:`draft_this_round`) and for the draft time of the sizes (:meth:`choose`) the
                round is counted with a usual feed instead.
            tokens_square (`float`, *optional*): the rows' mean of ``(accepted + 1) ** 2`` (their spread; default:
                one row's, ``(accepted + 1) ** 2``).
            rows (`int`): rows of the round, whose mean ``accepted`` and ``tokens_square`` are.
        """
        seconds = draft_seconds if round_seconds is None else round_seconds
        if fed <= USUAL_FEED:
            self.usual_feed = smooth(self.usual_feed, feed_seconds, SMOOTHING)
        else:  # the prompt's feed, or one deferred by rounds without a tree: counted as a usual one (before any, as
            # one more draft forward); its time per position prices the next probe's feed
            self.deferred_feed = smooth(self.deferred_feed, feed_seconds / fed, SMOOTHING)
            usual = self.usual_feed
            if usual is None:
                usual = (draft_seconds - feed_seconds) / max(draft_forwards, 1)
            seconds += usual - feed_seconds
            draft_seconds += usual - feed_seconds
        self.predicted += predicted
        self.accepted += accepted
        self.draft_seconds += draft_seconds
        self.draft_forwards += draft_forwards
        weight = self.next_weight()
        self.round_seconds += seconds
        self.rounds += 1
        self.observed += rows
        self.since_tree = 0
        self.recent_tokens = smooth(self.recent_tokens, accepted + 1.0, weight)
        self.recent_seconds = smooth(self.recent_seconds, seconds, weight)
        square = (accepted + 1.0) ** 2 if tokens_square is None else tokens_square
        self.recent_square = smooth(self.recent_square, square, weight)
