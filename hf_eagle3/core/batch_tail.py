"""What a round is worth to a batch: a batched call ends with its slowest row, so the rounds it runs are those of
the row that needs the most, not of the average row. :func:`batch_tokens` turns a row's expected tokens per round
into the tokens per round by which the whole batch nears its end, for the ``"auto"`` choices of batched calls.
"""

from __future__ import annotations

import math
from functools import lru_cache


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


def batch_tokens(mean: float, std: float, remaining: int, rows: int) -> float:
    r"""
    Tokens per round by which a batch nears its end when each of its rows gains ``mean`` tokens a round (spread
    ``std`` from round to round) and the row furthest from its end still needs ``remaining``.

    A row needing ``r`` tokens finishes after about ``r / mean`` rounds, give or take ``sqrt(r) * std / mean^1.5``
    (renewal counting); the batch runs until its last row does, about ``z`` of those spreads longer,
    ``z`` = :func:`expected_max_of_normals` ``(rows)``. Over the ``r`` tokens that makes

    ``mean / (1 + z * std / sqrt(r * mean))``

    tokens a round: the row's own ``mean`` for one row, less for wide batches and short remainders. A plain target
    step gains every row exactly one token (``std`` 0), so it keeps its one.

    Args:
        mean (`float`): a row's expected tokens per round (the target's own token included).
        std (`float`): their standard deviation from round to round.
        remaining (`int`): tokens the row furthest from its end still needs (``max_length`` bound).
        rows (`int`): unfinished rows of the batch.
    """
    if rows <= 1 or remaining <= 0 or mean <= 0 or std <= 0:
        return mean
    return mean / (1.0 + expected_max_of_normals(rows) * std / math.sqrt(remaining * mean))
