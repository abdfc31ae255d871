"""EAGLE-2-style dynamic draft trees: :func:`grow_candidates` grows every row's candidates level by level with the
draft, :func:`select_trees` keeps the best ones as :class:`DraftTree` s, and :func:`candidate_ranking` summarises the
candidates for ``tree_total_tokens="auto"``. :class:`~hf_eagle3.core.drafter.Eagle3Drafter` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A draft tree, in an order where parents come before their children. Node 0 is the root: the last token of the
    sequence (verified, not drafted).

    Args:
        tokens (`torch.LongTensor` [n]): target-vocabulary ids; ``tokens[0]`` is the root's.
        parents (`torch.LongTensor` [n]): parent of each node (``parents[0] == 0``).
        depths (`torch.LongTensor` [n]): depth of each node (root 0).
        ancestors (`torch.BoolTensor` [n, n]): ``ancestors[i, j]``: j is i or an ancestor of i.
        scores (`torch.FloatTensor` [n - 1] or `None`): cumulative draft log-probability of nodes 1..n-1 (``None``
            for trees built without drafting: a lone root, or the chains that time the target).
        max_depth (`int`): an upper bound of the tree's depth (the number of expansion levels used).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    ancestors: torch.BoolTensor
    scores: torch.FloatTensor
    max_depth: int

    @classmethod
    def root_only(cls, root_token: torch.LongTensor) -> "DraftTree":
        """
        The tree of a round that drafts nothing: the root alone (a plain target step).

        Args:
            root_token (`torch.LongTensor` [1]): the sequence's last token.
        """
        zero = torch.zeros(1, dtype=torch.long, device=root_token.device)
        return cls(root_token, zero, zero, torch.ones(1, 1, dtype=torch.bool, device=root_token.device), None, 0)


def grow_candidates(logits: torch.Tensor, hidden: torch.Tensor, depth: int, top_k: int, step):
    """
    The candidates of a round for every row, level by level: the ``top_k`` most likely children of each of the
    ``top_k`` frontier nodes, scored by cumulative log-probability; the next frontier is the ``top_k`` best of them.

    Args:
        logits (`torch.Tensor` [B, draft_vocab]): the draft's scores at each row's root.
        hidden (`torch.Tensor` [B, 1, H]): the draft's output there.
        depth (`int`): levels (>= 1).
        top_k (`int`): children per expanded node, and frontier width (capped at the draft vocabulary).
        step (`Callable`): ``step(draft_ids [B, k], hidden [B, k, H], level, ancestors [B, k, (level - 1) k])``
            runs the draft forward of one level (the frontier, each node seeing its row's verified positions, its
            ``ancestors`` among the earlier levels' entries and itself) and returns its `Eagle3DraftOutput`.

    Returns:
        ``(scores [B, M], draft_ids [B, M], parents [B, M], depths [M], levels)``: candidates 1..M in level order
        (``parents`` are candidate numbers, 0 = the root), and the number of levels.
    """
    device, rows = logits.device, logits.shape[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(top_k, logp.shape[-1])
    scores, ids = logp.topk(k, dim=-1)  # [B, k]
    all_scores, all_ids = [scores], [ids]
    all_parents = [torch.zeros(rows, k, dtype=torch.long, device=device)]
    all_depths = [torch.ones(k, dtype=torch.long, device=device)]
    frontier = torch.arange(1, k + 1, device=device).expand(rows, k)  # candidate numbers of each row's frontier
    hidden = hidden.expand(rows, k, hidden.shape[-1])
    eye = torch.eye(k, dtype=torch.bool, device=device)
    ancestors = torch.zeros(rows, k, 0, dtype=torch.bool, device=device)  # frontier x earlier tree entries
    base = 1 + k  # candidate number of the next level's first child
    for level in range(1, depth):
        out = step(ids, hidden, level, ancestors)
        child_logp, child_ids = torch.log_softmax(out.logits.float(), dim=-1).topk(k, dim=-1)  # [B, k, k]
        child_scores = (scores[:, :, None] + child_logp).flatten(1)
        child_ids = child_ids.flatten(1)
        all_scores.append(child_scores)
        all_ids.append(child_ids)
        all_parents.append(frontier.repeat_interleave(k, dim=1))
        all_depths.append(torch.full((k * k,), level + 1, dtype=torch.long, device=device))
        if level == depth - 1:
            break
        scores, best = child_scores.topk(k, dim=-1)
        slot = best // k  # each new frontier node's parent, by its place in the current frontier
        frontier, ids = base + best, child_ids.gather(1, best)
        hidden = out.hidden_states.gather(1, slot[..., None].expand(-1, -1, out.hidden_states.shape[-1]))
        ancestors = torch.cat([ancestors.gather(1, slot[..., None].expand(-1, -1, ancestors.shape[-1])), eye[slot]],
                              dim=-1)
        base += k * k
    return (torch.cat(all_scores, dim=1), torch.cat(all_ids, dim=1), torch.cat(all_parents, dim=1),
            torch.cat(all_depths), len(all_ids))


def select_trees(candidates, roots: torch.LongTensor, total: int, d2t) -> list:
    """
    Keep each row's ``total`` best candidates (closed under parents: see :func:`ranking_key`) and
    build its tree around its root (:func:`select_nodes`, split per row).

    Args:
        candidates: what :func:`grow_candidates` returned.
        roots (`torch.LongTensor` [B]): each row's last token.
        total (`int`): nodes to keep per row besides the root (at most the number of candidates).
        d2t (`Eagle3D2TLogitsProcessor`): maps draft ids to target ids.

    Returns:
        `list[DraftTree]`: one per row, each of ``min(total, M) + 1`` nodes.
    """
    n = min(int(total), candidates[0].shape[1])
    return trees_from(select_nodes(candidates, roots, n, d2t), n, min(n, candidates[4]))


def select_nodes(candidates, roots: torch.LongTensor, n: int, d2t) -> tuple:
    """
    Each row's ``n`` best candidates as tree planes, best first: node ``i`` ranks above node ``i + 1``, so a parent
    (which ranks above its children) comes before them, and the first ``m + 1`` nodes are the tree of the ``m``
    best for any ``m <= n`` (equal keys keep the candidates' level order, so the choice among them does not depend on
    ``n``). Only tensors: it runs inside a captured drafting round too.

    Args:
        candidates: what :func:`grow_candidates` returned (``M`` candidates per row).
        roots (`torch.LongTensor` [B]): each row's last token.
        n (`int`): nodes to keep per row besides the root (``<= M``).
        d2t (`Eagle3D2TLogitsProcessor`): maps draft ids to target ids.

    Returns:
        ``(tokens [B, n + 1], parents [B, n + 1], depths [B, n + 1], ancestors [B, n + 1, n + 1], scores [B, n])``:
        target ids (the root first), parent numbers, depths, ancestor masks, cumulative draft log-probabilities.
    """
    scores, ids, parents, depths, levels = candidates
    rows, device = scores.shape[0], scores.device
    key = ranking_key(scores, depths)
    chosen = key.sort(dim=-1, descending=True, stable=True).indices[:, :n]  # [B, n], best first
    order = torch.arange(1, n + 1, device=device).expand(rows, n)
    number = torch.zeros(rows, key.shape[1] + 1, dtype=torch.long, device=device).scatter(1, chosen + 1, order)
    zero = torch.zeros(rows, 1, dtype=torch.long, device=device)
    tree_parents = torch.cat([zero, number.gather(1, parents.gather(1, chosen))], dim=1)
    tree_depths = torch.cat([zero, depths[chosen]], dim=1)
    tokens = torch.cat([roots.view(rows, 1).to(device), d2t.map_tokens(ids.gather(1, chosen))], dim=1)
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=device).repeat(rows, 1, 1)
    node = torch.arange(n + 1, device=device).expand(rows, n + 1)
    for _ in range(min(n, levels)):
        node = tree_parents.gather(1, node)
        ancestors.scatter_(2, node[..., None], True)
    return tokens, tree_parents, tree_depths, ancestors, scores.gather(1, chosen)


def trees_from(planes: tuple, n: int, max_depth: int) -> list:
    """
    One :class:`DraftTree` per row from :func:`select_nodes`' planes, cut to the ``n`` best nodes besides the root
    (views: no copy, no kernel).

    Args:
        planes (`tuple`): what :func:`select_nodes` returned (``n`` or more nodes besides the root).
        n (`int`): nodes to keep besides the root.
        max_depth (`int`): an upper bound of the trees' depths (the expansion levels, at most ``n``).

    Returns:
        `list[DraftTree]`: one per row.
    """
    tokens, parents, depths, ancestors, scores = planes
    return [DraftTree(tokens[b, : n + 1], parents[b, : n + 1], depths[b, : n + 1], ancestors[b, : n + 1, : n + 1],
                      scores[b, :n], max_depth) for b in range(tokens.shape[0])]


def ranking_key(scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """
    Ranking of candidates: the cumulative log-probability, with a tiny per-depth penalty so that a child always
    ranks strictly below its parent (ties, and ``-inf`` scores, would otherwise break the closure under parents).

    Args:
        scores (`torch.FloatTensor` [..., M]): cumulative log-probabilities of the candidates.
        depths (`torch.LongTensor` [M]): their depths.

    Returns:
        `torch.DoubleTensor` [..., M]: higher is better.
    """
    return scores.double().clamp(min=-1e6) - 1e-9 * depths.double()


def level_starts(m: int, levels: int) -> list:
    """
    Where each level's candidates start among :func:`grow_candidates`' ``m`` (level 1 holds ``k`` of them and each
    further level ``k * k``, so ``k`` follows from ``m = k + (levels - 1) * k^2``), and the end.

    Args:
        m (`int`): the candidates.
        levels (`int`): their levels.

    Returns:
        `list[int]`: ``levels + 1`` offsets, from 0 to ``m``.
    """
    k = m if levels == 1 else round((-1 + (1 + 4 * (levels - 1) * m) ** 0.5) / (2 * (levels - 1)))
    return [0] + [k + i * k * k for i in range(levels)]


def candidate_ranking(candidates) -> torch.Tensor:
    """
    What sizes the next round's tree (``tree_total_tokens="auto"``), from this round's candidates: their path
    probabilities (the draft's estimate of each one's chance to be accepted), sorted in decreasing order in each
    row and averaged over the rows, so that what a tree of ``N`` nodes is expected to accept (per row) is the sum
    of the first ``N``; and, per level, the path probability mass of the frontier a further level would expand
    (the ``top_k`` best candidates of the level; a child's path probability never exceeds its parent's, so this
    bounds what the next level can add). Stays on the device (read back with the round's planes).

    Args:
        candidates: what :func:`grow_candidates` returned (one row: ``scores`` [M]; a batch: [B, M]).

    Returns:
        `torch.DoubleTensor` [2, M]: the sorted probabilities; the frontier masses of levels 1, 2, ..., then zeros.
    """
    scores, _, _, depths, levels = candidates
    m = depths.shape[-1]
    key = ranking_key(scores, depths).reshape(-1, m)
    probs = key.exp()
    starts = level_starts(m, levels)
    k = starts[1]
    masses = [probs[:, starts[i] : starts[i + 1]].topk(k, dim=-1).values.sum(-1).mean() for i in range(levels)]
    frontier = torch.zeros(m, dtype=torch.float64, device=probs.device)
    frontier[:levels] = torch.stack(masses)
    return torch.stack([probs.sort(dim=-1, descending=True).values.mean(0), frontier])
