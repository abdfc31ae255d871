"""What the draft knows of the verified sequence during a batch-1 chain ``generate`` call (the package's own loop keeps
its rows in :class:`~hf_eagle3.core.batch_drafter.Eagle3BatchTreeDrafter`).

The draft consumes the target's features of every verified position, paired with the token that follows it. After
each target forward the verified part of its features is taken from the capture (:meth:`Eagle3DraftState.collect`)
and kept pending; the next round that drafts first feeds the pending positions to the draft
(:meth:`Eagle3DraftState.feed`), after dropping the draft's speculative cache entries of the previous round. Rounds
that draft nothing leave the positions pending, so one later feed covers them all.
"""

from __future__ import annotations

import torch

from .draft_cache import Eagle3KVCache


class Eagle3DraftState:
    r"""
    The draft's KV cache of one ``generate`` call, the count of verified positions fed to it, and the verified
    positions not fed yet.

    Args:
        draft (`Eagle3DraftModel`): the draft, bound to the target.
    """

    def __init__(self, draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.cache = Eagle3KVCache()
        self.fed = 0  # positions whose real (target) features are in the draft cache
        self._features = []  # pending verified features [1, f_i, 3T], in position order
        self._tokens = []  # the token that follows each pending position [f_i]

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
            features (`torch.Tensor` [1, f, 3T]): their target features, on the draft's device and in its dtype.
            tokens (`torch.LongTensor` [f]): the token that follows each of them.
        """
        self._features.append(features)
        self._tokens.append(tokens.view(-1))

    def pending(self) -> tuple[torch.Tensor, torch.LongTensor]:
        """The pending positions, in order: ``(features [1, f, 3T], tokens [f])`` (at least one must be pending)."""
        features = self._features[0] if len(self._features) == 1 else torch.cat(self._features, dim=1)
        tokens = self._tokens[0] if len(self._tokens) == 1 else torch.cat(self._tokens)
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
        out = self.draft(
            input_ids=tokens.view(1, f).to(self.device),
            target_features=features,
            position_ids=torch.arange(self.fed, self.fed + f, device=self.device)[None],
            cache=self.cache,
            logits_to_keep=1,
        )
        self.fed += f
        return out

    def crop(self) -> None:
        """Drop the draft's speculative cache entries (those past the fed verified positions)."""
        self.cache.crop(self.fed)
