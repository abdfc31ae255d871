"""Logits processing for EAGLE-3 drafts: map draft-vocabulary scores onto the target vocabulary.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class Eagle3D2TLogitsProcessor(LogitsProcessor):
    r"""
    [`LogitsProcessor`] that maps scores over an EAGLE-3 draft's vocabulary to the target vocabulary, through the
    draft's ``d2t`` offsets (``target_id = draft_id + d2t[draft_id]``). Target tokens outside the draft vocabulary get
    ``-inf``, so a distribution built from the result gives them probability zero.

    Args:
        d2t (`torch.LongTensor` of shape `(draft_vocab_size,)`):
            Offsets from draft ids to target ids. The mapping is computed once, on ``d2t``'s device.
        target_vocab_size (`int`):
            Size of the target vocabulary (width of the returned scores).
    """

    def __init__(self, d2t: torch.LongTensor, target_vocab_size: int):
        self.target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        self.target_vocab_size = target_vocab_size
        self.identity = d2t.shape[0] == target_vocab_size and not bool(d2t.any())

    def map_tokens(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """
        Map draft-vocabulary token ids to target-vocabulary ids (no host synchronisation).

        Args:
            draft_ids (`torch.LongTensor` of any shape): ids in the draft vocabulary.
        """
        return draft_ids if self.identity else self.target_ids[draft_ids]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """
        Spread draft-vocabulary scores over the target vocabulary (``-inf`` outside the draft vocabulary).

        Args:
            input_ids (`torch.LongTensor`): the sequence so far (unused).
            scores (`torch.FloatTensor` of shape `(..., draft_vocab_size)`): draft scores.

        Return:
            `torch.FloatTensor` of shape `(..., target_vocab_size)`.
        """
        if self.identity:
            return scores
        out = scores.new_full(scores.shape[:-1] + (self.target_vocab_size,), float("-inf"))
        out[..., self.target_ids] = scores
        return out
