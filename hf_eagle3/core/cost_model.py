"""What a decoding round costs on the machine at hand: the forwards a round is made of, as :class:`Eagle3Costs`, kept
in a :class:`CostTable` per (device, dtype, target, draft, batch bucket, loop) and persisted in the user's cache
directory, so that no ``generate`` call times anything beyond its own rounds.

A round that drafts ``k`` tokens costs one draft forward over the positions the target verified since the draft last
ran (the "feed", which also proposes the first token), ``k - 1`` further draft steps and a target forward over
``k + 1`` tokens. A round that drafts nothing is a plain target step (the feed is deferred to the next round that
drafts). The table's entries come from two places: :func:`calibrate` times every forward ahead of time, at two
context lengths (``hf-eagle3 calibrate``), and a call that lacks a cost learns it once from its own rounds
(:meth:`Eagle3Costs.learn`) and writes it back when it ends. Costs at a context length
between or beyond those stored are interpolated linearly in the context length. What decides from these costs how
much to draft is :mod:`hf_eagle3.core.budget`.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .draft_cache import static_capacity
from .draft_steps import chain_step
from .target_cache import tree_attention_mask

# Target forward sizes (new tokens) :func:`calibrate` times: every chain length up to 8 drafted tokens (on a CPU in
# float32 the cost of n tokens is not even monotonic in n, as MKL picks its kernels by shape), then the tree sizes.
TARGET_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 32, 64)
FEED_SIZES = (1, 4, 16)  # draft feed sizes :func:`calibrate` times
CALIBRATION_CONTEXTS = (128, 1024)  # cache lengths :func:`calibrate` times at: two points of a line per size
CONTEXT_TOKENS = 128  # the shortest context bucket a call's learnt costs are stored under (see `context_length`)
# A cost not in the table is learnt from the call's rounds: the first timing of a size is set aside (one-time costs),
# the next SAMPLES are kept and the fastest of them becomes the cost (a stall slows a round, never speeds it up). Then
# the cost is fixed, as a calibrated one is: decisions compare costs measured close together in time, so a machine
# that slows down or speeds up as a whole does not flip them.
SAMPLES = 2


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
            end.synchronize()  # passed already: no wait
            return start.elapsed_time(end) / 1000.0
        return end - start


def interpolate(table: dict, n: float) -> float:
    """
    Linear interpolation in ``table`` (``{size: seconds}``), linear extrapolation beyond its largest size.

    Args:
        table (`dict[int, float]`): measured values at a few sizes (empty: 0).
        n (`float`): the size to estimate.
    """
    sizes = sorted(table)
    if not sizes:
        return 0.0
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
    Measured seconds of the forwards a decoding round is made of. A size not measured is interpolated linearly
    between the sizes that are (extrapolated beyond them); a cost not measured at all counts as nothing, so a round
    that needs it is tried, and timed, once.

    Args:
        target (`dict[int, float]`): a target forward of ``n`` new tokens, by ``n`` (empty: nothing measured yet).
        draft_feed (`dict[int, float]`): a draft forward over ``m`` verified positions (logits of the last only).
        draft_step (`float`, *optional*): one draft step (one position, its logits).
    """

    target: dict = field(default_factory=dict)
    draft_feed: dict = field(default_factory=dict)
    draft_step: float | None = None
    seen: dict = field(default_factory=dict, compare=False)  # (kind, size) -> timings of a cost being learnt
    last_plain: float | None = field(default=None, compare=False)  # the latest plain step's timing (relative learning)

    @property
    def ready(self) -> bool:
        """Whether a plain target step has been measured (every decision compares a round with one)."""
        return 1 in self.target

    def learn(self, nodes: int, verify_seconds: float, fed: int = 0, feed_seconds: float = 0.0, steps: int = 0,
              step_seconds: float = 0.0, relative: bool = False) -> None:
        """
        Learn the costs this round measured and the costs do not know yet (a known cost is fixed: see
        :data:`SAMPLES`). A target forward of ``n`` tokens is counted at most ``n`` plain steps (``n`` one-token
        forwards do its work). ``relative``: a forward of several tokens is learnt as a multiple of the plain step
        timed just before it (rounds that take turns), so a machine slower for a while slows both alike.

        Args:
            nodes (`int`): tokens per row the round's target forward verified (the root included).
            verify_seconds (`float`): its time.
            fed (`int`): positions the draft's feed consumed (0: no feed this round).
            feed_seconds (`float`): the feed's time.
            steps (`int`): further draft forwards (levels) after the feed.
            step_seconds (`float`): their time together.
            relative (`bool`): learn a forward of several tokens relative to the latest plain step.
        """
        if nodes == 1:
            self.last_plain = verify_seconds
            if 1 in self.target:  # known: counted only, so that plain steps take their turns while others learn
                self.seen.setdefault(("target", 1), []).append(verify_seconds)
        if relative and nodes > 1:
            if self.last_plain is not None and nodes not in self.target:
                self._learn(self.target, "target", nodes, min(verify_seconds / self.last_plain, nodes),
                            scale=self.target.get(1))
        else:
            if nodes > 1 and 1 in self.target:
                verify_seconds = min(verify_seconds, nodes * self.target[1])
            self._learn(self.target, "target", nodes, verify_seconds)
        if fed > 0:
            self._learn(self.draft_feed, "feed", fed, feed_seconds)
        if steps > 0 and self.draft_step is None:
            step = {}
            self._learn(step, "step", 1, step_seconds / steps)
            self.draft_step = step.get(1)

    def _learn(self, table: dict, kind: str, size: int, seconds: float, scale: float | None = 1.0) -> None:
        """One timing of ``size`` into ``table`` (see :meth:`learn`); ``scale``: what a timing is a multiple of
        (``None``: not known yet, the cost waits for it)."""
        if size in table:
            return
        timings = self.seen.setdefault((kind, size), [])
        timings.append(seconds)
        if len(timings) > SAMPLES and scale is not None:
            table[size] = min(timings[1:]) * scale

    def observations(self, nodes: int, known: bool = True) -> int:
        """Timings of a target forward of ``nodes`` tokens this call has made while learning its cost.

        Args:
            nodes (`int`): tokens of the forward.
            known (`bool`): count a known cost as learnt (``SAMPLES + 1``) rather than by this call's timings.
        """
        if known and nodes in self.target:
            return SAMPLES + 1
        return len(self.seen.get(("target", nodes), ()))

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
        return self.feed_seconds(feed) + (k - 1) * (self.draft_step or 0.0) + self.target_seconds(k + 1)

    def to_dict(self) -> dict:
        """The costs in milliseconds, JSON-friendly, with the ratios to a one-token target forward."""
        one = self.target_seconds(1) or 1.0
        step = self.draft_step or 0.0
        return {
            "target_ms": {str(n): 1000 * s for n, s in sorted(self.target.items())},
            "target_ratio": {str(n): s / one for n, s in sorted(self.target.items())},
            "draft_feed_ms": {str(m): 1000 * s for m, s in sorted(self.draft_feed.items())},
            "draft_step_ms": 1000 * step,
            "draft_step_ratio": step / one,
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


@torch.no_grad()
def measure_round_costs(target, draft, input_ids: torch.LongTensor, masked: bool = False, sizes=TARGET_SIZES,
                        capacity: int | None = None) -> Eagle3Costs:
    """
    Time every forward a round is made of on the context of ``input_ids`` (the target's with
    :func:`measure_target_seconds`, the draft's with :func:`measure_draft_seconds`); nothing of a live call is
    touched. :func:`calibrate` and the oracle bench's bound use it; ``generate`` never does.

    Args:
        target (`PreTrainedModel`): the target.
        draft (`Eagle3DraftModel`): the draft.
        input_ids (`torch.LongTensor` [B, L]): the context (its batch size is the one timed).
        masked (`bool`): time the target's forwards with the package loop's 4D mask (see
            :func:`measure_target_seconds`).
        sizes (`tuple[int]`): target forward sizes.
        capacity (`int`, *optional*): the draft cache's columns for static steps (see :func:`measure_draft_seconds`).
    """
    device = next(target.parameters()).device
    target_seconds = measure_target_seconds(target, input_ids.to(device), sizes, masked=masked)
    capacity = static_capacity(max(input_ids.shape[1] + max(FEED_SIZES) + 1, capacity or 0)) \
        if draft.static_steps() else None
    feed, step = measure_draft_seconds(draft, batch_size=input_ids.shape[0], context=input_ids.shape[1],
                                       capacity=capacity)
    return Eagle3Costs(target=target_seconds, draft_feed=feed, draft_step=step)


# ------------------------------------------------------------------------------------------------------- the table
def context_length(length: int) -> int:
    """
    The context bucket a call whose prompt has ``length`` tokens stores its learnt costs under: the next power of two
    at or above it, at least :data:`CONTEXT_TOKENS`.

    Args:
        length (`int`): tokens of the call's prompt (padding included).
    """
    return max(CONTEXT_TOKENS, 1 << (max(1, int(length)) - 1).bit_length())


def batch_bucket(rows: int) -> int:
    """The batch size a call of ``rows`` rows is priced at: the next power of two at or above it.

    Args:
        rows (`int`): the call's rows.
    """
    return 1 << (max(1, int(rows)) - 1).bit_length()


def _device_name(device: torch.device) -> str:
    """The device as costs depend on it: the GPU's name, or the CPU's model and torch's thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{device.type}:{model}:{torch.get_num_threads()}t"


def _model_shape(model) -> str:
    """What a model's forward cost depends on (not its weights): its type, sizes and parameter count."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    sizes = [getattr(config, name, None) for name in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                      "num_attention_heads", "num_key_value_heads", "vocab_size")]
    params = sum(p.numel() for p in model.parameters())
    return f"{getattr(config, 'model_type', type(model).__name__)}{sizes}{params}"


def cost_key(target, draft, rows: int, masked: bool, target_forward: str = "eager") -> str:
    """
    The key of a call's costs in the :class:`CostTable`: device, dtype, the target's and the draft's shapes (their
    forwards' cost does not depend on their weights), how the draft's step runs (eager or compiled), the batch
    bucket, the loop (the package's, whose target forwards carry a 4D mask, or Transformers') and how the target's
    forwards run.

    Args:
        target (`PreTrainedModel`): the target.
        draft (`Eagle3DraftModel`): the draft.
        rows (`int`): the call's rows.
        masked (`bool`): the package's loop.
        target_forward (`str`): ``"eager"`` (a dynamic cache), ``"static"`` (a static cache, eager forwards) or
            ``"compiled"`` (a static cache, Transformers' compiled forward).
    """
    param = next(target.parameters())
    cache = _KEYS.setdefault(draft, {})
    compiled = draft.generation_config.compile_config is not None if hasattr(
        draft.generation_config, "compile_config") else False
    local = (id(target), str(param.device), str(param.dtype), str(draft.fc.weight.dtype), compiled)
    if local not in cache:  # the shapes cost a pass over the parameters: once per target and draft
        cache[local] = (f"{_device_name(param.device)}|{param.dtype}|{_model_shape(target)}|{_model_shape(draft)}"
                        f"|{draft.fc.weight.dtype}|{'compiled' if compiled else 'eager'}")
    forward = "" if target_forward == "eager" else f"|{target_forward}"
    return f"{cache[local]}|rows{batch_bucket(rows)}|{'package' if masked else 'transformers'}{forward}"


_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # draft -> {(target, device, ...): key prefix}


def default_cache_path() -> Path:
    """Where the cost table is kept: ``$HF_EAGLE3_CACHE/costs.json``, else ``$XDG_CACHE_HOME/hf_eagle3/costs.json``,
    else ``~/.cache/hf_eagle3/costs.json``."""
    root = os.environ.get("HF_EAGLE3_CACHE")
    if root:
        return Path(root) / "costs.json"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_eagle3" / "costs.json"


class CostTable:
    r"""
    Measured round costs by :func:`cost_key` and context bucket, kept for the process and persisted as JSON.

    ``costs(key, context)`` gives a call its costs at its context length: per size, the values stored at the
    buckets around it, interpolated linearly in the context length (extrapolated beyond; the one stored where there
    is one). ``store`` puts a call's learnt costs back at its bucket. One table serves every thread of the process.

    Args:
        path (`str` or `Path`, *optional*): the JSON file (default :func:`default_cache_path`, read on first use);
            ``None`` keeps the table in memory only.
    """

    VERSION = 1

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.entries: dict = {}  # key -> {context: {"target": {n: s}, "feed": {m: s}, "step": s}}
        self._lock = threading.Lock()
        self._warned = False
        if self.path is not None and self.path.exists():
            self.load(self.path)

    def load(self, path: str | os.PathLike) -> "CostTable":
        """
        Merge a table written by :meth:`save` (a shipped or passed table: its entries replace those of the same
        key and bucket).

        Args:
            path (`str` or `Path`): the JSON file.

        Raises:
            ValueError: the file is not a cost table of this version (naming the file and the fix).
        """
        try:
            data = json.loads(Path(path).read_text())
            entries = data["entries"] if data.get("version") == self.VERSION else None
        except (OSError, ValueError, KeyError, AttributeError) as error:
            raise ValueError(f"{path} is not a readable hf-eagle3 cost table ({error}); delete it or run "
                             "`hf-eagle3 calibrate` to write a new one.") from None
        if entries is None:
            raise ValueError(f"{path} holds a cost table of another version; delete it or run "
                             "`hf-eagle3 calibrate` to write a new one.")
        with self._lock:
            for key, buckets in entries.items():
                mine = self.entries.setdefault(key, {})
                for context, costs in buckets.items():
                    mine[int(context)] = {"target": {int(n): s for n, s in costs["target"].items()},
                                          "feed": {int(m): s for m, s in costs["feed"].items()},
                                          "step": costs.get("step")}
        return self

    def save(self, path: str | os.PathLike | None = None) -> Path | None:
        """
        Write the table (atomically: a reader never sees half a file). A table that cannot be written warns once
        and stays in memory.

        Args:
            path (`str` or `Path`, *optional*): where (default: the table's own path; ``None`` there: nothing).
        """
        path = Path(path) if path is not None else self.path
        if path is None:
            return None
        with self._lock:
            data = {"version": self.VERSION, "entries": {
                key: {str(c): {"target": {str(n): s for n, s in sorted(v["target"].items())},
                               "feed": {str(m): s for m, s in sorted(v["feed"].items())}, "step": v["step"]}
                      for c, v in sorted(buckets.items())} for key, buckets in sorted(self.entries.items())}}
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(data, indent=1))
            os.replace(temporary, path)
        except OSError as error:
            if temporary.is_file():  # a half-written file is not left behind
                temporary.unlink()
            if not self._warned:
                warnings.warn(f"hf-eagle3 could not write its cost table to {path} ({error}); costs stay in memory "
                              "for this process. Set HF_EAGLE3_CACHE to a writable directory.", stacklevel=2)
                self._warned = True
            return None
        return path

    def reset(self, remove_file: bool = True) -> None:
        """
        Forget every cost (the next calls learn them again from their rounds, or :func:`calibrate` times them).

        Args:
            remove_file (`bool`): also delete the table's file.
        """
        with self._lock:
            self.entries.clear()
        if remove_file and self.path is not None and self.path.exists():
            self.path.unlink()

    def costs(self, key: str, context: int) -> Eagle3Costs:
        """
        The costs stored under ``key``, at a context of ``context`` tokens (a new object: the caller may learn on it).

        Args:
            key (`str`): see :func:`cost_key`.
            context (`int`): tokens in the cache.
        """
        with self._lock:
            buckets = self.entries.get(key, {})
            target = _across_contexts([(c, v["target"]) for c, v in buckets.items()], context)
            feed = _across_contexts([(c, v["feed"]) for c, v in buckets.items()], context)
            step = _across_contexts([(c, {1: v["step"]}) for c, v in buckets.items() if v["step"]], context)
        return Eagle3Costs(target=target, draft_feed=feed, draft_step=step.get(1))

    def store(self, key: str, context: int, costs: Eagle3Costs) -> None:
        """
        Keep ``costs`` under ``key`` at the bucket of ``context`` (:func:`context_length`), replacing the sizes they
        measure.

        Args:
            key (`str`): see :func:`cost_key`.
            context (`int`): tokens in the cache the costs were measured on.
            costs (`Eagle3Costs`): the costs.
        """
        with self._lock:
            entry = self.entries.setdefault(key, {}).setdefault(
                context_length(context), {"target": {}, "feed": {}, "step": None})
            entry["target"].update(costs.target)
            entry["feed"].update(costs.draft_feed)
            if costs.draft_step is not None:
                entry["step"] = costs.draft_step


def _across_contexts(tables: list, context: int) -> dict:
    """Per size, the value at ``context`` from ``[(context, {size: value})]``: linear in the context between the two
    nearest stored contexts (extrapolated beyond them, never below the smallest stored value)."""
    points: dict = {}
    for at, table in tables:
        for size, value in table.items():
            points.setdefault(size, {})[at] = value
    out = {}
    for size, by_context in points.items():
        out[size] = max(interpolate(by_context, context), min(by_context.values()))
    return out


_TABLE: list = []
_TABLE_LOCK = threading.Lock()


def cost_table() -> CostTable:
    """The process's :class:`CostTable`, read from :func:`default_cache_path` on first use."""
    with _TABLE_LOCK:
        if not _TABLE:
            try:
                _TABLE.append(CostTable(default_cache_path()))
            except ValueError as error:  # an unreadable file: warn, start empty, overwrite it on the next save
                warnings.warn(str(error), stacklevel=2)
                table = CostTable(None)
                table.path = default_cache_path()
                _TABLE.append(table)
        return _TABLE[0]


def calibrate(target, draft, batch_sizes=(1,), contexts=CALIBRATION_CONTEXTS, loops=("transformers", "package"),
              save: bool = True, progress=None) -> dict:
    """
    Time every forward a round is made of, ahead of time, and keep the costs in the process's :class:`CostTable`
    (persisted unless ``save=False``): then no call of this target and draft (on this device, in this dtype, at these
    batch buckets) starts without its costs. Calls also learn them from their own rounds; calibrating spares the
    first calls that and covers sizes they never try.

    Args:
        target (`PreTrainedModel`): the target, on its device and in its dtype.
        draft (`Eagle3DraftModel`): the draft, likewise.
        batch_sizes (`tuple[int]`): rows to calibrate for (one entry per :func:`batch_bucket`).
        contexts (`tuple[int]`): cache lengths to time at (costs at other lengths are interpolated between them).
        loops (`tuple[str]`): ``"transformers"`` (batch-1 chains) and/or ``"package"`` (trees and batches, whose
            target forwards carry a 4D mask).
        save (`bool`): write the table to its file.
        progress (`Callable[[str], None]`, *optional*): called with a line per entry timed.

    Returns:
        `dict`: ``{key: {context: Eagle3Costs.to_dict()}}`` of what was timed.
    """
    table, out = cost_table(), {}
    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = min(getattr(target.config, "vocab_size", None) or draft.config.vocab_size, draft.config.vocab_size)
    for rows in batch_sizes:
        for loop in loops:
            masked = loop == "package"
            if not masked and rows > 1:
                continue  # Transformers' loop runs batch-1 chains only
            key = cost_key(target, draft, rows, masked)
            for context in contexts:
                ids = torch.randint(0, vocab, (batch_bucket(rows), int(context)), generator=generator).to(device)
                costs = measure_round_costs(target, draft, ids, masked=masked)
                table.store(key, int(context), costs)
                out.setdefault(key, {})[int(context)] = costs.to_dict()
                if progress is not None:
                    progress(f"rows {batch_bucket(rows)}, {loop} loop, context {context}: one-token step "
                             f"{1000 * costs.target_seconds(1):.1f} ms, 8 tokens {1000 * costs.target_seconds(8):.1f} ms")
    if save:
        table.save()
    return out
