"""The acceptance step of a verification round, as pure functions: which drafted nodes the target accepts, which token
it adds, and how many of those tokens stay once the length limit and EOS are applied, for the package's decoding
loop (:mod:`~hf_eagle3.core.decoding_loop`: trees at every batch size, chains for batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# Logits processors whose output at a node does not depend on the tokens before it: with only these (or none), every
# node of a tree is processed in one call and the sampled walk is decided on the device (see sampling_decisions).
PREFIX_FREE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                          TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


def prefix_free(processors) -> bool:
    """Whether ``processors`` (a `LogitsProcessorList` or ``None``) ignore the sequence they are given."""
    return processors is None or all(type(p) in PREFIX_FREE_PROCESSORS for p in processors)


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


def sampling_decisions(probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """:func:`sample_among_children` at every node of a tree at once, on the device (no host synchronisation).

    At node ``i`` the children are tried in node order: child ``j`` is accepted with probability ``p_i(x_j)`` under
    ``p_i`` renormalised after the rejected siblings (``u_ij * remaining_ij < p_i(x_j)``, ``remaining`` being one minus
    the mass of the siblings tried before); when all are rejected the bonus is sampled from ``p_i`` with the children's
    tokens removed (or from ``p_i`` when nothing is left). Decisions at nodes the walk never reaches are drawn and
    ignored, so the walk's tokens are distributed exactly as with :func:`sample_among_children`.

    Args:
        probs (`torch.FloatTensor` [n, V]): the target's distribution at each node (after its logits processors).
        tokens (`torch.LongTensor` [n]): each node's token (node 0 is the root).
        parents (`torch.LongTensor` [n]): each node's parent (``parents[0]`` ignored).

    Returns:
        `torch.LongTensor` [2, n]: the accepted child's node index at each node (-1 when none is), and the residual
        sample at each node.
    """
    n = tokens.shape[0]
    nodes = torch.arange(n, device=probs.device)
    is_child = (parents[None, :] == nodes[:, None]) & (nodes[None, :] > 0)  # [i, j]: node j is a child of node i
    p = probs.double().gather(1, tokens[None, :].expand(n, n)) * is_child
    remaining = 1.0 - (torch.cumsum(p, dim=1) - p)  # mass left when child j is tried
    uniforms = torch.rand((n, n), dtype=torch.float64, device=probs.device)
    accept = is_child & (remaining > 0) & (uniforms * remaining < p)
    first = torch.where(accept, nodes[None, :], n).min(dim=1).values
    first = torch.where(first == n, -1, first)
    hit = torch.zeros_like(probs).scatter_add_(1, tokens[None, :].expand(n, n), is_child.to(probs.dtype))
    residual = torch.where(hit > 0, 0.0, probs)
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    sample = torch.multinomial(dist / dist.sum(-1, keepdim=True), 1)[:, 0]
    return torch.stack([first, sample])


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
              process=None, decisions=None, processed=None) -> TreeWalk:
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
        decisions (`list[list[int]]`, *optional*): sampling only, :func:`sampling_decisions` read back (accepted
            child per node, residual sample per node); when given, ``processed`` holds every node's processed scores
            ``[n, V]`` and ``process`` is not called.
        processed (`torch.FloatTensor` [n, V], *optional*): with ``decisions``.
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
        if decisions is not None:
            walk.scores.append(processed[node : node + 1])
            walk.logits.append(row)
            child, bonus = decisions[0][node], decisions[1][node]
            if child < 0:
                walk.bonus = bonus
                return walk
            node = child
            walk.accepted.append(node)
            continue
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


def round_planes(tree, logits: torch.Tensor, do_sample: bool, processors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a row's acceptance needs from the device, as one tensor to read back with the other rows'.

    Always the tree's tokens, parents and depths; greedy without processors, the target's argmax at each node;
    sampling with prefix-free processors (or none), the processed scores of every node and the
    :func:`sampling_decisions`. Otherwise (processors that read the prefix) the walk processes node by node.

    Args:
        tree (`DraftTree`): the row's verified tree (``n`` nodes).
        logits (`torch.FloatTensor` [n, V]): the target's logits at the tree's nodes.
        do_sample (`bool`): sampling (else greedy).
        processors (`LogitsProcessorList` or `None`): the call's logits processors.

    Returns:
        ``(planes [3, n] | [4, n] | [5, n] on the tree's device, processed [n, V] or None)``: read ``planes`` back
        and give each row's lists to :func:`walk_planes`.
    """
    planes, processed, device = [tree.tokens, tree.parents, tree.depths], None, tree.tokens.device
    if not do_sample and processors is None:
        planes.append(logits.argmax(-1).to(device))
    elif do_sample and prefix_free(processors):
        n = logits.shape[0]
        ids = torch.zeros((n, 1), dtype=torch.long, device=logits.device)  # prefix-free: never read
        processed = processors(ids, logits.clone()) if processors is not None else logits
        decided = sampling_decisions(processed.softmax(-1), tree.tokens.to(logits.device),
                                     tree.parents.to(logits.device))
        planes += list(decided.to(device))
    return torch.stack(planes), processed


PROBABILITY_SCALE = 1 << 24  # path probabilities travel to the host as integers, in one transfer with the planes


def _nested(flat: list, shape) -> list:
    for size in reversed(shape[1:]):
        flat = [flat[i : i + size] for i in range(0, len(flat), size)]
    return flat


def read_back(planes: torch.Tensor, ranking: torch.Tensor | None = None) -> tuple[list, list | None]:
    """
    The round's one read-back: ``planes`` (from :func:`round_planes`, one row ``[P, n]`` or stacked rows
    ``[B, P, N]``) as nested host lists and, in the same transfer, the candidate ranking that sizes the next round's
    tree (``tree_total_tokens="auto"``: the sorted path probabilities and the frontier masses per level).

    Args:
        planes (`torch.LongTensor`): the planes.
        ranking (`torch.Tensor` [R, M], *optional*): non-negative values below ``2**39`` (probabilities, masses).

    Returns:
        ``(planes as nested lists, ranking as nested lists of floats or None)``; the ranking comes back rounded to
        ``1 / PROBABILITY_SCALE`` (integers exactly).
    """
    if ranking is None:
        return planes.tolist(), None
    scaled = (ranking.double() * PROBABILITY_SCALE).round().long().to(planes.device)
    values = torch.cat([planes.flatten().long(), scaled.flatten()]).tolist()
    count = planes.numel()
    extra = [v / PROBABILITY_SCALE for v in values[count:]]
    return _nested(values[:count], planes.shape), _nested(extra, ranking.shape)


def walk_planes(host: list, logits: torch.Tensor, do_sample: bool, processed=None, process=None) -> TreeWalk:
    """:func:`walk_tree` on one row's planes from :func:`round_planes`, read back as lists (``host[0]`` tokens,
    ``host[1]`` parents, then the argmax or the sampling decisions when present).

    Args:
        host (`list[list[int]]`): the row's planes, each cut to its ``n`` nodes.
        logits (`torch.FloatTensor` [n, V]): the target's logits at the nodes.
        do_sample (`bool`): sampling (else greedy).
        processed (`torch.FloatTensor` [n, V], *optional*): from :func:`round_planes` (with decisions).
        process: the node-by-node processing of :func:`walk_tree` (processors that read the prefix).
    """
    if len(host) == 4:
        return walk_tree(host[0], host[1], logits, do_sample, argmax=host[3])
    if len(host) == 5:
        return walk_tree(host[0], host[1], logits, do_sample, decisions=host[3:5], processed=processed)
    return walk_tree(host[0], host[1], logits, do_sample, process=process)


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


def accept_row(host: list, logits: torch.Tensor, do_sample: bool, processed, process, room: int,
               eos: set) -> tuple[TreeWalk, list[int]]:
    """
    One sequence's acceptance after the round's read-back (every row of the loop): :func:`walk_planes` over its tree,
    then its new tokens (the accepted drafts and the target's bonus) cut by :func:`clip_new_tokens`.

    Args:
        host (`list[list[int]]`): the row's planes, cut to its ``n`` nodes.
        logits (`torch.FloatTensor` [n, V]): the target's logits at the nodes.
        do_sample (`bool`): sampling (else greedy).
        processed (`torch.FloatTensor` [n, V] or `None`): from :func:`round_planes`.
        process: the node-by-node processing of :func:`walk_tree`, or ``None``.
        room (`int`): tokens the row may still add (``max_length`` minus its length).
        eos (`set[int]`): end-of-sequence ids.

    Returns:
        ``(walk, new_tokens)``.
    """
    walk = walk_planes(host, logits, do_sample, processed, process=process)
    tokens = host[0]
    return walk, clip_new_tokens([tokens[a] for a in walk.accepted] + [walk.bonus], room, eos)
