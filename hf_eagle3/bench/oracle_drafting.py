"""Oracle drafting: the draft's forwards run as usual, but what it proposes is the target's own greedy continuation,
accepted for a length drawn each round from an acceptance profile (the first token past it is made wrong). Chains
(:class:`OracleCandidateGenerator`) and trees (:class:`OracleTreeDrafter`, whose candidates are scored by the profile:
:func:`profile_rescore`); the output stays the target's. Used by ``hf-eagle3 bench --oracle``
(:mod:`hf_eagle3.bench.oracle`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time

import torch

from hf_eagle3.core.drafter import Eagle3Drafter
from hf_eagle3.core.candidate_generator import Eagle3CandidateGenerator
from hf_eagle3.core.cost_model import synchronize
from hf_eagle3.core.tree_candidates import level_starts

PROFILES = {
    # Per-position acceptance of Llama-3.1-8B-Instruct with the EAGLE-3 authors' draft (chain, MT-bench; seed PR).
    "llama3-8b": (0.75, 0.55, 0.42, 0.31, 0.24, 0.18, 0.13),
    "perfect": (1.0,) * 8,
    "none": (0.0,),
}
FLOOR = 1e-6  # path probability of a main-path node that the profile never accepts (past its end, or a zero rate)
OFF_PATH = 1e-3  # path probability of a node off the main path relative to its parent's (see `profile_rescore`)


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


def profile_path_logp(profile, levels: int) -> list:
    """
    The main path's scores of :func:`profile_rescore`, by depth: ``log(profile[d - 1])`` (at least :data:`FLOOR`),
    never above the depth before.

    Args:
        profile (`tuple[float]`): per-position acceptance.
        levels (`int`): depths 1..levels.
    """
    out, score = [], 0.0
    for depth in range(1, levels + 1):
        rate = profile[depth - 1] if depth <= len(profile) else 0.0
        score = min(score, math.log(max(rate, FLOOR)))
        out.append(score)
    return out


def profile_rescore(candidates, path_logp: torch.Tensor):
    """
    Scores for a round's tree candidates that carry the profile, for every row, in tensors only (it also runs inside
    a captured drafting round; see :func:`~hf_eagle3.core.draft_round.draft_round`). The main path is the ancestry
    of the first candidate of the deepest level (so it reaches every level); its node at depth ``d`` gets the path
    probability that the profile accepts at least ``d`` tokens (``path_logp``: :func:`profile_path_logp`). Every
    other node gets :data:`OFF_PATH` times the smaller of its parent's path probability and the main path's last
    node's. So a child never scores above its parent, every main-path node ranks above every other node (a tree of
    the ``total`` best candidates holds the main path as deep as ``total`` and the levels allow), and the best path
    probabilities (``candidate_ranking``, what ``tree_total_tokens="auto"`` sizes trees from) are the profile's.

    Args:
        candidates: what :func:`~hf_eagle3.core.tree_candidates.grow_candidates` returned (``scores`` [B, M]).
        path_logp (`torch.Tensor` [levels]): :func:`profile_path_logp` of the round's levels.

    Returns:
        The candidates with their scores replaced.
    """
    scores, ids, parents, depths, levels = candidates
    rows, m = scores.shape
    starts = level_starts(m, levels)
    main = torch.zeros(rows, m + 1, dtype=torch.bool, device=scores.device)
    node = torch.full((rows, 1), starts[levels - 1] + 1, dtype=torch.long, device=scores.device)  # deepest, first
    for _ in range(levels):
        main.scatter_(1, node, True)
        node = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=scores.device), parents], 1).gather(1, node)
    main = main[:, 1:]
    on_path = path_logp.to(scores.dtype)[depths - 1].expand(rows, m)
    last, off = path_logp[levels - 1].to(scores.dtype), math.log(OFF_PATH)
    new = torch.zeros_like(scores)
    for i in range(levels):  # level by level: a parent is scored before its children
        level = slice(starts[i], starts[i + 1])
        parent = torch.zeros_like(new[:, level]) if i == 0 else new.gather(1, parents[:, level] - 1)
        new[:, level] = torch.where(main[:, level], on_path[:, level], torch.clamp(parent, max=last) + off)
    return new, ids, parents, depths, levels


def ranked_path(parents: list, scores: list) -> list:
    """
    The path that ranks first: from the root, at each node its best-scored child (the main path of
    :func:`profile_rescore`, among candidates or in a tree selected from them).

    Args:
        parents (`list[int]`): [M] each node's parent (node numbers 1..M, parents first, 0 = the root).
        scores (`list[float]`): [M] their cumulative log-probabilities.

    Returns:
        `list[int]`: the path's node numbers from depth 1 down (empty without nodes).
    """
    children = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents, start=1):
        children[parent].append(i)
    path, node = [], 0
    while children[node]:
        node = max(children[node], key=lambda i: (scores[i - 1], -i))
        path.append(node)
    return path


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
    :class:`~hf_eagle3.core.drafter.Eagle3Drafter` whose candidates are scored by ``profile`` along a main path
    (:func:`profile_rescore`), so trees follow it as deep as their size allows and ``tree_total_tokens="auto"`` sizes
    them from the profile's probabilities, and whose trees carry the target's greedy continuation along that path,
    right for a depth drawn each round from ``profile``; every other node is wrong. So a tree accepts what a chain
    as deep as its main path accepts with the same profile, at the tree's own cost (its drafting and its verification
    of every node): the rows show what the tree machinery costs, not what a real tree gains. One sequence (the bench's
    prompts run one at a time).

    Class attributes ``reference``, ``profile`` and ``rng`` are set by :func:`bind_oracle`.
    """

    reference: list = []
    profile: tuple = ()
    rng: random.Random = random.Random(0)

    def __init__(self, draft, rows, capacity):
        if rows != 1:
            raise ValueError(f"The oracle drafts one sequence (its reference); got a batch of {rows}.")
        super().__init__(draft, rows, capacity)
        # A captured round (static drafting steps) rescores its candidates inside the region.
        self.rescore = (profile_rescore, lambda levels: torch.tensor(profile_path_logp(self.profile, levels),
                                                                     device=self.device))
        self.draft_seconds = 0.0
        self.tree_depths = []  # depth of each round's tree (its main path's)

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
        """Expand as usual, then replace the candidates' scores by the profile's (:func:`profile_rescore`; timed)."""
        return self._timed(self._oracle_expand, depth, top_k)

    def select(self, candidates, roots, total):
        """Select as usual, then write the oracle's tokens into the tree (timed)."""
        return self._timed(self._oracle_select, candidates, roots, total)

    def _captured_round(self, roots, depth, top_k, total, ranking):
        """A captured round as usual (its candidates rescored inside), then the oracle's tokens (timed)."""
        return self._timed(self._oracle_captured, roots, depth, top_k, total, ranking)

    def _oracle_captured(self, roots, depth, top_k, total, ranking):
        drafted = super()._captured_round(roots, depth, top_k, total, ranking)
        return dataclasses.replace(drafted, trees=[self._oracle_tokens(drafted.trees[0])])

    def _oracle_expand(self, depth, top_k):
        candidates = super().expand(depth, top_k)
        return self.rescore[0](candidates, self.rescore[1](candidates[4]))

    def _oracle_select(self, candidates, roots, total):
        return [self._oracle_tokens(super().select(candidates, roots, total)[0])]

    def _oracle_tokens(self, tree):
        """``tree`` carrying the reference along its main path, right for a depth drawn from the profile."""
        parents, depths = tree.parents.tolist(), tree.depths.tolist()
        tokens = tree.tokens.tolist()
        main = set(ranked_path(parents[1:], tree.scores.tolist()))  # the main path that `_oracle_expand` scored
        self.tree_depths.append(len(main))
        accept = draw_acceptance(self.rng, self.profile)
        vocab = self.draft.config.vocab_size
        for i in range(1, len(tokens)):
            position = self.fed[0] + depths[i]  # the root is the last token, at position ``fed``
            right = self.reference[position] if position < len(self.reference) else tokens[i]
            if i in main:
                tokens[i] = right if depths[i] <= accept else (right + 1) % vocab
            else:
                tokens[i] = (right + 1 + i) % vocab
        tokens = torch.tensor(tokens, dtype=tree.tokens.dtype, device=tree.tokens.device)
        return dataclasses.replace(tree, tokens=tokens)


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
