"""What one ``generate`` call leaves to the next call of the same draft: :class:`DraftingMemory`, the one object the draft
holds across calls (``draft.drafting_memory``; written by the call's budget, :mod:`hf_eagle3.core.budget`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftingMemory:
    """What a call leaves to the next call of the same draft: declared on the draft as ``draft.drafting_memory``
    (:meth:`reset` forgets it). The costs are not here: they belong to the machine, in the
    :class:`~hf_eagle3.core.cost_model.CostTable`.

    Args:
        chain (`dict`, *optional*): the ``"auto"`` chain policy's carried state
            (:meth:`~hf_eagle3.core.draft_length_policy.Eagle3DraftLengthPolicy.carried`).
        trees (`dict`): the ``tree_total_tokens="auto"`` chooser's carried state, by cost key (device, dtype, batch
            bucket, ...).
        rows_spread (`float`, *optional*): how far a batched call's rows differed
            (:class:`~hf_eagle3.core.batch_tail.RowEstimate`), the next batched call's prior.
    """

    chain: dict | None = None
    trees: dict = field(default_factory=dict)
    rows_spread: float | None = None

    def reset(self) -> None:
        """Forget what earlier calls learnt (the next call starts from the priors)."""
        self.chain, self.trees, self.rows_spread = None, {}, None
