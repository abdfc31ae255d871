"""What a decoding round costs on the machine at hand: the forwards a round is made of, timed once per target /
draft / device / dtype (:func:`measure_costs`) and kept as :class:`Eagle3Costs`.

A round that drafts ``k`` tokens costs one draft forward over the positions the target verified since the draft last
ran (the "feed", which also proposes the first token), ``k - 1`` further draft steps and a target forward over
``k + 1`` tokens. A round that drafts nothing is a plain target step (the feed is deferred to the next round that
drafts). The policy that decides from these costs how much to draft is :mod:`hf_eagle3.core.draft_length_policy`.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
import weakref
from dataclasses import dataclass

import torch

from .draft_cache import static_capacity
from .draft_steps import chain_step
from .target_cache import tree_attention_mask

TARGET_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # target forward sizes (new tokens) timed by :func:`measure_costs`
FEED_SIZES = (1, 4, 16)  # draft feed sizes timed by :func:`measure_costs`
CONTEXT_TOKENS = 128  # the shortest cache length the forwards are timed on (see `context_length`)


def synchronize(device) -> None:
    """
    Wait for the queued work of ``device`` (CUDA; nothing to wait for elsewhere), or of every device of a model: a
    target sharded over several GPUs (``device_map``) queues work on each. Used around timings only.

    Args:
        device (`torch.device`, `str` or `torch.nn.Module`): a device, or a model whose parameters' devices are
            all waited for.
    """
    devices = {p.device for p in device.parameters()} if isinstance(device, torch.nn.Module) else {device}
    for one in devices:
        if torch.device(one).type == "cuda":
            torch.cuda.synchronize(one)


class Stopwatch:
    r"""
    Marks on a device's timeline and the seconds between them, without blocking the host: CUDA events on a CUDA
    device (read once the round's read-back has passed them, so reading adds no synchronisation), the host clock
    elsewhere (a CPU runs the work as the host issues it).

    Args:
        device (`torch.device` or `str`): the device whose work is timed.
    """

    def __init__(self, device):
        self.events = torch.device(device).type == "cuda"

    def mark(self):
        """A mark at this point of the device's work (a recorded CUDA event, or the host clock)."""
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """
        Seconds from ``start`` to ``end``, two marks the device has passed (on CUDA: both recorded before a read-back
        that has returned).

        Args:
            start, end: marks from :meth:`mark`.
        """
        if self.events:
            return start.elapsed_time(end) / 1000.0
        return end - start


def interpolate(table: dict, n: float) -> float:
    """
    Linear interpolation in ``table`` (``{size: seconds}``), linear extrapolation beyond its largest size.

    Args:
        table (`dict[int, float]`): measured values at a few sizes.
        n (`float`): the size to estimate.
    """
    sizes = sorted(table)
    values = [table[s] for s in sizes]
    if n <= sizes[0] or len(sizes) == 1:
        return values[0]
    for (a, ta), (b, tb) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    (a, ta), (b, tb) = (sizes[-2], values[-2]), (sizes[-1], values[-1])
    return tb + (tb - ta) * (n - b) / (b - a)


@dataclass
class Eagle3Costs:
    """
    Measured seconds of the forwards a decoding round is made of.

    Args:
        target (`dict[int, float]`): a target forward of ``n`` new tokens, by ``n``.
        draft_feed (`dict[int, float]`): a draft forward over ``m`` verified positions (logits of the last only).
        draft_step (`float`): one draft step (one position, its logits).
    """

    target: dict
    draft_feed: dict
    draft_step: float

    def target_seconds(self, n: int) -> float:
        """
        Seconds of a target forward of ``n`` new tokens.

        Args:
            n (`int`): new tokens.
        """
        return interpolate(self.target, n)

    def feed_seconds(self, m: int) -> float:
        """
        Seconds of a draft forward over ``m`` verified positions.

        Args:
            m (`int`): positions fed.
        """
        return interpolate(self.draft_feed, max(1, m))

    def round_seconds(self, k: int, feed: int = 1) -> float:
        """
        Seconds of a round that drafts ``k`` tokens after feeding ``feed`` positions (``k = 0``: a plain target step).

        Args:
            k (`int`): tokens drafted.
            feed (`int`): verified positions the draft consumes first.
        """
        if k <= 0:
            return self.target_seconds(1)
        return self.feed_seconds(feed) + (k - 1) * self.draft_step + self.target_seconds(k + 1)

    def to_dict(self) -> dict:
        """The costs in milliseconds, JSON-friendly, with the ratios to a one-token target forward."""
        one = self.target_seconds(1)
        return {
            "target_ms": {str(n): 1000 * s for n, s in sorted(self.target.items())},
            "target_ratio": {str(n): s / one for n, s in sorted(self.target.items())},
            "draft_feed_ms": {str(m): 1000 * s for m, s in sorted(self.draft_feed.items())},
            "draft_step_ms": 1000 * self.draft_step,
            "draft_step_ratio": self.draft_step / one,
        }


# ------------------------------------------------------------------------------------------------------ measuring
def _time(fn, device, repeats: int) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs, after one warm-up run (``device``: as :func:`synchronize`
    takes it)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def measure_target_seconds(target, input_ids: torch.LongTensor, sizes=TARGET_SIZES, repeats: int = 3,
                           masked: bool = False) -> dict:
    """
    Time a target forward of ``n`` new tokens on top of the KV cache of ``input_ids``, for each ``n`` in ``sizes``.

    Each timed forward extends a copy of the same prefilled cache (any cache type works), so nothing of a live
    ``generate`` call is touched.

    Args:
        target (`PreTrainedModel`): the target.
        input_ids (`torch.LongTensor` [B, L]): the context the cache holds.
        sizes (`tuple[int]`): numbers of new tokens.
        repeats (`int`): sweeps over the sizes after a warm-up; the fastest time of each size is kept.
        masked (`bool`): give every forward a 4D attention mask (the cached context, then the new tokens' causal
            triangle), as every target forward of the package's loop has one
            (:mod:`~hf_eagle3.core.decoding_loop`). Without it the forwards run as Transformers' loop runs an
            unpadded row, where a one-token step carries no mask; attention kernels may run the two at different
            speeds (PyTorch's CPU attention in bfloat16 runs the unmasked one-token step slower).

    Returns:
        `dict[int, float]`: seconds per forward, by number of new tokens (never less than for the smallest size).
    """
    params = inspect.signature(target.forward).parameters
    cache_key = "cache" if "cache" in params else "past_key_values"
    keep = (lambda n: {"logits_to_keep": n}) if "logits_to_keep" in params else (lambda n: {})
    device = input_ids.device
    out = target(input_ids=input_ids, use_cache=True, **keep(1))
    prefilled = getattr(out, "cache", None) or out.past_key_values
    rows, context = input_ids.shape
    runs = {}
    for n in sizes:
        new = input_ids[:, -1:].repeat(1, n)
        positions = torch.arange(context, context + n, device=device)[None].expand(rows, -1)
        mask = {"attention_mask": _chain_mask(target, prefilled, n, rows)} if masked else {}

        def run(cache, new=new, positions=positions, n=n, mask=mask):
            target(input_ids=new, position_ids=positions, use_cache=True, **mask, **keep(n), **{cache_key: cache})

        run(copy.deepcopy(prefilled))  # warm-up
        runs[n] = run
    costs = {n: math.inf for n in sizes}
    for _ in range(repeats):  # sweeps over all sizes: a stall of the machine spoils one sweep, not one size
        for n, run in runs.items():
            cache = copy.deepcopy(prefilled)  # each forward extends the same context; the copy is not timed
            synchronize(target)  # every device a sharded target uses
            start = time.perf_counter()
            run(cache)
            synchronize(target)
            costs[n] = min(costs[n], time.perf_counter() - start)
    one = costs[min(sizes)]
    return {n: max(seconds, one) for n, seconds in costs.items()}  # more tokens never cost less than one


def _chain_mask(target, cache, n: int, rows: int):
    """The loop's 4D additive mask of a forward of ``n`` new tokens in a chain on ``cache``, for ``rows`` rows."""
    device = next(target.parameters()).device
    mask = tree_attention_mask(cache, torch.ones(n, n, dtype=torch.bool, device=device).tril(),
                               torch.arange(n, device=device), None, target.dtype)
    if isinstance(mask, dict):
        return {kind: one.expand(rows, -1, -1, -1) for kind, one in mask.items()}
    return mask.expand(rows, -1, -1, -1)


@torch.no_grad()
def measure_draft_seconds(draft, batch_size: int = 1, context: int = CONTEXT_TOKENS, feed_sizes=FEED_SIZES,
                          repeats: int = 3, capacity: int | None = None) -> tuple[dict, float]:
    """
    Time the draft's feed (a forward over ``m`` verified positions) and its one-token step, on random inputs, each with
    the token choice that follows it in a round (argmax, vocabulary mapping, appending to the sequence). The step runs
    as rounds run it: compiled when the draft's generation config has a ``compile_config``
    (:meth:`~hf_eagle3.core.modeling_eagle3.Eagle3DraftModel.step_call`).

    Args:
        draft (`Eagle3DraftModel`): the draft, on its device and in its dtype.
        batch_size (`int`): rows.
        context (`int`): positions already in the draft's cache.
        feed_sizes (`tuple[int]`): feed sizes to time.
        repeats (`int`): timed runs per size after a warm-up; the fastest is kept.
        capacity (`int`, *optional*): the columns the call's draft cache holds (static steps attend over all of
            them, so they are timed on a cache of the call's capacity; default: just what the timing writes).

    Returns:
        ``(feed_seconds_by_size, step_seconds)``.
    """
    from .draft_state import Eagle3DraftState

    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    width = draft.fc.weight.shape[1]
    generator = torch.Generator(device="cpu").manual_seed(0)

    def inputs(n):
        ids = torch.randint(0, draft.config.vocab_size, (batch_size, n), generator=generator).to(device)
        feats = torch.randn(batch_size, n, width, generator=generator).to(device=device, dtype=dtype)
        return ids, feats

    # the cache the rounds use (a static one for static steps), holding ``context`` positions
    state = Eagle3DraftState(draft, capacity=max(context + max(feed_sizes) + 1, capacity or 0), rows=batch_size)
    ids, feats = inputs(context)
    state.add(feats, ids)
    out = state.feed()

    sequence = torch.zeros(batch_size, context, dtype=torch.long, device=device)

    def pick(result):  # what a round does with each draft forward: best draft id, mapped, appended
        best = result.logits[:, -1].argmax(-1)
        return torch.cat([sequence, (best + draft.d2t[best])[:, None]], dim=-1)

    feed = {}
    for m in feed_sizes:
        ids, feats = inputs(m)

        def run():
            state.rewind(context)
            state.add(feats, ids)
            pick(state.feed())

        feed[m] = _time(run, device, repeats)
    hidden = out.hidden_states[:, -1:]
    token = ids[:, :1]
    forward = draft.step_call(chain_step)  # as rounds run it (compiled when the draft's generation config says so)

    def step():
        state.rewind(context)
        pick(state.step(forward, token, hidden, context))

    return feed, _time(step, device, repeats)


_TARGET_SECONDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {key: {n: seconds}}
_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {key: Eagle3Costs}


def context_length(length: int) -> int:
    """
    The cache length a call whose prompt has ``length`` tokens is timed on: the next power of two at or above it, at
    least :data:`CONTEXT_TOKENS`. Forwards cost more on a longer cache (attention reads every entry), so a long prompt's
    rounds are priced at its length; one measurement serves every prompt between half its length and its length.

    Args:
        length (`int`): tokens of the call's prompt (padding included).
    """
    return max(CONTEXT_TOKENS, 1 << (max(1, int(length)) - 1).bit_length())


def one_per_context_length(prompts: list, length=lambda ids: ids.shape[1]) -> list:
    """
    The first of ``prompts`` at each :func:`context_length`: calls on these measure every cost that calls on all of
    them use (how a benchmark warms up before it times).

    Args:
        prompts (`list`): prompts, e.g. `torch.LongTensor` [B, L] each.
        length (`Callable`): a prompt's length in tokens (default: ``ids.shape[1]``).
    """
    first = {}
    for prompt in prompts:
        first.setdefault(context_length(length(prompt)), prompt)
    return list(first.values())


def _context(input_ids: torch.LongTensor) -> torch.LongTensor:
    """``input_ids`` repeated or cut to :func:`context_length` of its length: the context its call is timed on."""
    length = context_length(input_ids.shape[1])
    context = input_ids[:, :length]
    if context.shape[1] < length:
        context = context.repeat(1, math.ceil(length / context.shape[1]))[:, :length]
    return context


def timing_key(target, input_ids: torch.LongTensor) -> tuple:
    """
    What a time measured for ``target`` on ``input_ids`` depends on, and is kept under: the device and dtype of the
    target's first parameter, the batch size and the :func:`context_length` timed at.

    Args:
        target (`PreTrainedModel`): the target.
        input_ids (`torch.LongTensor` [B, L]): the call's prompt.
    """
    param = next(target.parameters())
    return str(param.device), str(param.dtype), input_ids.shape[0], context_length(input_ids.shape[1])


def target_costs(target, input_ids: torch.LongTensor, sizes=TARGET_SIZES, refresh: bool = False,
                 masked: bool = False) -> dict:
    """
    Seconds of a target forward of ``n`` new tokens for each ``n`` in ``sizes``, on a cache of
    :func:`context_length` ``(L)`` entries: measured by :func:`measure_target_seconds` on the first use of each target /
    device / dtype / batch size / context length / sizes / masking, then kept for the process (chains and trees share
    it).

    Args:
        target (`PreTrainedModel`): the target.
        input_ids (`torch.LongTensor` [B, L]): the call's prompt, the context timed on (repeated or cut to its
            :func:`context_length`).
        sizes (`tuple[int]`): numbers of new tokens.
        refresh (`bool`): measure again even when known.
        masked (`bool`): time the forwards with the 4D attention mask the package's loop gives them (see
            :func:`measure_target_seconds`).
    """
    key = timing_key(target, input_ids) + (tuple(sizes), masked)
    known = _TARGET_SECONDS.setdefault(target, {})
    if key not in known or refresh:
        device = next(target.parameters()).device
        known[key] = measure_target_seconds(target, _context(input_ids).to(device), sizes, masked=masked)
    return known[key]


def measure_costs(target, draft, input_ids: torch.LongTensor, refresh: bool = False,
                  capacity: int | None = None, masked: bool = False) -> Eagle3Costs:
    """
    The round costs of ``target`` with ``draft``: measured on the first use of each target / draft / device / dtype /
    batch size / context length (and, for static drafting steps, draft cache capacity), then kept for the process (a
    dozen target forwards and a few draft forwards on a cache of :func:`context_length` entries).

    Args:
        target (`PreTrainedModel`): the target.
        draft (`Eagle3DraftModel`): the draft.
        input_ids (`torch.LongTensor` [B, L]): the call's prompt, the context timed on (repeated or cut to its
            :func:`context_length`).
        refresh (`bool`): measure again even when known.
        capacity (`int`, *optional*): the columns the call's draft cache holds. Static steps
            (:meth:`~hf_eagle3.core.modeling_eagle3.Eagle3DraftModel.static_steps`) attend over their cache's whole
            capacity (:func:`~hf_eagle3.core.draft_cache.static_capacity` of it), so they are timed on a cache of the
            call's capacity bucket, which also spares compiling (or capturing) a step for a bucket the call never uses.
        masked (`bool`): the target's forwards carry the 4D attention mask of the package's loop (see
            :func:`measure_target_seconds`); Transformers' loop (batch-1 chains) leaves it to the model.
    """
    context = context_length(input_ids.shape[1])
    static = static_capacity(max(context + max(FEED_SIZES) + 1, capacity or 0)) if draft.static_steps() else None
    key = timing_key(target, input_ids) + (
        str(draft.fc.weight.dtype), tuple(draft.fc.weight.shape),
        tuple(draft.lm_head.weight.shape) if hasattr(draft, "lm_head") else None,
        draft.step_call(chain_step),  # the step the rounds run: one object per compile config, or eager
        static,  # static steps: the capacity bucket they are timed at
        masked)
    known = _COSTS.setdefault(target, {})
    if key not in known or refresh:
        target_seconds = target_costs(target, input_ids, refresh=refresh, masked=masked)
        feed, step = measure_draft_seconds(draft, batch_size=input_ids.shape[0], context=context, capacity=static)
        known[key] = Eagle3Costs(target=target_seconds, draft_feed=feed, draft_step=step)
    return known[key]
