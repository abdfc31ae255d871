"""Acceptance statistics of EAGLE-3 decoding (chain and tree), as published on the draft after each ``generate`` call
(``draft.last_stats`` / ``draft.cumulative_stats``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field


@dataclass
class Eagle3Stats:
    """Acceptance statistics of EAGLE-3 decoding, summed over drafting rounds (and calls, with ``+``).

    Args:
        num_drafts: rounds in which the draft proposed at least one token (one target forward each).
        drafted_per_position: ``drafted_per_position[i]`` = rounds that proposed a token at position i.
        accepted_per_position: ``accepted_per_position[i]`` = rounds whose token at position i was accepted.
        num_target_forwards: all target forwards, the prefill (which has no draft) included.
        num_output_tokens: tokens generated.
        num_rounds_without_draft: target forwards after a call's prefill that verified no draft (``"auto"`` chose
            not to draft, or ``max_length`` left no room).
    """

    num_drafts: int = 0
    drafted_per_position: list = field(default_factory=list)
    accepted_per_position: list = field(default_factory=list)
    num_target_forwards: int = 0
    num_output_tokens: int = 0
    num_rounds_without_draft: int = 0

    @property
    def num_draft_tokens(self) -> int:
        """Total drafted tokens."""
        return sum(self.drafted_per_position)

    @property
    def num_accepted_tokens(self) -> int:
        """Total accepted drafted tokens."""
        return sum(self.accepted_per_position)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafting round, counting the target's bonus token: ``1 + accepted / num_drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_draft_length(self) -> float:
        """Tokens drafted per drafting round."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list:
        """Fraction of drafting rounds whose token i was accepted (vLLM's "acceptance at token i")."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """
        Add one drafting round (one target forward).

        Args:
            drafted (`int`): tokens the round proposed (0 for the prefill, which has no draft).
            accepted (`int`): how many of them, from the first, the target accepted.
        """
        prefill = self.num_target_forwards == 0  # a call's statistics start with its prefill
        self.num_target_forwards += 1
        self.num_output_tokens += accepted + 1
        if drafted == 0:
            self.num_rounds_without_draft += 0 if prefill else 1
            return
        self.num_drafts += 1
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def __add__(self, other: "Eagle3Stats") -> "Eagle3Stats":
        """The statistics of both, summed (per-position lists padded with zeros to the longer one)."""
        n = max(len(self.drafted_per_position), len(other.drafted_per_position))

        def pad(x):
            return list(x) + [0] * (n - len(x))

        return Eagle3Stats(
            num_drafts=self.num_drafts + other.num_drafts,
            drafted_per_position=[a + b for a, b in zip(pad(self.drafted_per_position), pad(other.drafted_per_position))],
            accepted_per_position=[a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))],
            num_target_forwards=self.num_target_forwards + other.num_target_forwards,
            num_output_tokens=self.num_output_tokens + other.num_output_tokens,
            num_rounds_without_draft=self.num_rounds_without_draft + other.num_rounds_without_draft,
        )

    def to_dict(self) -> dict:
        """The statistics and the derived rates as a JSON-friendly dict."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_target_forwards": self.num_target_forwards,
            "num_output_tokens": self.num_output_tokens,
            "num_rounds_without_draft": self.num_rounds_without_draft,
            "mean_draft_length": self.mean_draft_length,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
        }

    def report(self) -> str:
        """The report of vLLM's EAGLE example (mean acceptance length, then acceptance at each token), after a line
        saying how many rounds drafted: the acceptance is that of the rounds that did, and a budget that finds drafting
        does not pay on the machine at hand drafts in few rounds (see :meth:`rounds_summary`)."""
        rounds = self.num_drafts + self.num_rounds_without_draft
        lines = ["-" * 50, f"rounds with a draft: {self.num_drafts} of {rounds} "
                 f"(and {self.num_rounds_without_draft} plain target steps: drafting would not pay, or had no room)",
                 f"mean acceptance length: {self.mean_acceptance_length:.2f} (over the rounds with a draft)", "-" * 50]
        lines += [f"acceptance at token {i}: {r:.2f}" for i, r in enumerate(self.acceptance_rate_per_position)]
        return "\n".join(lines)

    def rounds_summary(self) -> str:
        """One line on the drafting rounds: how many drafted, their mean length, how many drafted nothing."""
        return (f"rounds drafted: {self.num_drafts} (mean k {self.mean_draft_length:.2f}), rounds without a draft: "
                f"{self.num_rounds_without_draft}")


_THREAD = threading.local()  # per thread: its latest published statistics, by board (weak keys)
_LOCK = threading.Lock()  # guards every board's latest and cumulative statistics

_KEEP = object()


class StatsBoard:
    """
    Where a draft publishes the statistics of its ``generate`` calls (``draft.last_stats``, ``last_batch_stats``,
    ``cumulative_stats`` read it). A thread reads the latest call it made itself with the draft, so that threads
    sharing one draft each read their own call's statistics; a thread that made none reads the latest call of any
    thread. The cumulative statistics sum every call of every thread since the last :meth:`reset`.
    """

    def __init__(self):
        self.latest = (None, None)  # (the sum over the rows, one per row) of the latest call of any thread
        self.cumulative = None
        self.epoch = 0  # raised by reset: what threads published before it is forgotten

    @staticmethod
    def _mine() -> weakref.WeakKeyDictionary:
        boards = getattr(_THREAD, "boards", None)
        if boards is None:
            boards = _THREAD.boards = weakref.WeakKeyDictionary()
        return boards

    def view(self) -> tuple:
        """``(last, rows)`` as the calling thread reads them (see the class)."""
        mine = self._mine().get(self)
        return mine[1:] if mine is not None and mine[0] == self.epoch else self.latest

    def record(self, stats: Eagle3Stats, rows: list) -> None:
        """
        Publish a call's statistics (the calling thread's latest call, and the latest of any thread).

        Args:
            stats (`Eagle3Stats`): the sum over the call's rows.
            rows (`list[Eagle3Stats]`): one per row.
        """
        with _LOCK:
            self.latest = (stats, list(rows))
            self._mine()[self] = (self.epoch, *self.latest)
            self.cumulative = stats if self.cumulative is None else self.cumulative + stats

    def assign(self, last=_KEEP, rows=_KEEP) -> None:
        """
        Set what the calling thread (and a thread that made no call) reads, as a caller restoring statistics does.

        Args:
            last (`Eagle3Stats` or `None`, *optional*): the sum over the rows.
            rows (`list[Eagle3Stats]` or `None`, *optional*): one per row.
        """
        with _LOCK:
            seen = self.view()
            self.latest = (seen[0] if last is _KEEP else last, seen[1] if rows is _KEEP else rows)
            self._mine()[self] = (self.epoch, *self.latest)

    def reset(self) -> None:
        """Forget every call's statistics, in every thread."""
        with _LOCK:
            self.latest, self.cumulative = (None, None), None
            self.epoch += 1


def publish_stats(draft, rows: list, budget=None, spread: float | None = None) -> Eagle3Stats:
    """
    The end of a ``generate`` call, for every decoding path: publish the statistics on the draft (``last_stats``, the
    sum over the rows; ``last_batch_stats``, one per row; ``cumulative_stats``) and leave the draft's
    ``drafting_memory`` what the call's budget learnt and how far a batch's rows differed.

    Args:
        draft (`Eagle3DraftModel`): the draft.
        rows (`list[Eagle3Stats]`): one per sequence (one for batch 1).
        budget (`Budget`, *optional*): the call's budget (:mod:`~hf_eagle3.core.budget`).
        spread (`float`, *optional*): a batched call's variance of its rows' shares of the accepted tokens
            (:class:`~hf_eagle3.core.batch_tail.RowEstimate`), the next batched call's prior.

    Returns:
        `Eagle3Stats`: the sum over the rows.
    """
    total = Eagle3Stats()
    for stats in rows:
        total = total + stats
    if budget is not None:
        budget.finish(draft.drafting_memory)
    if spread is not None:
        draft.drafting_memory.rows_spread = spread
    draft._record_stats(total, rows=rows)
    return total
