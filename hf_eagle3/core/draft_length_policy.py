"""How much to draft each round, drafting nothing included (``num_assistant_tokens_schedule="auto"``).

A round that drafts ``k`` tokens yields ``1 + sum_i prod_{j <= i} a_j`` tokens on average, ``a_j`` being the chance
that draft token ``j`` is accepted given that the ones before it were (:class:`Eagle3AcceptanceEstimate`, learnt from
the rounds so far). :class:`Eagle3DraftLengthPolicy` picks the ``k`` with the most expected tokens per second under
the measured round costs (:class:`~hf_eagle3.core.cost_model.Eagle3Costs`); when no ``k`` pays it drafts nothing, with
probe rounds (:class:`ProbeSchedule`) to notice when drafting pays again. In a batch the tokens that count are those
by which the whole batch nears its end (:class:`~hf_eagle3.core.batch_tail.BatchRows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .batch_tail import ONE_ROW, BatchRows
from .cost_model import Eagle3Costs

# Every constant below is a design value (a neutral prior, a memory length, a budget), none chosen by a measurement
# within a machine's spread; the probe budget's effect is measured in docs/bench_results/2026-12-06_probe_budget_*.json.
PRIOR_ACCEPTANCE = 0.5  # conditional acceptance assumed at a draft position nothing is known about (neutral)
PRIOR_WEIGHT = 2.0  # weight of the prior, in rounds: two rounds of evidence outweigh it
CARRIED_WEIGHT = 10.0  # at most this many rounds of a call's evidence carry over to the next call of the draft
DECAY = 0.95  # per drafted round: the estimate's memory is about 20 rounds, so it follows the text
PROBE_EVERY = 8  # rounds without a draft before the first probe; doubles after each probe that does not pay
MAX_PROBE_EVERY = 64
PROBE_BUDGET = 0.02  # a probe's expected loss may be at most this fraction of the time waited since the last one
PACE_SMOOTHING = 0.2  # exponential smoothing of the measured pace of the rounds (a memory of about 5 rounds)
PACE_SPIKE = 2.0  # a round counts at most this multiple of the pace so far (a stall is not a pace)
USUAL_FEED = 8  # positions a feed covers after a round with a draft (more: the prompt's, or one deferred)

def smooth(previous: float | None, value: float, weight: float) -> float:
    """
    Exponential smoothing: ``value`` itself when there is nothing yet, else ``previous`` moved by ``weight`` of the
    way towards it.

    Args:
        previous (`float`, *optional*): the smoothed value so far (``None``: none).
        value (`float`): the new observation.
        weight (`float`): in (0, 1].
    """
    return value if previous is None else previous + weight * (value - previous)


@dataclass
class Eagle3AcceptanceEstimate:
    """
    Conditional acceptance per draft position, from decayed counts and a prior.

    ``rate(i) = (accepted_i + w * prior_i) / (reached_i + w)``: ``reached_i`` counts rounds that drafted position
    ``i`` with every earlier draft token accepted, ``accepted_i`` those that also accepted it (each count decays by
    ``decay`` per drafted round). The prior of position 1 is ``prior``; that of a later position is the estimate of the
    one before it, so what was learnt at short drafts carries over to longer ones.

    Args:
        prior (`float`): conditional acceptance assumed before any observation.
        prior_weight (`float`): weight of the prior, in drafts.
        decay (`float`): per drafted round.
        width (`int`): the most rows that drafted in one round observed since this estimate began (:meth:`carried`
            keeps rounds of that many).
    """

    prior: float = PRIOR_ACCEPTANCE
    prior_weight: float = PRIOR_WEIGHT
    decay: float = DECAY
    reached: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    width: int = 1

    def rates(self, k: int) -> list[float]:
        """
        The conditional acceptance of draft positions 1..k.

        Args:
            k (`int`): positions.
        """
        out, prior = [], self.prior
        for i in range(k):
            reached = self.reached[i] if i < len(self.reached) else 0.0
            accepted = self.accepted[i] if i < len(self.accepted) else 0.0
            prior = (accepted + self.prior_weight * prior) / (reached + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, k: int) -> float:
        """
        Expected tokens of a round that drafts ``k`` (the target's own token included).

        Args:
            k (`int`): tokens drafted.
        """
        total, chain = 1.0, 1.0
        for rate in self.rates(k):
            chain *= rate
            total += chain
        return total

    def tokens_std(self, k: int) -> float:
        """
        Standard deviation of a round's tokens when it drafts ``k`` (``T = 1 + accepted``; ``P(T >= t)`` is the
        product of the first ``t - 1`` rates, so ``E[T^2] = sum_t (2t - 1) P(T >= t)``).

        Args:
            k (`int`): tokens drafted.
        """
        mean, square, chain = 1.0, 1.0, 1.0
        for t, rate in enumerate(self.rates(k), start=2):
            chain *= rate
            mean += chain
            square += (2 * t - 1) * chain
        return math.sqrt(max(square - mean * mean, 0.0))

    def observe(self, drafted: int, accepted: int) -> None:
        """
        Record a round of one sequence (:meth:`observe_rows` with one row).

        Args:
            drafted (`int`): tokens drafted (0: nothing is recorded).
            accepted (`int`): how many of them, from the first, were accepted.
        """
        self.observe_rows([(drafted, accepted)])

    def observe_rows(self, rows) -> None:
        """
        Record a round of a batch: every row's draft is one observation, and the older ones decay once for the
        round (as for one sequence), not once per row, so that a batch's estimate weighs its rows' rounds alike
        and one round of a few rows does not outweigh the rounds before it.

        Args:
            rows (`Sequence[tuple[int, int]]`): per row, the tokens drafted (0: the row records nothing) and how many
                of them, from the first, were accepted.
        """
        rows = [(drafted, accepted) for drafted, accepted in rows if drafted > 0]
        if not rows:
            return
        grow = max(drafted for drafted, _ in rows) - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for drafted, accepted in rows:
            for i in range(min(drafted, accepted + 1)):
                self.reached[i] += 1.0
                if i < accepted:
                    self.accepted[i] += 1.0
        self.width = max(self.width, len(rows))

    def carried(self, weight: float = CARRIED_WEIGHT) -> "Eagle3AcceptanceEstimate":
        """
        A copy for the next call: the counts scaled down to at most ``weight`` rounds per position (rounds of
        ``width`` rows), so that the next call starts from what this one learnt (one lucky round does not flip its
        first decisions) but still follows its own text.

        Args:
            weight (`float`): the most rounds of evidence carried per position.
        """
        most = weight * self.width
        scale = [min(1.0, most / r) if r > 0 else 0.0 for r in self.reached]
        return Eagle3AcceptanceEstimate(
            prior=self.prior, prior_weight=self.prior_weight, decay=self.decay,
            reached=[r * s for r, s in zip(self.reached, scale)], accepted=[a * s for a, s in zip(self.accepted, scale)],
        )


def _fastest(rounds: dict, lowest: int = 0) -> int:
    """The draft length in ``rounds`` (``{k: (tokens, seconds)}``, see :meth:`Eagle3DraftLengthPolicy.rounds`) from
    ``lowest`` on with the most tokens per second (the shortest of equals)."""
    return max((k for k in rounds if k >= lowest), key=lambda k: rounds[k][0] / rounds[k][1])


class ProbeSchedule:
    """
    When a policy that has decided not to draft drafts anyway, to learn whether drafting pays again: after
    ``every`` rounds without a draft; ``every`` doubles (up to :data:`MAX_PROBE_EVERY`) each time the probe does not
    change the decision, and falls back to :data:`PROBE_EVERY` when it does. A probe is also paid for in time: it waits
    until its expected loss (its time less that of the plain rounds that would bring as many tokens) is at most
    :data:`PROBE_BUDGET` of the time the rounds without a draft took since the last one, so that probes cost at most
    that fraction of a call where drafting clearly does not pay, and come on schedule where it nearly does.

    Args:
        every (`int`): rounds without a draft before the next probe.
        waited (`float`): seconds of rounds without a draft since the last probe (e.g. carried from the previous call).
    """

    def __init__(self, every: int = PROBE_EVERY, waited: float = 0.0):
        self.every = int(every)
        self.waited = float(waited)
        self._skipped = 0
        self._probing = False

    def drafting(self) -> None:
        """The policy drafts this round on its own."""
        if self._probing:
            self.every = PROBE_EVERY  # the probe paid: drafting is back
        self._probing, self._skipped, self.waited = False, 0, 0.0

    def wait(self, seconds: float) -> None:
        """
        Record the time of a round without a draft.

        Args:
            seconds (`float`): its wall time.
        """
        self.waited += seconds

    def probe_now(self, useful: bool = True, seconds: float = 0.0, tokens: float = 0.0, plain: float = 0.0) -> bool:
        """
        The policy would not draft this round: whether to draft anyway (a probe). The probe's expected loss is
        ``seconds - tokens * plain``; it waits until the time waited pays for that (:data:`PROBE_BUDGET`).

        Args:
            useful (`bool`): whether a probe could change the policy's decision now; while it could not, the round
                only counts, and the probe waits until it could.
            seconds (`float`): the probe round's expected time.
            tokens (`float`): the tokens it is expected to bring (for a batch, as far as it brings the batch).
            plain (`float`): seconds of a round without a draft per token it brings.
        """
        if self._probing:  # the last probe did not change the decision: probe less often
            self.every = min(2 * self.every, MAX_PROBE_EVERY)
            self._probing = False
        self._skipped += 1
        if self._skipped < self.every or not useful or seconds - tokens * plain > PROBE_BUDGET * self.waited:
            return False
        self._skipped, self._probing, self.waited = 0, True, 0.0
        return True


class Eagle3DraftLengthPolicy:
    r"""
    Chooses the draft length of each round (``num_assistant_tokens_schedule="auto"``): the ``k`` in ``0..max_k``
    with the most expected tokens per second, from the measured round costs (:class:`Eagle3Costs`), the acceptance
    seen so far (:class:`Eagle3AcceptanceEstimate`) and the pace of the call's rounds against their costs (a machine
    slower or faster as a whole, the loop's bookkeeping) measured in the call.

    ``k = 0`` (draft nothing: the round is a plain target step) wins when no draft length pays. Since nothing is
    learnt while not drafting, the policy then drafts probe rounds (:class:`ProbeSchedule`).

    Args:
        costs (`Eagle3Costs`): measured forward costs.
        estimate (`Eagle3AcceptanceEstimate`, *optional*): acceptance so far (e.g. carried from the previous call).
        probe_every (`int`): rounds without a draft before the next probe (e.g. carried from the previous call).
        probe_waited (`float`): seconds of rounds without a draft since the last probe (e.g. carried from the previous
            call).
    """

    def __init__(self, costs: Eagle3Costs, estimate: Eagle3AcceptanceEstimate | None = None,
                 probe_every: int = PROBE_EVERY, probe_waited: float = 0.0):
        self.costs = costs
        self.estimate = estimate if estimate is not None else Eagle3AcceptanceEstimate()
        self.pace = {False: None, True: None}  # measured over modelled seconds, rounds without / with a draft
        self.probes = ProbeSchedule(probe_every, probe_waited)

    @property
    def probe_every(self) -> int:
        """Rounds without a draft before the next probe."""
        return self.probes.every

    def round_of(self, k: int, feed: int = 1, batch: BatchRows = ONE_ROW) -> tuple[float, float]:
        """
        Expected ``(tokens, seconds)`` of a round drafting ``k`` after feeding ``feed`` positions; for a batch, the
        tokens by which the batch nears its end (:meth:`~hf_eagle3.core.batch_tail.BatchRows.tokens`: its slowest row
        sets its rounds).

        Args:
            k (`int`): tokens drafted (0: a plain target step).
            feed (`int`): positions the draft consumes first.
            batch (`BatchRows`): the unfinished rows (default: one sequence).
        """
        pace = self.pace[k > 0]
        if pace is None:  # not measured yet for this kind of round: it runs at the pace of the other kind (the
            # machine as a whole is what makes the costs run slower or faster), or at its costs
            pace = self.pace[k <= 0] or 1.0
        seconds = max(self.costs.round_seconds(k, feed) * pace, 1e-9)
        return batch.tokens(self.estimate.expected_tokens(k), self.estimate.tokens_std(k)), seconds

    def rounds(self, max_k: int, feed: int = 1, batch: BatchRows = ONE_ROW) -> dict:
        """
        :meth:`round_of` for every draft length ``0..max_k``: ``{k: (tokens, seconds)}``.

        Args:
            max_k (`int`): longest draft allowed.
            feed (`int`): positions the draft consumes first.
            batch (`BatchRows`): the unfinished rows (default: one sequence).
        """
        return {k: self.round_of(k, feed, batch) for k in range(max_k + 1)}

    def best(self, max_k: int, feed: int = 1, lowest: int = 0, batch: BatchRows = ONE_ROW) -> int:
        """
        The ``k`` in ``lowest..max_k`` with the most expected tokens per second.

        Args:
            max_k (`int`): longest draft allowed.
            feed (`int`): positions the draft consumes first.
            lowest (`int`): shortest draft considered.
            batch (`BatchRows`): the unfinished rows (default: one sequence).
        """
        return _fastest(self.rounds(max_k, feed, batch), lowest)

    def choose(self, max_k: int, feed: int = 1, batch: BatchRows = ONE_ROW) -> int:
        """
        The draft length of the next round, probes included (each length priced once).

        Args:
            max_k (`int`): longest draft allowed this round.
            feed (`int`): verified positions the draft has not consumed yet.
            batch (`BatchRows`): the unfinished rows (default: one sequence).
        """
        if max_k <= 0:
            return 0
        rounds = self.rounds(max_k, feed, batch)
        k = _fastest(rounds)
        if k > 0:
            self.probes.drafting()
            return k
        k = _fastest(rounds, lowest=1)  # the probe's length
        (tokens, seconds), (plain_tokens, plain_seconds) = rounds[k], rounds[0]
        return k if self.probes.probe_now(seconds=seconds, tokens=tokens, plain=plain_seconds / plain_tokens) else 0

    def observe(self, drafted: int, accepted: int) -> None:
        """
        Record the acceptance of a finished round of one sequence.

        Args:
            drafted (`int`): tokens drafted.
            accepted (`int`): how many of them were accepted.
        """
        self.estimate.observe(drafted, accepted)

    def observe_rows(self, rows) -> None:
        """
        Record the acceptance of a finished round of a batch (one round of evidence with a draft per row, see
        :meth:`Eagle3AcceptanceEstimate.observe_rows`).

        Args:
            rows (`Sequence[tuple[int, int]]`): per row, the tokens drafted and how many of them were accepted.
        """
        self.estimate.observe_rows(rows)

    def observe_time(self, drafted: int, seconds: float, feed: int = 1) -> None:
        """
        Record the wall time of a finished round: its ratio to its costs is the pace of the call's rounds of its kind
        (with or without a draft), by which the next ones are priced. A pace common to both kinds (the machine slower
        than when the costs were measured) changes no decision; a drafting round's own bookkeeping does.

        Args:
            drafted (`int`): tokens drafted.
            seconds (`float`): the round's wall time (drafting, verification, bookkeeping).
            feed (`int`): positions the draft consumed at the start of the round.
        """
        modelled = self.costs.round_seconds(drafted, feed)
        if modelled > 0:
            pace, ratio = self.pace[drafted > 0], seconds / modelled
            self.pace[drafted > 0] = smooth(pace, ratio if pace is None else min(ratio, PACE_SPIKE * pace),
                                            PACE_SMOOTHING)
        if not drafted:
            self.probes.wait(seconds)

    def carried(self) -> dict:
        """What the next call of the same draft starts from: the acceptance estimate (as a prior), the probe
        interval and the time waited since the last probe (see :meth:`from_carried`)."""
        return {"estimate": self.estimate.carried(), "probe_every": self.probe_every,
                "probe_waited": self.probes.waited}

    @classmethod
    def from_carried(cls, costs: Eagle3Costs, carried: dict | None) -> "Eagle3DraftLengthPolicy":
        """
        A policy for a new call, starting from what :meth:`carried` returned at the end of the last one (or fresh).

        Args:
            costs (`Eagle3Costs`): measured forward costs.
            carried (`dict`, *optional*): the previous call's state.
        """
        return cls(costs, **(carried or {}))
