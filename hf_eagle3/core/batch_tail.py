"""What a round is worth to a batch: a batched call ends with its slowest row, so the rounds it runs are those of
the row that needs the most rounds, not of the average row. :class:`BatchRows` describes the unfinished rows a round
drafts for and turns a row's expected tokens per round into the tokens per round by which the whole batch nears its
end, for the ``"auto"`` choices of batched calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache


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


@dataclass(frozen=True)
class BatchRows:
    r"""
    The unfinished rows a round drafts for: what each still needs and how well the draft has done on it so far.

    A row needing ``r`` tokens at ``m`` a round (spread ``s`` from round to round) finishes after about ``r / m``
    rounds, give or take ``sqrt(r) * s / m^1.5`` (renewal counting); the batch runs until its last row does. Rows
    differ: a prompt the draft reads well gains more a round than one it reads badly, and the row the draft reads
    worst sets the batch's rounds. :meth:`tokens` takes each row's gain from its share of the accepted drafted tokens
    (:meth:`shares`), ``m_b = 1 + share_b * (m - 1)``, and the batch's rounds as the slowest row's plus ``z`` of its
    spreads, ``z`` = :func:`expected_max_of_normals` of the rows in contention with it (each weighted by how close its
    expected rounds are, in their spreads): the rows' rounds vary at random too. For rows alike that is ``z(rows)``,
    and

    ``m / (1 + z * s / sqrt(r * m))``

    tokens a round: the row's own ``m`` for one row, less for wide batches and short remainders.

    Args:
        remaining (`tuple[int]`): per row, tokens it still needs (the ``max_length`` bound); ``(0,)``: one sequence,
            nothing to weigh.
        accepted (`tuple[int]`): per row, drafted tokens the target accepted so far in the call (empty: unknown,
            rows alike).
        squares (`tuple[int]`): per row, the sum over those rounds of the accepted count squared.
        drafts (`tuple[int]`): per row, rounds that verified a draft so far in the call.
    """

    remaining: tuple = (0,)
    accepted: tuple = ()
    squares: tuple = ()
    drafts: tuple = ()

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
    def shares(self) -> tuple[list, float]:
        """
        Each row's accepted drafted tokens per draft relative to the batch's, shrunk towards 1 (empirical Bayes: by
        how far the rows' means differ beyond what the spread of single rounds within a row explains), so a few
        unlucky rounds do not single a row out, while rows that keep differing do.

        Returns:
            ``(shares, within)``: one share per row (1.0 for a row without a draft yet), and the part of a
            round's variance over rows and rounds that lies within a row (1.0: all of it, rows alike).
        """
        seen = [(a, q, d) for a, q, d in zip(self.accepted, self.squares, self.drafts) if d > 0]
        shares = [1.0] * self.rows
        degrees = sum(d - 1 for _, _, d in seen)
        grand = sum(a for a, _, _ in seen) / max(sum(d for _, _, d in seen), 1)
        if len(seen) < 2 or degrees <= 0 or grand <= 0:
            return shares, 1.0
        within = max(sum(q - a * a / d for a, q, d in seen) / degrees, 1e-9)  # pooled variance within a row
        spread = sum((a / d - grand) ** 2 for a, _, d in seen) / len(seen)
        between = max(spread - sum(within / d for _, _, d in seen) / len(seen), 0.0)
        if between > 0:
            for b, (a, d) in enumerate(zip(self.accepted, self.drafts)):
                if d > 0:
                    shares[b] = (grand + between / (between + within / d) * (a / d - grand)) / grand
        return shares, within / (within + between)

    def tokens(self, mean: float, std: float) -> float:
        """
        Tokens per round by which the batch nears its end when the average row gains ``mean`` tokens a round
        (spread ``std`` over rows and rounds); ``mean`` itself for one row, and for plain target steps (``std`` 0:
        every row gains one token a round).

        Args:
            mean (`float`): a row's expected tokens per round (the target's own token included).
            std (`float`): their standard deviation over rows and rounds; the part within a row (:meth:`shares`)
                sets each row's spread, that of a row accepting less smaller (Poisson-like, ``sqrt(share_b)``).
        """
        longest = max(self.remaining, default=0)
        if self.rows <= 1 or longest <= 0 or mean <= 0 or std <= 0:
            return mean
        shares, within = self.shares
        rounds = []  # per row: the expected rounds it needs, and their spread
        for need, share in zip(self.remaining, shares):
            gain = max(1.0 + share * (mean - 1.0), 1e-6)
            need = max(need, 1)
            spread = std * math.sqrt(within * share)
            rounds.append((need / gain, math.sqrt(need) * spread / gain ** 1.5))
        slowest, spread = max(rounds)
        # The rows in contention with the slowest (alike: all of them; one far behind the rest: itself alone).
        contenders = sum(math.exp(-0.5 * (slowest - r) ** 2 / (spread ** 2 + s ** 2)) if spread + s > 0 else
                         float(r == slowest) for r, s in rounds)
        low = int(contenders)
        z = expected_max_of_normals(low) + (contenders - low) * (
            expected_max_of_normals(low + 1) - expected_max_of_normals(low))
        return longest / (slowest + z * spread)


ONE_ROW = BatchRows()  # one sequence: a round is worth its own tokens
