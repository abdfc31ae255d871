"""What the draft knows of the verified sequence during a batch-1 chain ``generate`` call (the package's own loop keeps
its rows in :class:`~hf_eagle3.core.drafter.Eagle3Drafter`).

The draft consumes the target's features of every verified position, paired with the token that follows it. After
each target forward the verified part of its features is taken from the capture (:meth:`Eagle3DraftState.collect`)
and kept pending; the next round that drafts first feeds the pending positions to the draft
(:meth:`Eagle3DraftState.feed`), after dropping the draft's speculative cache entries of the previous round. Rounds
that draft nothing leave the positions pending, so one later feed covers them all.
"""

from __future__ import annotations

import torch

from .draft_cache import Eagle3KVCache, Eagle3RowCache, causal_mask, static_capacity
from .draft_steps import standard_strides


class Eagle3DraftState:
    r"""
    The draft's KV cache of one ``generate`` call, the count of verified positions fed to it, and the verified
    positions not fed yet.

    The cache is an :class:`~hf_eagle3.core.draft_cache.Eagle3KVCache` that grows, or, when the draft's steps are
    static (:meth:`~hf_eagle3.core.modeling_eagle3.Eagle3DraftModel.static_steps`), a static
    :class:`~hf_eagle3.core.draft_cache.Eagle3RowCache` of ``capacity`` columns (rounded up to its size bucket).

    Args:
        draft (`Eagle3DraftModel`): the draft, bound to the target.
        capacity (`int`, *optional*): the most positions the call holds (its ``max_length``; needed for static steps).
        rows (`int`): rows, all at the same positions (a ``generate`` call has one; the cost model times several).
    """

    def __init__(self, draft, capacity: int | None = None, rows: int = 1):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.rows = rows
        self.static = draft.static_steps()
        if self.static:
            if capacity is None:
                raise ValueError("Static drafting steps need the call's capacity (its max_length).")
            self.cache = Eagle3RowCache(rows, static_capacity(capacity), draft.config.draft_sliding_window,
                                        static_buffers=draft.static_kv_buffers)
        else:
            self.cache = Eagle3KVCache()
        self.fed = 0  # positions whose real (target) features are in the draft cache
        self._features = []  # pending verified features [rows, f_i, 3T], in position order
        self._tokens = []  # the token that follows each pending position [rows, f_i]

    @property
    def num_pending(self) -> int:
        """Verified positions not fed to the draft yet."""
        return sum(t.shape[-1] for t in self._tokens)

    def collect(self, capture, tokens: torch.LongTensor, end: int | None = None) -> None:
        """
        Take the verified part of the target's last forward from ``capture`` (which is cleared) and keep it pending.

        Args:
            capture (`Eagle3FeatureCapture`): the hooks on the target; holds the features of its last forward.
            tokens (`torch.LongTensor` [f]): the token that follows each verified position (the forward's first ``f``
                entries; ``f`` may be 0).
            end (`int`, *optional*): the position after the forward's last entry; when given, the forward must
                start where the draft's known positions end (a check that no target forward escaped the bookkeeping).

        Raises:
            RuntimeError: when the forward does not start where the known positions end.
        """
        features = capture.features(self.device, self.dtype)
        if features is None:
            return
        capture.clear()
        start = None if end is None else end - features.shape[1]
        if start is not None and start != self.fed + self.num_pending:
            raise RuntimeError(
                f"EAGLE-3 feature bookkeeping lost track (target forward started at {start}, draft has "
                f"{self.fed + self.num_pending} positions). Was the target called outside generate during the call?"
            )
        f = tokens.shape[-1]
        if f == 0:
            return
        self.add(features[:, :f], tokens)

    def add(self, features: torch.Tensor, tokens: torch.LongTensor) -> None:
        """
        Keep verified positions pending, after those already pending.

        Args:
            features (`torch.Tensor` [rows, f, 3T]): their target features, on the draft's device and in its dtype.
            tokens (`torch.LongTensor` [rows, f], or [f] for one row): the token that follows each of them.
        """
        self._features.append(features)
        self._tokens.append(tokens.view(self.rows, -1))

    def pending(self) -> tuple[torch.Tensor, torch.LongTensor]:
        """The pending positions, in order: ``(features [rows, f, 3T], tokens [rows, f])`` (at least one must be
        pending)."""
        features = self._features[0] if len(self._features) == 1 else torch.cat(self._features, dim=1)
        tokens = self._tokens[0] if len(self._tokens) == 1 else torch.cat(self._tokens, dim=1)
        return features, tokens

    def feed(self):
        """
        Drop the draft's speculative cache entries, then run the draft over the pending verified positions.

        Returns:
            The draft's output (`Eagle3DraftOutput`, logits of the last position only).
        """
        features, tokens = self.pending()
        self._features, self._tokens = [], []
        self.crop()
        f = tokens.shape[-1]
        positions = torch.arange(self.fed, self.fed + f, device=self.device).expand(self.rows, f)
        if self.static:
            self.cache.place_causal(positions, self.fed + f)
        out = self.draft(
            input_ids=tokens.to(self.device),
            target_features=features,
            position_ids=positions,
            cache=self.cache,
            logits_to_keep=1,
        )
        self.fed += f
        return out

    def step(self, step, input_ids: torch.LongTensor, hidden_states: torch.Tensor, position: int):
        """
        One drafting step: the draft forward of the next token at ``position``, over the cache.

        Args:
            step (`Callable`): the step function as the rounds run it (``draft.step_call(chain_step)``).
            input_ids (`torch.LongTensor` [rows, 1]): the token (target vocabulary).
            hidden_states (`torch.Tensor` [rows, 1, H]): the previous forward's output at the position before.
            position (`int`): the token's position (the cache holds every position before it).

        Returns:
            The draft's output (`Eagle3DraftOutput`, logits of that position).
        """
        positions = torch.full((self.rows, 1), position, device=self.device)
        if self.static:  # over the full capacity: columns 0 .. position (within the sliding window)
            self.cache.place_shared(position, causal_mask(positions, self.cache.capacity, self.cache.window))
        # the first step's input is a slice of the feed's output, with other strides than the later steps'
        return step(self.draft, input_ids=input_ids, hidden_states=standard_strides(hidden_states),
                    position_ids=positions, cache=self.cache, logits_to_keep=1)

    def rewind(self, fed: int) -> None:
        """
        Forget the fed positions from ``fed`` on and every pending one (the cost model times feeds and steps again
        and again at the same place).

        Args:
            fed (`int`): positions to keep.
        """
        self.fed = min(self.fed, fed)
        self._features, self._tokens = [], []
        self.crop()

    def crop(self) -> None:
        """Drop the draft's speculative cache entries (those past the fed verified positions)."""
        self.cache.crop(self.fed)
