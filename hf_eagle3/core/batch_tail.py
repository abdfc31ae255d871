"""What a round is worth to a batch: a batched call ends with its slowest row, so the rounds it runs are those of
the row that needs the most rounds, not of the average row. :class:`BatchRows` describes the unfinished rows a round
drafts for and turns a row's expected tokens per round into the tokens per round by which the whole batch nears its
end, for the ``"auto"`` choices of batched calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple


@lru_cache(maxsize=None)
def expected_max_of_normals(n: int) -> float:
    """
    The expected largest of ``n`` independent standard normal draws (0 for one draw; 0.56 for two, 1.03 for four,
    1.42 for eight), by numerical integration of ``x n phi(x) Phi(x)^(n-1)``.

    Args:
        n (`int`): draws, at least 1.
    """
    if n <= 1:
        return 0.0
    step, total = 0.01, 0.0
    for i in range(-1000, 1001):
        x = i * step
        density = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        below = 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * n * density * below ** (n - 1) * step
    return total


PRIOR_ROWS = 8  # rows' worth of evidence the spread of the rows carried from earlier calls weighs


class RowEstimate(NamedTuple):
    """What the rows' acceptance so far says of each row (:attr:`BatchRows.estimate`).

    Attributes:
        shares (`list[float]`): each row's expected accepted drafted tokens per draft relative to the batch's.
        doubts (`list[float]`): the variance of each share (what the rows seen so far leave unknown of it).
        within (`float` or `None`): the part of a round's variance over rows and rounds that lies within a row
            (`None`: not measured in this call).
        spread (`float`): the variance of the rows' shares, the rows' true difference (carried to the next call).
    """

    shares: list
    doubts: list
    within: float | None
    spread: float


@dataclass(frozen=True)
class BatchRows:
    r"""
    The unfinished rows a round drafts for: what each still needs and how well the draft has done on it so far.

    A row needing ``r`` tokens at ``m`` a round (spread ``s`` from round to round) finishes after about ``r / m``
    rounds, give or take ``sqrt(r) * s / m^1.5`` (renewal counting); the batch runs until its last row does. Rows
    differ: a prompt the draft reads well gains more a round than one it reads badly, and the row the draft reads
    worst sets the batch's rounds. :meth:`tokens` takes each row's gain from its share of the accepted drafted tokens
    (:attr:`estimate`), ``m_b = 1 + share_b * (m - 1)``, its rounds give or take both the renewal spread and what is
    not yet known of its share (``r / m_b^2`` rounds per token of gain: a row not yet seen may be the one the draft
    reads worst), and the batch's rounds as the slowest row's plus ``z`` of its spreads, ``z`` =
    :func:`expected_max_of_normals` of the rows in contention with it (each weighted by how close its expected rounds
    are, in their spreads). For rows alike that is ``z(rows)``, and

    ``m / (1 + z * s / sqrt(r * m))``

    tokens a round: the row's own ``m`` for one row, less for wide batches and short remainders.

    Args:
        remaining (`tuple[int]`): per row, tokens it still needs (the ``max_length`` bound); ``(0,)``: one sequence,
            nothing to weigh.
        accepted (`tuple[int]`): per row, drafted tokens the target accepted so far in the call (empty: unknown,
            rows alike).
        squares (`tuple[int]`): per row, the sum over those rounds of the accepted count squared.
        drafts (`tuple[int]`): per row, rounds that verified a draft so far in the call.
        prior (`float`, *optional*): the variance of the rows' shares found by earlier calls
            (:attr:`RowEstimate.spread`), weighing :data:`PRIOR_ROWS` rows against this call's; `None`: none, this
            call's rows alone.
    """

    remaining: tuple = (0,)
    accepted: tuple = ()
    squares: tuple = ()
    drafts: tuple = ()
    prior: float | None = None

    @classmethod
    def alike(cls, rows: int, remaining: int) -> "BatchRows":
        """
        ``rows`` rows that each still need ``remaining`` tokens, with no acceptance seen yet (rows alike).

        Args:
            rows (`int`): unfinished rows.
            remaining (`int`): tokens each still needs.
        """
        return cls((remaining,) * rows)

    @property
    def rows(self) -> int:
        """Unfinished rows."""
        return len(self.remaining)

    @cached_property
    def estimate(self) -> RowEstimate:
        """
        Each row's accepted drafted tokens per draft relative to the batch's, shrunk towards 1 (empirical Bayes, one
        way: the rows' true spread is how far their means differ beyond what the spread of single rounds within a row
        explains, pooled with :attr:`prior`), so a few unlucky rounds do not single a row out, while rows that keep
        differing do; and how uncertain each share still is (a row with few drafts: nearly the rows' whole spread).
        """
        prior = self.prior or 0.0
        seen = [(a, q, d) for a, q, d in zip(self.accepted, self.squares, self.drafts) if d > 0]
        degrees = sum(d - 1 for _, _, d in seen)
        grand = sum(a for a, _, _ in seen) / max(sum(d for _, _, d in seen), 1)
        if len(seen) < 2 or degrees <= 0 or grand <= 0:
            return RowEstimate([1.0] * self.rows, [prior] * self.rows, None, prior)
        within = max(sum(q - a * a / d for a, q, d in seen) / degrees, 1e-9)  # pooled variance within a row
        scatter = sum((a / d - grand) ** 2 for a, _, d in seen) / len(seen)  # of the rows' means
        between = max(scatter - sum(within / d for _, _, d in seen) / len(seen), 0.0) / grand ** 2  # of the shares
        if self.prior is not None:
            between = (len(seen) * between + PRIOR_ROWS * prior) / (len(seen) + PRIOR_ROWS)
        shares, doubts = [1.0] * self.rows, [between] * self.rows
        for b, (a, d) in enumerate(zip(self.accepted, self.drafts)):
            if d > 0 and between > 0:
                noise = within / d / grand ** 2  # the variance of the row's share from its rounds alone
                weight = between / (between + noise)
                shares[b], doubts[b] = 1.0 + weight * (a / d / grand - 1.0), weight * noise
        return RowEstimate(shares, doubts, within / (within + between * grand ** 2), between)

    def tokens(self, mean: float, std: float) -> float:
        """
        Tokens per round by which the batch nears its end when the average row gains ``mean`` tokens a round
        (spread ``std`` over rows and rounds); ``mean`` itself for one row, and for plain target steps (``std`` 0:
        every row gains one token a round).

        Args:
            mean (`float`): a row's expected tokens per round (the target's own token included).
            std (`float`): their standard deviation over rows and rounds; the part within a row (:attr:`estimate`)
                sets each row's spread, that of a row accepting less smaller (Poisson-like, ``sqrt(share_b)``).
        """
        longest = max(self.remaining, default=0)
        if self.rows <= 1 or longest <= 0 or mean <= 0 or std <= 0:
            return mean
        shares, doubts, within, between = self.estimate
        drafted = mean - 1.0
        if within is None:  # no rows compared in this call: what the carried spread leaves of std within a row
            within = max(1.0 - between * drafted ** 2 / std ** 2, 0.0)
        rounds = []  # per row: the expected rounds it needs, and their spread
        for need, share, doubt in zip(self.remaining, shares, doubts):
            gain = max(1.0 + share * drafted, 1e-6)
            need = max(need, 1)
            renewal = need * std ** 2 * within * share / gain ** 3
            unknown = doubt * (drafted / gain) ** 2  # the variance of the gain, relative to it
            # rounds grow as 1 / gain: an unknown gain costs more rounds on average than a known one (to second order)
            rounds.append((need / gain * (1.0 + unknown), math.sqrt(renewal + (need / gain) ** 2 * unknown)))
        slowest, spread = max(rounds)
        # The rows in contention with the slowest (alike: all of them; one far behind the rest: itself alone).
        contenders = sum(math.exp(-0.5 * (slowest - r) ** 2 / (spread ** 2 + s ** 2)) if spread + s > 0 else
                         float(r == slowest) for r, s in rounds)
        low = int(contenders)
        z = expected_max_of_normals(low) + (contenders - low) * (
            expected_max_of_normals(low + 1) - expected_max_of_normals(low))
        return longest / (slowest + z * spread)


ONE_ROW = BatchRows()  # one sequence: a round is worth its own tokens
