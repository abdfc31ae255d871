"""The decoding loop the package owns: trees at every batch size (one row included) and chains for batches, run in place
of Transformers' assisted-decoding loop (which takes one sequence and drafts chains). Batch-1 chains stay in
Transformers' loop (:class:`~hf_eagle3.core.candidate_generator.Eagle3CandidateGenerator`).

``target.generate(ids, assistant_model=draft, ...)`` reaches it through the ``generate`` hook
(:func:`~hf_eagle3.core.generate_hook.route_assisted_decoding`) with the arguments Transformers prepared (logits
processors, stopping criteria, streamer, cache). Each round is a straight line of named steps of :class:`_Loop`:
**draft** (the draft consumes every row's verified features in one forward, then drafts every row's chain or tree, one
forward per level: :class:`~hf_eagle3.core.drafter.Eagle3Drafter`), **verify** (one target forward of
every row's nodes), **accept** (the round's one read-back, then :func:`~hf_eagle3.core.acceptance.accept_row` per row),
**commit** (the target cache keeps each row's accepted path) and **retire** (finished rows leave the batch), then, for
``"auto"``, **observe**.

Rows accept different numbers of tokens, so the target's KV cache keeps a per-row validity mask: a round appends as
many entries as the row that accepted most, the other rows' surplus entries are holes that the attention mask hides,
and each row carries its own position ids. When holes make the cache much longer than the longest row, the rows are
compacted (each row's entries moved to the right end, as left padding is). A call of one row never has holes: its
cache keeps the accepted path with :func:`~hf_eagle3.core.target_cache.gather_cache`, which also rolls sliding-window
layers back past their window.

A chain is the tree with one child per node: the same steps draft ``num_assistant_tokens`` tokens per row with the
draft's most likely token at each step, and accept them with the same walk (greedy: the target's choice; sampling:
recursive rejection sampling, which keeps the target's distribution). See ``docs/trees.md`` and ``docs/batching.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .acceptance import accept_row, read_back, round_planes
from .drafter import Eagle3Drafter, take_positions
from .batch_tail import BatchRows
from .budget import RoundOutcome, RoundPlan, budget_for
from .cost_model import Stopwatch
from .feature_capture import Eagle3OutputFeatures
from .stats import Eagle3Stats, publish_stats
from .stopping import HostStopping
from .target_cache import (
    StaticPool,
    batch_tree_mask,
    compact,
    compaction_order,
    decoding_cache,
    gather_cache,
    gather_entries,
    in_order,
    is_static_cache,
    keep_rows,
    node_bucket,
    prefill,
    sliding_window,
    static_cache_for,
    static_tree_mask,
    tree_attention_mask,
)
from .transformers_compat import compiled_graphs, eos_token_ids, round_forward
from .tree_candidates import DraftTree
from .transfers import to_device

COMPACT_SLACK = 32  # compact the target cache when it is this many entries longer than twice the longest row
# Graphs torch may compile for the target's forward (its default, 8, is below one batch size's widths plus the plain
# decode step and a chain's lengths, which share that function): 64 covers the widths of several batch sizes.
GRAPHS_PER_FORWARD = 64


@dataclass(eq=False)
class _Row:
    """One sequence of the batch while it decodes."""

    index: int  # its place in the batch as given
    ids: list  # the padded prompt followed by the tokens generated so far (target ids)
    stats: Eagle3Stats = field(default_factory=Eagle3Stats)
    squares: int = 0  # over its rounds with a draft: the accepted count squared, summed (their spread)
    scores: list = field(default_factory=list)  # per generated token: processed scores [1, V], when asked for
    logits: list = field(default_factory=list)  # per generated token: raw logits [1, V], when asked for

    def keep(self, name: str, values: list, asked: bool) -> None:
        """
        Extend ``scores`` or ``logits`` by copies of ``values`` when the call asked for them (a copy: a row of a round's
        logits would otherwise hold the round's whole ``[B, N, V]`` block until ``generate`` returns).

        Args:
            name (`str`): ``"scores"`` or ``"logits"``.
            values (`list[torch.FloatTensor]`): ``[1, V]`` per token.
            asked (`bool`): ``output_scores`` / ``output_logits`` with ``return_dict_in_generate``.
        """
        if asked:
            getattr(self, name).extend(v.clone() for v in values)


def check_rows(input_ids: torch.LongTensor, attention_mask, generation_config, cache, nodes: int) -> list:
    """
    Check, before any work, what the loop needs of its rows (for more than one row: left padding, at least one token
    each, every entry inside a sliding window), and return the number of left pads of each row, the positions the
    draft does not read. One row may have masked positions anywhere (a mask ``generate`` inferred from pad tokens in
    the prompt, say): they stay masked in the target's attention, and the draft reads every position (no pads).

    Args:
        input_ids (`torch.LongTensor` [B, L]): the padded prompts.
        attention_mask (`torch.Tensor` [B, L] or `None`): 1 at real tokens; left padding only.
        generation_config (`GenerationConfig`): the call's config.
        cache (`Cache`): the target's cache for the call.
        nodes (`int`): the most tokens a round verifies per row (root included).

    Raises:
        ValueError: with the fix, for a setting the loop cannot do.
    """
    window = sliding_window(cache)
    if input_ids.shape[0] > 1 and generation_config.max_length + nodes >= window:
        raise ValueError(
            f"Batched EAGLE-3 decoding keeps every row's cache entries inside the target's sliding window "
            f"({window}), so max_length + tokens per round ({generation_config.max_length} + {nodes}) must stay "
            "below it. Generate fewer tokens, or decode the rows one at a time (batch 1 has no such limit)."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("EAGLE-3 decoding needs `input_ids` (a prompt given only as `inputs_embeds` is not "
                         "supported).")
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    mask = attention_mask.bool()
    real = mask.sum(-1)
    pads = (mask.shape[1] - real).cpu()
    left_padded = (mask.long().cumsum(-1) == 0).sum(-1).cpu() == pads
    if input_ids.shape[0] == 1 and not bool(left_padded.all()) and bool(real.all()):
        return [0]
    if not bool(left_padded.all()) or bool((real == 0).any()):
        raise ValueError("EAGLE-3 decoding needs left-padded prompts with at least one token each "
                         "(tokenizer.padding_side = 'left'); the attention mask has zeros after a real token.")
    return pads.tolist()


# ------------------------------------------------------------------------------------------------ the loop
def eagle3_decoding(
    model,
    call,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    model_kwargs: dict,
    streamer=None,
    drafter_class=None,
):
    r"""
    EAGLE-3 decoding of one sequence or a left-padded batch (trees; chains for batches), run in place of
    ``GenerationMixin._assisted_decoding`` with the arguments Transformers prepared for it (see
    :func:`~hf_eagle3.core.generate_hook.loop_arguments`).

    Prefill with the target; then each round, in order: **draft** (the draft consumes every unfinished row's verified
    features in one forward, then drafts all the rows' chains or trees, one forward per level), **verify** (one target
    forward of every row's nodes: 4D mask over the row's cache entries and its own tree, per-row depth-based
    positions), **accept** (the round's one read-back; per row, the longest path the target agrees with, plus its
    bonus token: greedy, the target's choice; sampling,
    :func:`~hf_eagle3.core.acceptance.sample_among_children`; then the length limit and EOS), **commit** (the target
    cache keeps each row's accepted path, the accepted features wait for the draft), **retire** (finished rows leave
    the batch) and, for ``"auto"``, **observe** (the round's acceptance and times size the next round).

    Args:
        model: the target.
        call: the active EAGLE-3 call (draft, feature capture, settings); its ``generator`` is set to the call's
            statistics holder, which the generate hook publishes at the end.
        input_ids (`torch.LongTensor` [B, L]): the (left-padded) prompts.
        logits_processor (`LogitsProcessorList`): applied per row to the target's logits at every node, with the
            node's own prefix.
        stopping_criteria (`StoppingCriteriaList`): checked per row after each round.
        generation_config (`GenerationConfig`): ``do_sample``, ``max_length``, EOS, pad, ``return_dict_in_generate``,
            ``output_scores``, ``output_logits``.
        model_kwargs (`dict`): the prepared model kwargs (``cache``, ``attention_mask``, ``position_ids``, ...).
        streamer (`BaseStreamer`, *optional*): receives each round's new tokens (one row only: Transformers'
            streamers take one sequence).
        drafter_class (`type`, *optional*): the drafter (default :class:`Eagle3Drafter`), built as
            ``drafter_class(draft, rows, capacity)``.

    Returns:
        `torch.LongTensor` [B, L + new], or a `GenerateDecoderOnlyOutput` when ``return_dict_in_generate`` (its
        ``scores`` / ``logits`` hold, per step, one row per sequence; rows already finished get ``-inf`` scores
        and zero logits there; the cache is returned for one row, ``None`` for a batch, whose cache has holes).
        Rows are laid out as plain batched ``generate`` lays them out (padded prompt, generated tokens,
        ``pad_token_id`` after a row's end).
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("Transformers' streamers take one sequence; stream with a batch of one.")
    loop = _Loop(model, call, drafter_class or Eagle3Drafter, input_ids, logits_processor,
                 stopping_criteria, generation_config, model_kwargs, streamer)
    loop.prefill()
    while loop.rows:
        one = loop.draft()
        logits, features, start = loop.verify(one.trees)
        kept, depths = loop.accept(one, logits, features)
        loop.commit(one, kept, start)
        loop.retire()
        loop.observe(one, depths, kept)
    return loop.output(GenerateDecoderOnlyOutput)


@dataclass(eq=False)
class _Round:
    """What a round's drafting step decided, and (for a timed budget) its marks on the device's timeline
    (:class:`~hf_eagle3.core.cost_model.Stopwatch`), read after the round's read-back."""

    trees: list  # one DraftTree per unfinished row
    plan: RoundPlan  # the budget's plan (a plain one: the target's own step, the feed waits)
    feed: int  # mean verified positions per row waiting for the draft at the start of the round
    levels: int = 0  # tree levels expanded
    started: object = None  # mark at the start of drafting
    fed_at: object = None  # mark after the draft's feed
    drafted_at: object = None  # mark after the trees' selection
    ended: object = None  # mark after the verification, just before the read-back
    ranking: object = None  # a budget that needs it: candidate_ranking's probabilities and frontier masses (device, then host)
    graphs: int | None = None  # graphs compiled in the process when the round started (when rounds may compile)


class _Loop:
    r"""
    The state of one EAGLE-3 ``generate`` call of the package's loop and its steps (see :func:`eagle3_decoding`).

    The target cache's rows carry a validity mask (``valid`` [B, T]: left padding and holes are False; for one row,
    kept up to date only when its prompt has masked positions, the mask's one use there) and each row's
    next position (``positions`` [B]); ``rows`` are the unfinished rows, in cache order.

    Args:
        model (`PreTrainedModel`): the target.
        call: the active EAGLE-3 call (draft, feature capture, settings).
        drafter_class (`type`): the drafter.
        input_ids (`torch.LongTensor` [B, L]): the left-padded prompts.
        logits_processor (`LogitsProcessorList`): the call's processors.
        stopping_criteria (`StoppingCriteriaList`): the call's stopping criteria.
        generation_config (`GenerationConfig`): the call's config.
        model_kwargs (`dict`): the prepared model kwargs.
        streamer (`BaseStreamer`, *optional*): the call's streamer (one row).

    Raises:
        ValueError: for inputs or settings the loop does not support, before any work.
    """

    def __init__(self, model, call, drafter_class, input_ids, logits_processor, stopping_criteria, generation_config,
                 model_kwargs, streamer=None):
        self.model, self.model_kwargs, self.input_ids, self.streamer = model, model_kwargs, input_ids, streamer
        self.draft_model, self.capture = call.draft, call.capture
        self.single = input_ids.shape[0] == 1  # one row: no holes, and sliding layers may pass their window
        name = "EAGLE-3 tree decoding" if self.single else "Batched EAGLE-3 decoding"
        self.cache_key, self.cache = decoding_cache(model_kwargs, generation_config, name)
        # A static cache: the rounds' forwards keep one shape per node bucket (compiled where Transformers would).
        self.static = is_static_cache(self.cache)
        self.forward, compiled = round_forward(model, model_kwargs, generation_config) if self.static else (model, False)
        self.compiled = compiled
        if compiled and not isinstance(self.capture, Eagle3OutputFeatures):
            # Hooks cannot tell threads apart inside a compiled forward: every forward of the call returns its
            # features as hidden states instead (on releases that return all of them, the prefill's too: the cost
            # of the prompt's hidden states, once).
            if self.draft_model.config.target_layers_path is not None:
                raise ValueError(
                    "A compiled target forward (a static cache with compile_config, or on an accelerator) returns the "
                    "draft's features as hidden states, which this target's outputs do not index "
                    "(draft.config.target_layers_path is set). Drop compile_config (pass disable_compile=True) or "
                    "use the default dynamic cache."
                )
            self.capture.remove()
            self.capture = Eagle3OutputFeatures(self.capture.layer_ids, len(self.capture.layers))
        self.budget = budget = budget_for(  # how much each round drafts
            call, model, input_ids, generation_config.max_length - input_ids.shape[1],
            "compiled" if compiled else "static" if self.static else "eager")
        if self.static:  # room for the longest row, one round's padded nodes and, for a batch, some holes
            columns = generation_config.max_length + node_bucket(budget.most + 1, budget.most + 1) + (
                0 if self.single else COMPACT_SLACK)
            self.cache = model_kwargs[self.cache_key] = static_cache_for(model, self.cache, input_ids.shape[0], columns)
        self.pool = None  # a static cache's layers in one buffer (after the prefill)
        self.attention_mask = model_kwargs.get("attention_mask")
        self.pads = check_rows(input_ids, self.attention_mask, generation_config, self.cache, budget.most + 1)
        if self.single and not self.static and hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()  # sliding layers keep what a rollback needs until the gather
        self.window = sliding_window(self.cache)
        # the draft cache holds the longest row and one round's tree
        capacity = generation_config.max_length + budget.depth * budget.top_k + budget.depth + 2
        self.drafter = drafter_class(self.draft_model, input_ids.shape[0], capacity)
        # Rounds may compile graphs (the target's forward per rows and width, the draft's per bucket): room for them
        # beside plain decoding's and Transformers' chains', and such a round is not timed (its seconds are the
        # compiler's).
        self.watch_graphs = compiled or self.drafter.compiled
        if self.watch_graphs:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_FORWARD)
        self.run = _Run(self.draft_model, budget)
        call.generator = self.run
        self.stopwatch = Stopwatch(input_ids.device) if budget.timed else None
        self.round_from = None  # a timed budget: where the next round's time starts (the previous round's end mark)
        self.stopping_criteria = stopping_criteria
        self.host_stopping = HostStopping.of(stopping_criteria)
        self.generation_config = generation_config
        self.asked = {name: bool(generation_config.return_dict_in_generate and
                                 getattr(generation_config, f"output_{name}", False)) for name in ("scores", "logits")}
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_token_ids(generation_config)
        self.processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
        self.device, self.dtype = input_ids.device, model.dtype
        self.rows, self.finished = [], [None] * input_ids.shape[0]
        self.prior = self.draft_model.drafting_memory.rows_spread  # how far rows differed in earlier calls
        self.valid = self.positions = None
        self.batch = None  # the unfinished rows as the "auto" choices weigh them (`_batch`), set by `retire`
        self.masked = False  # one row: whether its prompt has masked positions

    def _features(self) -> torch.Tensor:
        """The target features of the call's last forward (run through ``capture.forward``), on the draft's device and
        in its dtype (the capture cleared)."""
        weight = self.draft_model.fc.weight
        features = self.capture.features(weight.device, weight.dtype)
        self.capture.clear()
        return features

    def _mark(self):
        """A mark on the device's timeline for a timed budget (``None`` otherwise)."""
        return self.stopwatch.mark() if self.stopwatch is not None else None

    def prefill(self) -> None:
        """The padded prompts in one forward: each row's first token, and its prompt's features for its draft."""
        input_ids, processors = self.input_ids, self.processors
        last = prefill(self.model, input_ids, self.model_kwargs, self.cache, self.max_length + self.budget.most + 1,
                       forward=self.capture.forward)
        self.cache.crop(0)  # sliding layers back to their window
        scores = processors(input_ids, last) if processors is not None else last
        first = torch.multinomial(scores.softmax(-1), 1)[:, 0] if self.do_sample else scores.argmax(-1)
        features = self._features()
        self.valid = (self.attention_mask.bool() if self.attention_mask is not None
                      else torch.ones(input_ids.shape, dtype=torch.bool, device=self.device))
        self.masked = self.single and self.attention_mask is not None and not bool(self.valid.all())
        if self.static:
            self.pool = StaticPool(self.cache, input_ids.shape[1])
        position_ids = self.model_kwargs.get("position_ids")  # each row's next position: after its last one given,
        self.positions = (position_ids[:, -1] + 1 if position_ids is not None  # else its real tokens so far
                          else self.valid.sum(-1))
        # Each row's prompt positions, moved to the left (the drafter's feeds are right-padded), and the token after
        # each of them (the prompt's next one, then the first generated).
        length = input_ids.shape[1]
        index = (torch.tensor(self.pads)[:, None] + torch.arange(length)).clamp(max=length - 1).to(features.device)
        following = torch.cat([input_ids[:, 1:], first[:, None]], dim=1).to(features.device)
        self.drafter.add(take_positions(features, index), take_positions(following, index),
                         [length - p for p in self.pads])
        for b, token in enumerate(first.tolist()):
            row = _Row(b, input_ids[b].tolist() + [token])
            row.keep("scores", [scores[b : b + 1]], self.asked["scores"])
            row.keep("logits", [last[b : b + 1]], self.asked["logits"])
            row.stats.record(0, 0)
            self.rows.append(row)
        if self.streamer is not None:
            self.streamer.put(first[:, None].cpu())
        self.retire()

    def draft(self) -> _Round:
        """The draft consumes every row's verified positions and drafts every row's tree, one forward per step for
        the batch (one length for all with "auto"; no deeper than the roomiest row can still use). No read-back: an
        ``"auto"`` size was chosen from the previous round's acceptance and candidates.

        Returns:
            `_Round`: one `DraftTree` per row (lone roots when the round drafts nothing), the draft length asked
            for, the mean positions fed, and the marks of ``"auto"``.
        """
        drafter, batch = self.drafter, self.batch
        feed = round(sum(drafter.num_pending(b) for b in range(len(self.rows))) / len(self.rows))
        one = _Round(None, None, feed, started=self._mark(),
                     graphs=compiled_graphs() if self.watch_graphs else None)
        one.plan = plan = self.budget.plan(batch, feed, room=max(batch.remaining) - 1)
        roots = to_device([row.ids[-1] for row in self.rows], drafter.device)
        if not plan.drafts:  # a plain step for the batch; the feed waits
            one.trees = [DraftTree.root_only(roots[b : b + 1]) for b in range(roots.shape[0])]
            one.drafted_at = one.started
            return one
        drafted = drafter.draft_round(roots, plan.depth, plan.top_k, plan.total, self.budget.needs_ranking,
                                      mark=self._mark)
        one.trees, one.levels, one.ranking, one.fed_at = drafted.trees, drafted.levels, drafted.ranking, drafted.fed_at
        one.drafted_at = self._mark()
        return one

    def _batch(self, rows: list | None = None) -> BatchRows:
        """The unfinished rows (or ``rows``) as the ``"auto"`` choices weigh them: the tokens each still needs to
        ``max_length``, the draft's acceptance on it so far and how far rows differed in earlier calls (the batch's
        rounds end with its slowest row)."""
        rows = self.rows if rows is None else rows
        return BatchRows(tuple(self.max_length - len(row.ids) for row in rows),
                         tuple(row.stats.num_accepted_tokens for row in rows), tuple(row.squares for row in rows),
                         tuple(row.stats.num_drafts for row in rows), self.prior)

    def verify(self, trees: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One target forward of every row's tree (for a batch, compacting the cache first when holes made it too
        long).

        Returns:
            ``(logits [B, N, V] float32, features [B, N, 3T], start)``: ``start`` is where the forward's entries begin
            in the cache.
        """
        nodes = max(t.tokens.shape[0] for t in trees)
        if self.static:
            return self._verify_static(trees, nodes)
        if not self.single:
            # The longest row's cached tokens, from host lengths (positions[b] == len(ids) - 1 - pads[b]).
            longest = max(len(row.ids) - 1 - self.pads[row.index] for row in self.rows)
            if self.valid.shape[1] + nodes > min(2 * longest + COMPACT_SLACK, self.window - 1):
                self.valid = compact(self.cache, self.valid)  # far longer than the longest row, or near the window
        start, device = self.valid.shape[1], self.device
        depths = torch.stack([_padded(t.depths, nodes) for t in trees]).to(device)
        if self.single and nodes == 1 and not self.masked and self.window == float("inf"):
            mask = None  # a plain step of one unpadded sequence sees every cached entry: the target's own mask
        elif self.single:  # a mask per layer kind: sliding layers past their window see only its last entries
            tree = trees[0]
            mask = tree_attention_mask(self.cache, tree.ancestors.to(device), depths[0],
                                       self.valid[0] if self.masked else None, self.dtype)
        else:
            mask = batch_tree_mask(self.cache, self.valid, trees, nodes, self.dtype)
        outputs = self.capture.forward(
            self.model,
            input_ids=torch.stack([_padded(t.tokens, nodes) for t in trees]).to(device),
            position_ids=self.positions[:, None] + depths,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_key: self.cache},
        )
        logits = outputs.logits[:, -nodes:].to(dtype=torch.float32, device=device)
        return logits, self._features(), start

    def _verify_static(self, trees: list, nodes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:meth:`verify` on a static cache: every row of the call (a finished row's nodes see only themselves), the
        nodes padded to a bucket's width, the mask over the cache's capacity; compacted only when out of room."""
        width, pool = node_bucket(nodes, self.budget.most + 1), self.pool
        if self.valid.shape[1] + width > pool.capacity:  # a batch whose holes fill the capacity
            longest = max(len(row.ids) - 1 - self.pads[row.index] for row in self.rows)
            order = compaction_order(self.valid, longest)
            pool.gather_rows(order, 0)
            self.valid = self.valid.gather(1, order)
        start, device = self.valid.shape[1], self.device
        placed = [None] * self.valid.shape[0]  # each cache row's tree (None: a finished row)
        for row, tree in zip(self.rows, trees):
            placed[row.index] = tree
        blank = torch.zeros(width, dtype=torch.long, device=device)
        tokens = torch.stack([_padded(t.tokens.to(device), width) if t is not None else blank for t in placed])
        depths = torch.stack([_padded(t.depths.to(device), width) if t is not None else blank for t in placed])
        mask = static_tree_mask(self.valid, [t.ancestors if t is not None else None for t in placed], width,
                                pool.capacity, self.dtype)
        outputs = self.capture.forward(self.forward, input_ids=tokens, position_ids=self.positions[:, None] + depths,
                                       attention_mask=mask, use_cache=True, **{self.cache_key: self.cache})
        pool.wrote(width)
        logits, features = outputs.logits[:, :nodes], self._features()
        if len(self.rows) < len(placed):  # the unfinished rows, in their order
            index = to_device([row.index for row in self.rows], device)
            logits, features = logits.index_select(0, index), features.index_select(0, index.to(features.device))
        return logits.to(dtype=torch.float32), features, start

    def accept(self, one: _Round, logits: torch.Tensor, features: torch.Tensor) -> tuple[list, list]:
        """The round's one read-back (every row's planes: tree, then the argmax or the sampling decisions; for
        ``"tree_auto"`` the candidates' ranking), then per row the acceptance walk, the length limit and EOS; the
        row's tokens, scores, statistics and the verified features for its draft are extended.

        Returns:
            ``(kept, depths)``: per row, the tree nodes whose cache entries stay (the root first), and the depth of
            its tree.
        """
        trees = one.trees
        nodes, sizes, planes, processed = logits.shape[1], [t.tokens.shape[0] for t in trees], [], []
        for b, (tree, n) in enumerate(zip(trees, sizes)):
            row_planes, row_processed = round_planes(tree, logits[b, :n], self.do_sample, self.processors)
            planes.append(torch.stack([_padded(plane, nodes) for plane in row_planes]))
            processed.append(row_processed)
        one.ended = self._mark()
        host, one.ranking = read_back(torch.stack(planes), one.ranking)
        kept, depths, following = [], [], []
        for b, (row, n) in enumerate(zip(self.rows, sizes)):
            mine = [plane[:n] for plane in host[b]]
            walk, new = accept_row(mine, logits[b, :n], self.do_sample, processed[b],
                                   _row_processor(self.processors, row, len(self.finished), self.device),
                                   self.max_length - len(row.ids), self.eos)
            path = [0] + walk.accepted[: len(new) - 1]
            kept.append(path)
            following.append(new)
            depths.append(min(max(mine[2]), max(self.max_length - len(row.ids) - 1, 0)))  # drafted, as far as usable
            row.ids += new
            row.keep("scores", walk.scores[: len(new)], self.asked["scores"])
            row.keep("logits", walk.logits[: len(new)], self.asked["logits"])
            row.stats.record(depths[-1], len(new) - 1)
            row.squares += (len(new) - 1) ** 2 if depths[-1] > 0 else 0
        if self.streamer is not None:
            self.streamer.put(torch.tensor([following[0]]))
        # The accepted paths' features wait for the draft's next feed (one block for the batch, right-padded).
        width = max(len(p) for p in kept)
        index = to_device([p + [0] * (width - len(p)) for p in kept], features.device)
        tokens = to_device([t + [0] * (width - len(t)) for t in following], features.device)
        self.drafter.add(take_positions(features, index), tokens, [len(p) for p in kept])
        return kept, depths

    def commit(self, one: _Round, kept: list, start: int) -> None:
        """The target cache keeps each row's accepted path. One row: the path is gathered in place (sliding layers
        rolled back to their window). A batch: a shorter path than the longest leaves holes; when every row keeps
        every entry of the forward in order (a round that drafted nothing), the cache stays as it is."""
        width = max(len(p) for p in kept)
        if self.static:
            self._commit_static(one, kept, start, width)
            return
        if self.single:
            gather_cache(self.cache, kept[0], one.trees[0].tokens.shape[0])
            if self.masked:  # the only use of a row's validity mask: its prompt's masked positions
                self.valid = torch.cat([self.valid, self.valid.new_ones(1, width)], dim=1)
            self.positions = self.positions + width
            return
        if not (self.cache.get_seq_length() == start + width and in_order(kept)):
            gather_entries(self.cache, to_device([p + [0] * (width - len(p)) for p in kept], self.device), start)
        self._extend(kept, width)

    def _commit_static(self, one: _Round, kept: list, start: int, width: int) -> None:
        """:meth:`commit` on a static cache: every row of the call keeps its accepted path (a finished row keeps
        nothing: its entries are holes), with one gather for all layers unless every path is in order, then the
        layers write the next round after them."""
        rows = self.valid.shape[0]
        paths = [[] for _ in range(rows)]
        for row, path in zip(self.rows, kept):
            paths[row.index] = path
        if in_order(paths):
            self.pool.set_length(start + width)
        else:
            self.pool.gather_rows(to_device([p + list(range(len(p), width)) for p in paths], self.device), start)
        self._extend(paths, width)

    def _extend(self, paths: list, width: int) -> None:
        """Each cache row's validity mask grows by the round's ``width`` entries (its path's real, the rest holes),
        and its next position moves past its path."""
        block = to_device([[True] * len(p) + [False] * (width - len(p)) for p in paths], self.device, torch.bool)
        self.valid = torch.cat([self.valid, block], dim=1)
        self.positions = self.positions + to_device([len(p) for p in paths], self.device, self.positions.dtype)

    def retire(self) -> None:
        """Rows that are done (EOS, ``max_length`` or a stopping criterion) leave the batch and its cache (the last
        rows keep it: it is returned for one row)."""
        remaining = []
        for row in self.rows:
            done = row.ids[-1] in self.eos or len(row.ids) >= self.max_length
            if not done and self.host_stopping is not None:
                done = self.host_stopping.done(len(row.ids), row.ids[-1])
            elif not done:  # a criterion the host cannot decide: called on the row's sequence
                done = bool(self.stopping_criteria(torch.tensor([row.ids], device=self.device), None).all())
            if done:
                self.finished[row.index] = row
            else:
                remaining.append(row)
        if remaining and len(remaining) < len(self.rows):
            kept = [i for i, r in enumerate(self.rows) if r in remaining]
            self.drafter.keep_rows(kept)
        if remaining and len(remaining) < len(self.rows) and not self.static:  # a static cache keeps its rows
            keep = to_device(kept, self.device)
            keep_rows(self.cache, keep)
            self.valid, self.positions = self.valid[keep], self.positions[keep]
        self.rows = remaining
        self.batch = self._batch()  # the rows as this round left them, for the next round's choices

    def observe(self, one: _Round, depths: list, kept: list) -> None:
        """For a timed budget: the round's outcome (every row: its tree's depth and the nodes kept; the round's
        times). The marks were all passed by the read-back; a round's time runs from the previous round's end mark to
        its own (so the read-back, the walk and the commit are counted once)."""
        watch = self.stopwatch
        if watch is None:
            return
        seconds = watch.seconds(self.round_from if self.round_from is not None else one.started, one.ended)
        self.round_from = one.ended
        if one.graphs is not None and compiled_graphs() != one.graphs:  # it compiled a graph: not the round's cost
            return
        drafts = one.plan.drafts
        draft_seconds = watch.seconds(one.started, one.drafted_at) if drafts else 0.0
        # A captured round's feed is one of its forwards: its share of the round's drafting seconds.
        feed_seconds = (watch.seconds(one.started, one.fed_at) if one.fed_at is not None
                        else draft_seconds / max(one.levels, 1)) if drafts else 0.0
        self.budget.observe(RoundOutcome(
            one.plan, depths, [len(path) - 1 for path in kept], one.feed, one.trees[0].tokens.shape[0], seconds,
            verify_seconds=watch.seconds(one.drafted_at, one.ended),
            draft_seconds=draft_seconds, feed_seconds=feed_seconds,
            levels=one.levels, ranking=one.ranking, batch=self.batch))

    def output(self, output_class):
        """What ``generate`` returns: the rows as plain batched ``generate`` lays them out, or ``output_class``
        (scores and logits per step, the cache for one row); the statistics go on the run."""
        if self.streamer is not None:
            self.streamer.end()
        finished, generation_config = self.finished, self.generation_config
        self.run.rows = [row.stats for row in finished]
        if len(finished) > 1:  # how far this call's rows differed, for the next call's first rounds
            estimate = self._batch(finished).estimate
            self.run.spread = estimate.spread if estimate.within is not None else self.prior
        pad = generation_config.pad_token_id  # generate's default when unset: the first eos token, else 0
        if pad is None:
            eos = generation_config.eos_token_id
            eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
            pad = eos if eos is not None else 0
        pad = int(pad)
        length = max(len(row.ids) for row in finished)
        sequences = torch.tensor([row.ids + [pad] * (length - len(row.ids)) for row in finished],
                                 dtype=self.input_ids.dtype, device=self.device)
        if not generation_config.return_dict_in_generate:
            return sequences
        steps = length - self.input_ids.shape[1]

        def per_step(name: str, fill: float):
            if not getattr(generation_config, f"output_{name}"):
                return None
            out = []
            for t in range(steps):
                values = [getattr(row, name)[t] if t < len(getattr(row, name)) else None for row in finished]
                like = next(v for v in values if v is not None)
                out.append(torch.cat([v if v is not None else torch.full_like(like, fill) for v in values]))
            return tuple(out)

        return output_class(sequences=sequences, scores=per_step("scores", float("-inf")),
                            logits=per_step("logits", 0.0), **{self.cache_key: self.cache if self.single else None})


def _padded(values: torch.Tensor, n: int) -> torch.Tensor:
    """``values`` followed by copies of its first entry, to length ``n`` (the padding nodes of a smaller tree)."""
    if values.shape[0] == n:
        return values
    return torch.cat([values, values[:1].expand(n - values.shape[0])])


def _row_processor(processors, row: _Row, batch_size: int, device):
    """The walk's ``process``: the logits processors with the row's own prefix (padded prompt + its tokens).

    Processors may keep per-row state sized to the batch (e.g. the prompt lengths of a repetition penalty that
    ignores the prompt), so they are called on the batch's full size with the row in every place, and the row's own
    place is read back.
    """
    if processors is None:
        return None

    def process(path: list, logits: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([row.ids + path], dtype=torch.long, device=device).expand(batch_size, -1)
        return processors(ids, logits.expand(batch_size, -1).clone())[row.index : row.index + 1]

    return process


class _Run:
    """Per-call state published at the end of ``generate`` (``finish`` is called by the generate hook): the summed
    statistics as ``draft.last_stats``, one per row as ``draft.last_batch_stats``."""

    def __init__(self, draft, budget=None):
        self.draft = draft
        self.rows = []
        self.budget = budget  # how much each round drafted (it leaves the next call what it learnt)
        self.spread = None  # how far the call's rows differed (`RowEstimate.spread`), for a batch

    def finish(self) -> Eagle3Stats:
        """Publish the statistics on the draft and return their sum."""
        return publish_stats(self.draft, self.rows, self.budget, self.spread)
