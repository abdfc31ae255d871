"""A drafting round as one function of tensors, for capture: the feed of the verified positions, every level of the
trees, top-k, selection and masks, with no host read and no Python number that changes from round to round.

:class:`~hf_eagle3.core.drafter.Eagle3Drafter` runs :func:`draft_round` through
:meth:`~hf_eagle3.core.modeling_eagle3.Eagle3DraftModel.step_call` when the draft's compile config asks for static
steps (one compiled region a round, captured as a CUDA graph under ``mode="reduce-overhead"`` on CUDA), over a static
:class:`~hf_eagle3.core.draft_cache.Eagle3RowCache`. Its shapes come in buckets, one graph each: the feed's width
(:func:`feed_width`), the levels and top-k of the trees, and the nodes kept (:func:`nodes_kept`).

Glossary:

- **feed**: a row's verified positions the draft has not read yet (their target features and next tokens), written
  at their own columns of the row cache (column = position); padding entries of a row go to the cache's last column,
  which nothing attends to.
- **shared region**: the columns after the longest row's positions, where every row writes its tree levels.
- **trash column**: the cache's last column (the drafter sizes the cache one column past what a call writes).
"""

from __future__ import annotations

import torch

from .draft_cache import causal_mask
from .target_cache import NODE_BUCKETS
from .tree_candidates import candidate_ranking, grow_candidates, select_nodes

FEED_BUCKETS = (1, 2, 4, 8, 16)  # feed widths a captured round takes (wider feeds run eagerly before it)


def feed_width(width: int, depth: int) -> int | None:
    """
    The width a captured round pads its feed to: the least bucket holding both the feed and a round's longest
    accepted run plus one (``depth + 1``), so that the feeds after drafted rounds share one graph; ``None`` when the
    feed is wider than every bucket (a prompt, or positions that waited through plain rounds): it runs eagerly first.

    Args:
        width (`int`): the feed's widest row.
        depth (`int`): the round's levels.
    """
    return min((b for b in FEED_BUCKETS if b >= max(width, min(depth + 1, FEED_BUCKETS[-1]))), default=None)


def nodes_kept(total: int, candidates: int) -> int:
    """
    The nodes a captured round selects, best first (a tree of any smaller size is their prefix): ``total`` rounded up
    to a bucket of :data:`~hf_eagle3.core.target_cache.NODE_BUCKETS`, at most the candidates, so that ``"auto"``'s
    sizes share a few graphs.

    Args:
        total (`int`): the nodes the round keeps besides the root.
        candidates (`int`): the candidates its levels grow.
    """
    return min(min((b for b in NODE_BUCKETS if b >= total), default=total), candidates)


def draft_round(draft, cache, d2t, fed: torch.LongTensor, roots: torch.LongTensor, *, depth: int, top_k: int,
                nodes: int, ranking: bool, features=None, tokens=None, counts=None, hidden=None, logits=None,
                rescore=None, rescore_with=None):
    """
    One drafting round for every row: the feed (when given), ``depth`` levels of candidates, the ``nodes`` best.

    Args:
        draft (`Eagle3DraftModel`): the draft, bound to the target.
        cache (`Eagle3RowCache`): a static row cache whose buffers are taken (see ``take_buffers``).
        d2t (`Eagle3D2TLogitsProcessor`): maps draft ids to target ids.
        fed (`torch.LongTensor` [B]): positions each row's cache holds before the feed.
        roots (`torch.LongTensor` [B]): each row's last token.
        depth (`int`): levels of the trees (>= 1).
        top_k (`int`): children per expanded node and frontier width (at most the draft vocabulary).
        nodes (`int`): nodes to select per row besides the root (at most the candidates).
        ranking (`bool`): also return :func:`~hf_eagle3.core.tree_candidates.candidate_ranking`.
        features (`torch.Tensor` [B, W, F*T], *optional*): the feed's target features, padded to a bucket's width.
        tokens (`torch.LongTensor` [B, W], *optional*): the token after each of them.
        counts (`torch.LongTensor` [B], *optional*): real entries per row.
        hidden (`torch.Tensor` [B, 1, H], *optional*): without a feed, the draft's output at each row's last
            position (from a feed run before).
        logits (`torch.Tensor` [B, draft_vocab], *optional*): its scores there.
        rescore (`Callable`, *optional*): ``rescore(candidates, rescore_with) -> candidates``, tensors only, applied
            before the selection (a benchmark's oracle gives the candidates scores of its own).
        rescore_with (*optional*): its argument.

    Returns:
        ``(planes, ranking)``: :func:`~hf_eagle3.core.tree_candidates.select_nodes`' planes, and the candidates'
        ranking (or ``None``).
    """
    capacity, window = cache.capacity, cache.window
    columns = torch.arange(capacity, device=fed.device)
    if features is not None:
        width = tokens.shape[1]
        real = torch.arange(width, device=fed.device)[None, :] < counts[:, None]
        at = torch.where(real, fed[:, None] + columns[:width], capacity - 1)  # padding: the trash column
        cache.place(at, causal_mask(at, capacity, window))
        out = draft(input_ids=tokens, target_features=features, position_ids=at, cache=cache, logits_to_keep=-1)
        last = (counts - 1).clamp(min=0)
        hidden = out.hidden_states.gather(1, last[:, None, None].expand(-1, 1, out.hidden_states.shape[-1]))
        logits = draft.compute_logits(hidden)[:, 0]
        fed = fed + counts
    rows = fed.shape[0]
    start = fed.max()  # the shared region's first column, on the device
    past = (columns[None, :] < fed[:, None])[:, None, :]  # [B, 1, capacity]: each row's own positions
    offset = columns - start  # [capacity]: column's place in the shared region

    def step(ids, frontier_hidden, level, ancestors):
        k = ids.shape[1]
        seen = past
        if window is not None:  # the positions this level's queries (at fed - 1 + level) still see
            seen = past & (columns[None, :] > fed[:, None] - 1 + level - window)[:, None, :]
        eye = torch.eye(k, dtype=torch.bool, device=fed.device).expand(rows, k, k)
        region = torch.cat([ancestors, eye], dim=-1)  # [B, k, level * k]: over the shared region's columns
        inside = (offset >= 0) & (offset < level * k)
        shared = region.gather(2, offset.clamp(0, level * k - 1)[None, None, :].expand(rows, k, capacity)) & inside
        at = (start + (level - 1) * k + columns[:k])[None, :].expand(rows, k)
        cache.place(at, (seen | shared)[:, None])
        return draft(input_ids=d2t.map_tokens(ids), hidden_states=frontier_hidden,
                     position_ids=(fed - 1 + level)[:, None].expand(rows, k), cache=cache)

    candidates = grow_candidates(logits, hidden, depth, top_k, step)
    if rescore is not None:
        candidates = rescore(candidates, rescore_with)
    planes = select_nodes(candidates, roots, nodes, d2t)
    return planes, candidate_ranking(candidates) if ranking else None
