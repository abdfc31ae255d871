"""Oracle drafting: the draft's forwards run as usual, but what it proposes is the target's own greedy continuation,
accepted for a length drawn each round from an acceptance profile (the first token past it is made wrong). Chains
(:class:`OracleCandidateGenerator`) and trees (:class:`OracleTreeDrafter`); the output stays the target's.
Used by ``hf-eagle3 bench --oracle`` (:mod:`hf_eagle3.bench.oracle`).
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch

from hf_eagle3.core.drafter import Eagle3Drafter
from hf_eagle3.core.candidate_generator import Eagle3CandidateGenerator
from hf_eagle3.core.cost_model import synchronize

PROFILES = {
    # Per-position acceptance of Llama-3.1-8B-Instruct with the EAGLE-3 authors' draft (chain, MT-bench; seed PR).
    "llama3-8b": (0.75, 0.55, 0.42, 0.31, 0.24, 0.18, 0.13),
    "perfect": (1.0,) * 8,
    "none": (0.0,),
}


def parse_profile(text: str) -> tuple[float, ...]:
    """
    Parse ``--oracle``: a name of :data:`PROFILES`, comma-separated per-position acceptance rates (non-increasing,
    in [0, 1]), or one number ``r``: every draft token accepted with probability ``r`` given the ones before it
    (rates ``r, r^2, ...`` for 16 positions).

    Args:
        text (`str`): the option's value.
    """
    if text in PROFILES:
        return PROFILES[text]
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--oracle {text!r}: a profile name ({', '.join(PROFILES)}) or rates like 0.8,0.6,0.4") from None
    if len(values) == 1:
        values = [values[0] ** (i + 1) for i in range(16)]
    if not values or any(not 0 <= v <= 1 for v in values) or any(b > a for a, b in zip(values, values[1:])):
        raise ValueError(f"--oracle {text!r}: rates must lie in [0, 1] and not increase with the position")
    return tuple(values)


def draw_acceptance(rng: random.Random, profile) -> int:
    """
    How many draft tokens a round accepts: ``P(result >= i) = profile[i - 1]`` (one uniform draw per round).

    Args:
        rng (`random.Random`): the draws' generator.
        profile (`tuple[float]`): non-increasing per-position acceptance.
    """
    u = rng.random()
    return sum(1 for p in profile if u < p)


def expected_tokens(profile, k: int) -> float:
    """
    Tokens per round for draft length ``k`` under ``profile``: ``1 + sum(profile[:k])``.

    Args:
        profile (`tuple[float]`): per-position acceptance.
        k (`int`): draft length.
    """
    return 1.0 + sum(profile[:k])


class OracleCandidateGenerator(Eagle3CandidateGenerator):
    """
    :class:`~hf_eagle3.Eagle3CandidateGenerator` whose proposals are the target's greedy continuation (``reference``)
    accepted for a length drawn each round from ``profile``; the draft's forwards still run. Also times its own work.

    Class attributes ``reference`` (`list[int]`: the whole greedy sequence), ``profile`` and ``rng`` are set by
    :func:`bind_oracle`.
    """

    reference: list = []
    profile: tuple = ()
    rng: random.Random = random.Random(0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft_seconds = 0.0
        self._round_len = 0
        self._accept = 0

    def get_candidates(self, input_ids, **kwargs):
        """Draw this round's acceptance length, then draft as usual (timed)."""
        start = time.perf_counter()
        self._accept = draw_acceptance(self.rng, self.profile)
        self._round_len = input_ids.shape[1]
        out = super().get_candidates(input_ids, **kwargs)
        synchronize(self.device)
        self.draft_seconds += time.perf_counter() - start
        return out

    def _select(self, seq, draft_scores):
        token, processed = super()._select(seq, draft_scores)
        position = seq.shape[1]
        if position < len(self.reference):
            right = self.reference[position]
            wrong = (right + 1) % self.draft.config.vocab_size
            value = right if position - self._round_len < self._accept else wrong
            token = torch.full_like(token, value)
        return token, processed


class OracleTreeDrafter(Eagle3Drafter):
    """
    :class:`~hf_eagle3.core.drafter.Eagle3Drafter` whose trees carry the target's greedy continuation
    along one path (to the tree's first deepest node), right for a depth drawn each round from ``profile``; every
    other node is wrong. So a tree accepts what a chain with the same profile accepts, at the tree's own cost (its
    drafting and its verification of every node): the rows show what the tree machinery costs, not what a real tree
    gains. One sequence (the bench's prompts run one at a time).

    Class attributes ``reference``, ``profile`` and ``rng`` are set by :func:`bind_oracle`.
    """

    reference: list = []
    profile: tuple = ()
    rng: random.Random = random.Random(0)

    def __init__(self, draft, rows, capacity):
        if rows != 1:
            raise ValueError(f"The oracle drafts one sequence (its reference); got a batch of {rows}.")
        super().__init__(draft, rows, capacity)
        self.draft_seconds = 0.0
        self.tree_depths = []  # depth of each round's tree (its shape follows the draft's scores)

    def _timed(self, method, *args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        synchronize(self.device)
        self.draft_seconds += time.perf_counter() - start
        return out

    def feed(self):
        """Feed as usual (timed)."""
        return self._timed(super().feed)

    def expand(self, depth, top_k):
        """Expand as usual (timed)."""
        return self._timed(super().expand, depth, top_k)

    def select(self, candidates, roots, total):
        """Select as usual, then write the oracle's tokens into the tree (timed)."""
        return self._timed(self._oracle_select, candidates, roots, total)

    def _oracle_select(self, candidates, roots, total):
        tree = super().select(candidates, roots, total)[0]
        self.tree_depths.append(int(tree.max_depth))
        accept = draw_acceptance(self.rng, self.profile)
        parents, depths = tree.parents.tolist(), tree.depths.tolist()
        tokens = tree.tokens.tolist()
        vocab = self.draft.config.vocab_size
        main, node = set(), max(range(len(tokens)), key=lambda i: (depths[i], -i))  # the first deepest node
        while node:
            main.add(node)
            node = parents[node]
        for i in range(1, len(tokens)):
            position = self.fed[0] + depths[i]  # the root is the last token, at position ``fed``
            right = self.reference[position] if position < len(self.reference) else tokens[i]
            if i in main:
                tokens[i] = right if depths[i] <= accept else (right + 1) % vocab
            else:
                tokens[i] = (right + 1 + i) % vocab
        tokens = torch.tensor(tokens, dtype=tree.tokens.dtype, device=tree.tokens.device)
        return [dataclasses.replace(tree, tokens=tokens)]


def bind_oracle(oracle_class: type, reference: list, profile, seed: int = 0) -> type:
    """
    A subclass of ``oracle_class`` (:class:`OracleCandidateGenerator` or :class:`OracleTreeDrafter`) bound to one
    prompt's greedy ``reference`` and ``profile``.

    Args:
        oracle_class (`type`): the oracle class to bind.
        reference (`list[int]`): prompt and greedy continuation of the target alone.
        profile (`tuple[float]`): per-position acceptance.
        seed (`int`): seed of the per-round draws.
    """
    return type(f"Bound{oracle_class.__name__}", (oracle_class,),
                {"reference": list(reference), "profile": tuple(profile), "rng": random.Random(seed)})
