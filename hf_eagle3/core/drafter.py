"""The drafting of the package's loop: :class:`Eagle3Drafter` runs one draft forward per step for all the
rows at once (the feed of the verified positions, then each level of the trees), with ragged rows handled on the
device. Each row gets the tree it would get alone (the same candidates, the same selection); a batch of one is a
single sequence; chains are trees with one child per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_cache import Eagle3RowCache, static_capacity
from .draft_round import draft_round, feed_width, nodes_kept
from .draft_steps import batch_tree_level, standard_strides
from .logits_process import Eagle3D2TLogitsProcessor
from .transfers import to_device
from .tree_candidates import candidate_ranking, grow_candidates, select_trees, trees_from


def take_positions(values: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """
    Each row's entries at its own positions: ``values[b, index[b, j]]``.

    Args:
        values (`torch.Tensor` [B, L] or [B, L, C]): per-position values.
        index (`torch.LongTensor` [B, W]): positions to take, per row.

    Returns:
        `torch.Tensor` [B, W] or [B, W, C].
    """
    if values.dim() == 2:
        return values.gather(1, index)
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[-1]))


@dataclass
class DraftedRound:
    """What a drafting round hands to the verify.

    Args:
        trees (`list[DraftTree]`): one per row.
        levels (`int`): the levels expanded (the feed's forward counts as the first).
        ranking (`torch.DoubleTensor` [2, M] or `None`): the candidates' ranking, when asked for.
        fed_at (*optional*): the caller's mark after the feed (``None`` when the feed ran inside a captured round).
    """

    trees: list
    levels: int
    ranking: object = None
    fed_at: object = None


class Eagle3Drafter:
    r"""
    Drafts a tree (or a chain) for every row of a batch, with one draft forward per step for the whole batch.

    The verified positions of each row wait in :meth:`add` until the next :meth:`feed`, which runs them through the
    draft in one forward (rows right-padded to the longest feed; each row writes position ``p`` at column ``p`` of an
    :class:`~hf_eagle3.core.draft_cache.Eagle3RowCache`). :meth:`expand` then grows every row's candidates level by
    level (``top_k`` frontier nodes per row, one forward per level, a shared region of the cache after the longest
    row), and :meth:`select` keeps each row's best ``total`` candidates, closed under parents. Nothing in it reads a
    value back to the host. :meth:`draft_round` runs the three; when the draft's compile config asks for static steps
    it runs them as one captured region instead (:func:`~hf_eagle3.core.draft_round.draft_round`).

    Args:
        draft (`Eagle3DraftModel`): the draft, bound to the target.
        rows (`int`): batch size.
        capacity (`int`): draft cache columns to preallocate (the longest row's positions plus a round's tree).
    """

    def __init__(self, draft, rows: int, capacity: int):
        self.draft = draft
        self.step = draft.step_call(batch_tree_level)  # eager, or compiled (the draft's generation config)
        self.device, self.dtype = draft.fc.weight.device, draft.fc.weight.dtype
        self.window = draft.config.draft_sliding_window
        static = draft.static_steps()  # compiled with static shapes: one capacity per size bucket, pooled buffers
        # Static: one more column, the trash column of a captured round's padded feed.
        self.cache = Eagle3RowCache(rows, static_capacity(capacity + 1) if static else capacity, self.window,
                                    static_buffers=draft.static_kv_buffers if static else None)
        self.whole_round = draft.step_call(draft_round) if static else None  # each round one compiled region
        self.buckets = set()  # the captured rounds' shapes this call used (rows, feed width, depth, top-k, nodes, ranking)
        # A captured round's rescoring of its candidates: (rescore, argument(depth)) (see draft_round), or None.
        self.rescore = None
        self.d2t = Eagle3D2TLogitsProcessor(draft.d2t, draft.config.vocab_size)
        self.fed = [0] * rows  # positions of each row in the draft cache (host ints: known from the accepted counts)
        self._fed = torch.zeros(rows, dtype=torch.long, device=self.device)  # the same, on the device
        self._pending = []  # blocks (features [B, w, 3T], tokens [B, w], counts list[int]) not fed yet
        self._hidden = None  # [B, 1, H]: each row's output at its last fed position
        self._logits = None  # [B, draft_vocab]: the scores there

    @property
    def compiled(self) -> bool:
        """Whether the drafting runs compiled (the draft's compile config): its rounds may compile graphs."""
        return self.step is not batch_tree_level

    @property
    def rows(self) -> int:
        """Rows in the batch."""
        return len(self.fed)

    def num_pending(self, row: int) -> int:
        """Verified positions of ``row`` not fed to the draft yet.

        Args:
            row (`int`): the row.
        """
        return sum(counts[row] for _, _, counts in self._pending)

    def add(self, features: torch.Tensor, tokens: torch.LongTensor, counts: list) -> None:
        """
        Keep verified positions pending, after those already pending: row ``b``'s first ``counts[b]`` entries.

        Args:
            features (`torch.Tensor` [B, w, 3T]): their target features (any device and dtype).
            tokens (`torch.LongTensor` [B, w]): the token that follows each of them (target vocabulary).
            counts (`list[int]`): real entries per row (the rest is padding).
        """
        self._pending.append((features.to(device=self.device, dtype=self.dtype), tokens.to(self.device),
                              list(counts)))

    def _merged(self) -> tuple[torch.Tensor, torch.LongTensor, list]:
        """The pending blocks as one right-padded block ``(features [B, W, 3T], tokens [B, W], counts)``."""
        if len(self._pending) == 1:
            return self._pending[0]
        features = torch.cat([f for f, _, _ in self._pending], dim=1)
        tokens = torch.cat([t for _, t, _ in self._pending], dim=1)
        index, counts, offset = [[] for _ in range(self.rows)], [0] * self.rows, 0
        for _, block, block_counts in self._pending:
            for b, c in enumerate(block_counts):
                index[b] += range(offset, offset + c)
                counts[b] += c
            offset += block.shape[1]
        width = max(max(counts), 1)
        index = to_device([i + [0] * (width - len(i)) for i in index], self.device)
        return take_positions(features, index), take_positions(tokens, index), counts

    def feed(self) -> None:
        """
        Drop the previous round's speculative entries and run the draft over every row's pending positions in one
        forward; keep each row's output at its last one (the root of its next tree).
        """
        features, tokens, counts = self._merged()
        self._pending = []
        self._feed_block(features, tokens, counts)

    def _feed_block(self, features: torch.Tensor, tokens: torch.LongTensor, counts: list) -> None:
        """:meth:`feed` of one merged block."""
        rows, width = tokens.shape
        start = max(self.fed)
        self.cache.crop(start)
        columns = self._fed[:, None] + torch.arange(width, device=self.device)  # row b's j-th entry at fed[b] + j
        self.cache.place_causal(columns, start + width)
        out = self.draft(input_ids=tokens, target_features=features, position_ids=columns, cache=self.cache,
                         logits_to_keep=-1)
        counts_device = to_device(counts, self.device)
        last = (counts_device - 1).clamp(min=0)
        hidden = take_positions(out.hidden_states, last[:, None])
        self._hidden, self._logits = hidden, self.draft.compute_logits(hidden)[:, 0]
        self.fed = [f + c for f, c in zip(self.fed, counts)]
        self._fed = self._fed + counts_device

    def expand(self, depth: int, top_k: int):
        """
        Grow every row's candidates for ``depth`` levels (``depth - 1`` draft forwards of ``B x top_k`` tokens).

        Args:
            depth (`int`): levels of the trees (>= 1).
            top_k (`int`): children per expanded node, and frontier width (capped at the draft vocabulary).

        Returns:
            ``(scores [B, M], draft_ids [B, M], parents [B, M], depths [M], levels)``: see
            :func:`~hf_eagle3.core.tree_candidates.grow_candidates`.
        """
        device, rows = self.device, self.rows
        start = max(self.fed)
        self.cache.crop(start)
        columns = torch.arange(start, device=device)[None, :]
        past = (columns < self._fed[:, None])[:, None, :]  # [B, 1, start]: each row's own positions

        def step(ids, hidden, level, ancestors):
            k = ids.shape[1]
            seen = past
            if self.window is not None:  # the positions this level's queries (at fed - 1 + level) still see
                seen = past & (columns > self._fed[:, None] - 1 + level - self.window)[:, None, :]
            eye = torch.eye(k, dtype=torch.bool, device=device).expand(rows, k, k)
            mask = torch.cat([seen.expand(rows, k, start), ancestors, eye], dim=-1)
            self.cache.place_shared(start + (level - 1) * k, mask[:, None])
            return self.step(self.draft, input_ids=self.d2t.map_tokens(ids), hidden_states=standard_strides(hidden),
                             position_ids=(self._fed - 1 + level)[:, None].expand(rows, k), cache=self.cache)

        return grow_candidates(self._logits, self._hidden, depth, top_k, step)

    def select(self, candidates, roots: torch.LongTensor, total: int) -> list:
        """
        Keep each row's ``total`` best candidates (closed under parents) and build its tree around its root.

        Args:
            candidates: what :meth:`expand` returned.
            roots (`torch.LongTensor` [B]): each row's last token.
            total (`int`): nodes to keep per row besides the root (at most the number of candidates).

        Returns:
            `list[DraftTree]`: one per row, each of ``min(total, M) + 1`` nodes.
        """
        return select_trees(candidates, roots, total, self.d2t)

    def draft_round(self, roots: torch.LongTensor, depth: int, top_k: int, total: int, ranking: bool = False,
                    mark=None) -> DraftedRound:
        """
        A round's drafting: :meth:`feed`, :meth:`expand` and :meth:`select`, or, when the draft's compile config asks
        for static steps, the same as one captured region (the feed padded to a bucket's width; a feed wider than
        every bucket runs eagerly first). Both draft the same trees.

        Args:
            roots (`torch.LongTensor` [B]): each row's last token.
            depth (`int`): levels of the trees (>= 1).
            top_k (`int`): children per expanded node, and frontier width.
            total (`int`): nodes to keep per row besides the root.
            ranking (`bool`): also return the candidates' ranking (for ``tree_total_tokens="auto"``).
            mark (`Callable`, *optional*): called after an eager feed; its result is ``fed_at``.

        Returns:
            `DraftedRound`.
        """
        if self.whole_round is None:
            self.feed()
            fed_at = mark() if mark is not None else None
            candidates = self.expand(depth, top_k)
            return DraftedRound(self.select(candidates, roots, total), candidates[4],
                                candidate_ranking(candidates) if ranking else None, fed_at)
        return self._captured_round(roots, depth, top_k, total, ranking)

    @torch.no_grad()
    def _captured_round(self, roots, depth: int, top_k: int, total: int, ranking: bool) -> DraftedRound:
        """:meth:`draft_round` as one compiled region (see :mod:`~hf_eagle3.core.draft_round`), without autograd
        (its cache writes are in place)."""
        config = self.draft.config
        self.cache.take_buffers(config.num_key_value_heads, config.head_dim, self.dtype, self.device)
        k = min(top_k, config.draft_vocab_size)
        candidates = k + (depth - 1) * k * k
        longest = max(f + self.num_pending(b) for b, f in enumerate(self.fed))
        if longest + depth * k >= self.cache.capacity:  # the last column is the trash column; refused before any work
            raise RuntimeError(f"Static draft cache of {self.cache.capacity} columns cannot hold a round of {depth} "
                               f"levels of {k} after {longest} positions.")
        feed = {}
        if self._pending:
            features, tokens, counts = self._merged()
            self._pending = []
            width = feed_width(tokens.shape[1], depth)
            if width is None:  # wider than every bucket: fed eagerly, the region starts from its output
                self._feed_block(features, tokens, counts)
            else:
                pad = width - tokens.shape[1]
                counts_device = to_device(counts, self.device)
                feed = dict(features=torch.nn.functional.pad(features, (0, 0, 0, pad)),
                            tokens=torch.nn.functional.pad(tokens, (0, pad)), counts=counts_device)
                self.fed = [f + c for f, c in zip(self.fed, counts)]
        fed = self._fed
        if feed:
            self._fed = self._fed + feed["counts"]
        else:
            feed = dict(hidden=self._hidden, logits=self._logits)
        nodes = nodes_kept(total, candidates)
        self.buckets.add((self.rows, feed["tokens"].shape[1] if "tokens" in feed else 0, depth, k, nodes, ranking))
        if self.rescore is not None:
            feed.update(rescore=self.rescore[0], rescore_with=self.rescore[1](depth))
        planes, ranks = self.whole_round(self.draft, cache=self.cache, d2t=self.d2t, fed=fed, roots=roots,
                                         depth=depth, top_k=k, nodes=nodes, ranking=ranking, **feed)
        self._hidden = self._logits = None  # the next round feeds first
        start = max(self.fed)
        self.cache.length = start + depth * k
        n = min(total, candidates)
        return DraftedRound(trees_from(planes, n, min(n, depth)), depth, ranks)

    def keep_rows(self, keep: list) -> None:
        """
        Keep the given rows, in that order (finished rows leave the batch).

        Args:
            keep (`list[int]`): row indices.
        """
        index = to_device(keep, self.device)
        self.cache.keep_rows(index)
        self.fed, self._fed = [self.fed[i] for i in keep], self._fed[index]
        self._pending = [(f[index], t[index], [c[i] for i in keep]) for f, t, c in self._pending]
        if self._hidden is not None:
            self._hidden, self._logits = self._hidden[index], self._logits[index]


Eagle3BatchTreeDrafter = Eagle3Drafter  # its name before 0.2.0, kept for one release
