"""The acceptance step of a verification round, as pure functions: which drafted nodes the target accepts, which token
it adds, and how many of those tokens stay once the length limit and EOS are applied. Shared by the tree loop
(batch 1) and the batched loop (chains and trees).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TreeWalk:
    """The outcome of one row's acceptance walk.

    Args:
        accepted (`list[int]`): the accepted nodes (tree indices, root excluded), from the root down.
        bonus (`int`): the target's own token after the last accepted node.
        scores (`list[torch.FloatTensor]`): the processed scores ``[1, V]`` at each visited node (root first).
        logits (`list[torch.FloatTensor]`): the raw logits ``[1, V]`` at each visited node.
    """

    accepted: list = field(default_factory=list)
    bonus: int = 0
    scores: list = field(default_factory=list)
    logits: list = field(default_factory=list)


def sample_among_children(probs: torch.Tensor, child_tokens: list[int]):
    """Multi-candidate speculative sampling at one tree node (recursive rejection sampling, deterministic drafts).

    Try the children in order: accept child x with probability ``p(x)`` under the current (renormalised) ``p``; on
    rejection set ``p(x) = 0`` and renormalise. If every child is rejected, sample from the residual. The returned
    token is distributed exactly as ``probs`` (see docs/trees.md).

    Args:
        probs (`torch.FloatTensor` [V]): the target's distribution at the node (after its logits processors).
        child_tokens (`list[int]`): the children's tokens, distinct, in the order to try them.

    Returns:
        ``(index, None)`` when child ``index`` is accepted, else ``(None, token)`` with the residual sample.
    """
    if child_tokens:
        index = torch.tensor(child_tokens, device=probs.device)
        p_children = probs[index].double().tolist()
        uniforms = torch.rand(len(child_tokens), dtype=torch.float64).tolist()
        remaining = 1.0
        for i, (p, u) in enumerate(zip(p_children, uniforms)):
            if remaining > 0 and u * remaining < p:
                return i, None
            remaining -= p
        residual = probs.clone()
        residual[index] = 0
        if residual.sum() > 0:
            probs = residual
    return None, int(torch.multinomial(probs / probs.sum(), 1))


def children_lists(parents: list[int]) -> list[list[int]]:
    """The children of every node, in node order (the candidate order: decreasing draft score).

    Args:
        parents (`list[int]`): the parent of each node (``parents[0]`` is the root's, ignored).
    """
    children = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    return children


def walk_tree(tokens: list[int], parents: list[int], logits: torch.Tensor, do_sample: bool, argmax=None,
              process=None) -> TreeWalk:
    """Walk down a verified tree from the root along the children the target accepts.

    Greedy: a child is accepted when its token is the target's choice at its parent; sampling: by
    :func:`sample_among_children`, which keeps the target's distribution. The walk ends at the first node where no
    child is accepted, whose target choice (greedy) or residual sample becomes the bonus token.

    Args:
        tokens (`list[int]`): the token of each node (node 0 is the root, the last verified token).
        parents (`list[int]`): the parent of each node.
        logits (`torch.FloatTensor` [n, V]): the target's logits at each node.
        do_sample (`bool`): sample (else greedy).
        argmax (`list[int]`, *optional*): the target's greedy choice at each node, precomputed (only valid without
            logits processors); when given, ``process`` is not called.
        process (`Callable[[list[int], torch.FloatTensor], torch.FloatTensor]`, *optional*): maps the accepted path
            so far (tokens) and a node's logits ``[1, V]`` to the processed scores (the logits processors with the
            node's own prefix); ``None``: the logits as they are.

    Returns:
        `TreeWalk`.
    """
    children = children_lists(parents)
    walk, node = TreeWalk(), 0
    while True:
        row = logits[node : node + 1]
        if argmax is not None:
            scores, choice = row, argmax[node]
        else:
            scores = process([tokens[a] for a in walk.accepted], row) if process is not None else row
            choice = None if do_sample else int(scores[0].argmax())
        walk.scores.append(scores)
        walk.logits.append(row)
        kids = children[node]
        if do_sample:
            index, bonus = sample_among_children(scores[0].softmax(-1), [tokens[c] for c in kids])
            if index is None:
                walk.bonus = bonus
                return walk
            node = kids[index]
        else:
            match = [c for c in kids if tokens[c] == choice]
            if not match:
                walk.bonus = choice
                return walk
            node = match[0]
        walk.accepted.append(node)


def clip_new_tokens(tokens: list[int], room: int, eos: set) -> list[int]:
    """The tokens of a round that stay: at most ``room`` of them, and none after the first EOS.

    Args:
        tokens (`list[int]`): the accepted tokens followed by the bonus token.
        room (`int`): tokens left before ``max_length``.
        eos (`set[int]`): end-of-sequence ids.
    """
    tokens = tokens[: max(room, 0)]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
