"""When a round's tokens end generation, decided on the host from the tokens the loop has already read back, so that
the stop check costs no device synchronisation for Transformers' default criteria (``max_length`` and EOS)."""

from __future__ import annotations

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria


class HostStopping:
    """
    Transformers' default stopping criteria, evaluated on host integers.

    Args:
        stopping_criteria (`StoppingCriteriaList`): the call's criteria; every one must be a `MaxLengthCriteria` or an
            `EosTokenCriteria` (see :meth:`of`).
    """

    def __init__(self, stopping_criteria):
        self.max_length, self.eos = None, set()
        for criterion in stopping_criteria:
            if isinstance(criterion, MaxLengthCriteria):
                length = criterion.max_length
                self.max_length = length if self.max_length is None else min(self.max_length, length)
            else:
                ids = criterion.eos_token_id
                self.eos |= set(ids.tolist() if isinstance(ids, torch.Tensor) else [ids])

    @classmethod
    def of(cls, stopping_criteria) -> HostStopping | None:
        """A :class:`HostStopping` for ``stopping_criteria``, or ``None`` when one of them is of another kind (stop
        strings, ``max_time``, a user's own): the loop then calls the criteria on the sequence."""
        if stopping_criteria is None or any(type(c) not in (MaxLengthCriteria, EosTokenCriteria)
                                            for c in stopping_criteria):
            return None
        return cls(stopping_criteria)

    def done(self, length: int, last_token: int) -> bool:
        """
        Whether a sequence stops.

        Args:
            length (`int`): the sequence's length, prompt included.
            last_token (`int`): its last token.
        """
        return (self.max_length is not None and length >= self.max_length) or last_token in self.eos
