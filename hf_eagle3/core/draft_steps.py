"""The draft forwards a drafting round repeats, one function per kind: a chain's next token, a tree's next level
(every row of the batch in one forward).

Each is ``step(draft, **forward_kwargs)`` and runs the draft; the drafters call them through
:meth:`~hf_eagle3.core.modeling_eagle3.Eagle3DraftModel.step_call`, which compiles them when the draft's generation
config has a ``compile_config``. They are separate functions so that each kind keeps its own compiled graphs (dynamo
counts recompilations per function): the two differ in masks, shapes and the cache they write.
"""

from __future__ import annotations

import torch


def chain_step(draft, **kwargs):
    """One chain step: the next token's draft forward (one position per row, causal over the draft's cache).

    Args:
        draft (`Eagle3DraftModel`): the draft.
        kwargs: :meth:`Eagle3DraftModel.forward`'s arguments.
    """
    return draft(**kwargs)


def batch_tree_level(draft, **kwargs):
    """One tree level: every row's frontier in one forward over the row cache (which holds the mask).

    Args:
        draft (`Eagle3DraftModel`): the draft.
        kwargs: :meth:`Eagle3DraftModel.forward`'s arguments.
    """
    return draft(**kwargs)


def standard_strides(x: torch.Tensor) -> torch.Tensor:
    """
    ``x`` with the strides of a fresh contiguous tensor of its shape (copied only when they differ). A step's input
    may be a slice or an expanded view whose strides differ from one step to the next (``contiguous`` keeps the
    strides of size-1 dimensions), and static compiled steps guard on strides.

    Args:
        x (`torch.Tensor`): a step's input.
    """
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.append(step)
        step *= size
    if x.stride() == tuple(reversed(strides)):
        return x
    return x.clone(memory_format=torch.contiguous_format)
