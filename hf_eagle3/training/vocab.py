"""Draft vocabulary: the most frequent response tokens, and the ``d2t`` / ``t2d`` mappings of EAGLE-3."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch


def count_tokens(sequences: Iterable[Iterable[int]]) -> Counter:
    """Count token ids over ``sequences`` (e.g. the response ids of the training data)."""
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    return counts


def build_vocab_mapping(counts: Counter, draft_vocab_size: int, target_vocab_size: int):
    """Choose the draft vocabulary and build EAGLE-3's ``d2t`` / ``t2d``.

    The ``draft_vocab_size`` most frequent tokens are kept (ties broken by the smaller id; when fewer distinct tokens
    were seen, the smallest unseen ids fill the rest), sorted ascending, so that ``used[i]`` is the target id of draft
    id ``i``; ``d2t[i] = used[i] - i`` and ``t2d[j] = j in used``.

    Args:
        counts: token frequencies (target ids).
        draft_vocab_size: size of the draft vocabulary.
        target_vocab_size: size of the target vocabulary.

    Returns:
        ``(d2t, t2d)``: int64 ``[draft_vocab_size]`` offsets and bool ``[target_vocab_size]`` membership.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {target_vocab_size}], got {draft_vocab_size}")
    bad = [t for t in counts if not 0 <= t < target_vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the target vocabulary [0, {target_vocab_size})")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:draft_vocab_size]
    used = {t for t, _ in ranked}
    filler = (j for j in range(target_vocab_size) if j not in used)
    while len(used) < draft_vocab_size:
        used.add(next(filler))
    used_ids = torch.tensor(sorted(used), dtype=torch.long)
    d2t = used_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used_ids] = True
    check_vocab_mapping(d2t, t2d)
    return d2t, t2d


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``d2t`` and ``t2d`` describe the same sorted, injective mapping."""
    vd, v = d2t.shape[0], t2d.shape[0]
    target = torch.arange(vd) + d2t.cpu()
    if target.min() < 0 or target.max() >= v:
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    if not bool((target[1:] > target[:-1]).all()):
        raise ValueError("d2t must map draft ids to strictly increasing target ids")
    if int(t2d.sum()) != vd or not bool(t2d.cpu()[target].all()):
        raise ValueError("t2d does not mark exactly the target ids that d2t maps to")


def coverage(counts: Counter, d2t: torch.Tensor) -> float:
    """Fraction of the counted tokens that fall inside the draft vocabulary given by ``d2t``."""
    used = set((torch.arange(d2t.shape[0]) + d2t).tolist())
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t in used) / total if total else 0.0


def remap_draft_vocab(draft, d2t: torch.Tensor, t2d: torch.Tensor, target_lm_head: torch.Tensor) -> dict:
    """Give a trained draft a new vocabulary (e.g. one rebuilt from more data), keeping what it learnt.

    The output row of a token that both vocabularies hold is the draft's trained row. A token new to the draft starts
    from the target's own output row carried through the linear map that best takes the kept tokens' target rows to
    their trained rows (least squares; used when at least twice the hidden size of rows are kept, else the target's
    row as it is, as :func:`~hf_eagle3.training.trainer.init_draft` does). Training moves the draft's rows away from
    the target's (rare tokens down, the draft's hidden space turned), so raw target rows would outscore the trained
    ones: for the shipped SmolLM2 draft widened from 8,192 to 16,384 tokens, step-0 accuracy on 24 MT-bench answers
    was 0.436 with raw target rows and 0.558 with mapped ones (0.557 before widening), before any training. The draft
    vocabulary size may change.

    Args:
        draft (`Eagle3DraftModel`): the trained draft (modified in place: ``lm_head``, ``d2t``, ``t2d``, config).
        d2t (`torch.Tensor`): the new mapping's offsets ``[new_draft_vocab_size]``.
        t2d (`torch.Tensor`): the new membership ``[target_vocab_size]``.
        target_lm_head (`torch.Tensor`): the target's output embedding ``[target_vocab_size, H]``.

    Returns:
        ``{"kept": n, "new": m, "mapped": bool}``: rows carried over from the draft, rows made from the target's,
        and whether those went through the fitted map.
    """
    check_vocab_mapping(d2t, t2d)
    if t2d.shape[0] != draft.t2d.shape[0]:
        raise ValueError(f"the new mapping covers {t2d.shape[0]} target tokens, the draft's target has "
                         f"{draft.t2d.shape[0]}: build it for the same target")
    if getattr(draft, "lm_head", None) is None:
        raise ValueError("this draft has no lm_head of its own (it reads the target's): nothing to remap")
    old_used = (torch.arange(draft.d2t.shape[0]) + draft.d2t.cpu()).tolist()
    old_row = {t: i for i, t in enumerate(old_used)}
    new_used = (torch.arange(d2t.shape[0]) + d2t).tolist()
    old_weight = draft.lm_head.weight.detach()
    target_rows = target_lm_head.detach().float().cpu()
    both = [t for t in new_used if t in old_row]
    mapped = len(both) >= 2 * old_weight.shape[1]
    if mapped:  # target rows -> trained rows, fitted on the tokens both vocabularies hold
        fit = torch.linalg.lstsq(target_rows[both], old_weight[[old_row[t] for t in both]].float().cpu()).solution
    rows = []
    for t in new_used:
        if t in old_row:
            rows.append(old_weight[old_row[t]].cpu())
        else:
            rows.append((target_rows[t] @ fit if mapped else target_rows[t]).to(old_weight.dtype))
    kept = len(both)
    weight = torch.stack(rows).to(old_weight.device)
    with torch.no_grad():
        draft.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(old_weight.device,
                                                                                         old_weight.dtype)
        draft.lm_head.weight.copy_(weight)
        draft.d2t = d2t.to(draft.d2t.device)
        draft.t2d = t2d.to(draft.t2d.device)
    draft.config.draft_vocab_size = int(d2t.shape[0])
    return {"kept": kept, "new": len(new_used) - kept, "mapped": mapped}


def rebuild_draft_vocab(draft, counts: Counter, draft_vocab_size: int, target_vocab_size: int,
                        target_lm_head: torch.Tensor) -> str:
    """Rebuild a trained draft's vocabulary: the ``draft_vocab_size`` most frequent tokens of ``counts``
    (:func:`build_vocab_mapping`), keeping the trained rows of the tokens it already had (:func:`remap_draft_vocab`).

    Args:
        draft: the trained draft (changed in place).
        counts: response token frequencies (target ids).
        draft_vocab_size: size of the new draft vocabulary.
        target_vocab_size: size of the target vocabulary.
        target_lm_head: the target's ``lm_head`` weight ``[V, H]`` (rows of the new tokens).

    Returns:
        One line saying how the coverage of ``counts`` changed and where the rows came from.
    """
    before = coverage(counts, draft.d2t.cpu())
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size, target_vocab_size)
    rows = remap_draft_vocab(draft, d2t, t2d, target_lm_head)
    return (f"draft vocab rebuilt from {sum(counts.values())} response tokens: covers {before:.4f} -> "
            f"{coverage(counts, d2t):.4f} of them; {rows['kept']} rows kept, {rows['new']} from the target's"
            + (" (through the map fitted on the kept rows)" if rows["mapped"] else ""))
