"""Counting the operations that would block the host on a GPU, on any device.

On CUDA, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``), an output whose
size depends on values (``nonzero``, boolean indexing, ``masked_select``, ``unique``) and a copy to the CPU wait for
every queued kernel; so does the other direction, a tensor built from host values (``torch.tensor(list)``,
``torch.as_tensor``) and copied from pageable memory, which is counted wherever hf-eagle3 builds one outside
``hf_eagle3.core.transfers.to_device`` (its copy from pinned memory does not block). :class:`HostSyncCounter` patches those entry points on ``torch.Tensor`` and ``torch`` for the
duration of a ``with`` block and attributes each call to the first caller outside torch: hf-eagle3 (``"ours"``),
Transformers, or the code under test. Rounds are the target's forwards after its first (the prompt's) per
``generate`` call, counted with a forward hook.
"""

from __future__ import annotations

import collections
import os
import sys

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_OURS = os.sep + "hf_eagle3" + os.sep
_TRANSFORMERS = os.sep + "transformers" + os.sep

# (owner, name) of every patched entry point; the boolean-mask ones are counted only for a boolean index.
TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                  "masked_select", "unique")
TORCH_FUNCTIONS = ("nonzero", "masked_select", "unique", "equal", "argwhere")
HOST_DATA = ("tensor", "as_tensor")  # built from host values: a copy to the device (counted for hf-eagle3's calls)
NON_BLOCKING = "transfers.py:to_device"  # hf-eagle3's copy from pinned memory, which does not block


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter:
    """
    Count host-blocking tensor operations by caller while active; optionally count the rounds of a target.

    Args:
        target (`torch.nn.Module`, *optional*): the target whose forwards after the first of each ``generate`` call
            are rounds (call :meth:`new_call` between ``generate`` calls).
        draft (`torch.nn.Module`, *optional*): the draft, whose forwards are watched for syncs of their own.

    Attributes:
        counts (`collections.Counter`): ``{(caller, operation): calls}`` with caller ``"ours"``, ``"transformers"`` or
            ``"other"``.
        places (`collections.Counter`): ``{(caller, "file.py:function", operation): calls}``.
        in_draft (`collections.Counter`): ``{("file.py:function", operation): calls}`` made inside a forward of
            ``draft`` (a draft step).
        rounds (`int`): target forwards after the first of each call.
    """

    def __init__(self, target=None, draft=None):
        self.target, self.draft, self.counts, self.rounds = target, draft, collections.Counter(), 0
        self.places, self.in_draft = collections.Counter(), collections.Counter()
        self._forwards_this_call, self._saved, self._hooks, self._depth, self._in_draft = 0, [], [], 0, False

    def caller(self) -> tuple[str, str]:
        """Who called into torch, and where: the first frame outside torch (and outside this file), as
        ``("ours" | "transformers" | "other", "file.py:function")``."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith(_TORCH_DIR) and name != __file__:
                who = "ours" if _OURS in name else "transformers" if _TRANSFORMERS in name else "other"
                return who, f"{os.path.basename(name)}:{frame.f_code.co_name}"
            frame = frame.f_back
        return "other", "?"

    def _wrap(self, owner, name, original, bool_index_only=False, host_data_only=False):
        counter = self

        def wrapper(*args, **kwargs):
            if counter._depth == 0 and (not bool_index_only or _is_bool_index(args[1])) and (
                    not host_data_only or not isinstance(args[0], torch.Tensor)):
                who, where = counter.caller()
                if host_data_only and (who != "ours" or where == NON_BLOCKING):
                    counter._depth += 1
                    try:
                        return original(*args, **kwargs)
                    finally:
                        counter._depth -= 1
                counter.counts[(who, name)] += 1
                counter.places[(who, where, name)] += 1
                if counter._in_draft:
                    counter.in_draft[(where, name)] += 1
            counter._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth -= 1

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def new_call(self):
        """Start counting the rounds of a new ``generate`` call (its first forward is the prompt's)."""
        self._forwards_this_call = 0

    def ours_per_round(self) -> float:
        """hf-eagle3's host syncs per round."""
        return sum(n for (who, _), n in self.counts.items() if who == "ours") / max(1, self.rounds)

    def per_round(self, who: str | None = None) -> float:
        """Host syncs per round of one caller (``None``: all callers but the test's own code)."""
        total = sum(n for (c, _), n in self.counts.items() if (c == who if who else c != "other"))
        return total / max(1, self.rounds)

    def __enter__(self):
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name, getattr(torch.Tensor, name))
        for name in TORCH_FUNCTIONS:
            self._wrap(torch, name, getattr(torch, name))
        for name in HOST_DATA:
            self._wrap(torch, name, getattr(torch, name), host_data_only=True)
        self._wrap(torch.Tensor, "__getitem__", torch.Tensor.__getitem__, bool_index_only=True)
        self._wrap(torch.Tensor, "__setitem__", torch.Tensor.__setitem__, bool_index_only=True)
        if self.target is not None:
            def count(module, args, output):
                self._forwards_this_call += 1
                if self._forwards_this_call > 1:
                    self.rounds += 1

            self._hooks.append(self.target.register_forward_hook(count))
        if self.draft is not None:
            def enter(module, args):
                self._in_draft = True

            def leave(module, args, output):
                self._in_draft = False

            self._hooks += [self.draft.register_forward_pre_hook(enter), self.draft.register_forward_hook(leave)]
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False
