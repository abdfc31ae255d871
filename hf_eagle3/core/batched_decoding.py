"""Batched EAGLE-3 decoding: chains and trees for a left-padded batch, run in place of Transformers' assisted-decoding
loop (which takes one sequence) when ``generate`` gets more than one row.

Every row keeps its own acceptance; the draft runs one forward per step for all the rows
(:class:`~hf_eagle3.core.batch_drafter.Eagle3BatchTreeDrafter`) and the target verifies all rows in one forward.
Rows accept different numbers of tokens, so the target's KV cache keeps a per-row validity mask: a round appends as
many entries as the row that accepted most, the other rows' surplus entries are holes that the attention mask hides,
and each row carries its own position ids. When holes make the cache much longer than the longest row, the rows
are compacted (each row's entries moved to the right end, as left padding is). Rows that finish leave the batch, so
they stop costing.

A chain is the tree with one child per node: the same loop drafts ``num_assistant_tokens`` tokens per row with the
draft's most likely token at each step, and accepts them with the same walk (greedy: the target's choice; sampling:
recursive rejection sampling, which keeps the target's distribution). See ``docs/batching.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .acceptance import accept_row, read_back, round_planes
from .batch_drafter import Eagle3BatchTreeDrafter, take_positions
from .cost_model import measure_costs, target_costs
from .draft_length_policy import Eagle3DraftLengthPolicy
from .settings import DEFAULT_DRAFT_LENGTH, resolve_draft_settings
from .stats import Eagle3Stats, publish_stats
from .stopping import HostStopping
from .target_cache import batch_tree_mask, compact, decoding_cache, gather_entries, keep_rows, prefill, sliding_window
from .transformers_compat import eos_token_ids
from .tree_drafter import Eagle3TreeDrafter
from .tree_policy import AUTO_FIRST, AUTO_SIZES, TreeSizeChooser, auto_most_nodes

COMPACT_SLACK = 32  # compact the target cache when it is this many entries longer than twice the longest row


@dataclass(eq=False)
class _Row:
    """One sequence of the batch while it decodes."""

    index: int  # its place in the batch as given
    ids: list  # the padded prompt followed by the tokens generated so far (target ids)
    stats: Eagle3Stats = field(default_factory=Eagle3Stats)
    scores: list = field(default_factory=list)  # per generated token: processed scores [1, V]
    logits: list = field(default_factory=list)  # per generated token: raw logits [1, V]


def _round_shape(call, draft) -> dict:
    """The drafting shape of the rounds: ``{"depth", "top_k", "total", "auto", "tree_auto", "most"}`` (a chain is
    ``top_k = 1``; with ``"auto"`` the depth is the longest chain and a policy picks each round's; with
    ``"tree_auto"`` a :class:`TreeSizeChooser` picks each round's ``total``, at most ``most``).

    Raises:
        ValueError: for chain settings batches do not implement (``"heuristic"`` schedules, a confidence threshold),
            before any work, naming what to use.
    """
    if call.tree is not None:
        depth, top_k, total = call.tree["depth"], call.tree["top_k"], call.tree["total_tokens"]
        if total == "auto":
            most = auto_most_nodes(depth, top_k)
            return {"depth": depth, "top_k": top_k, "total": min(AUTO_FIRST, most), "auto": False,
                    "tree_auto": True, "most": most}
        return {"depth": min(depth, total), "top_k": min(top_k, total), "total": total, "auto": False,
                "tree_auto": False, "most": total}
    settings = resolve_draft_settings(draft.generation_config, call.settings)
    schedule = settings.get("num_assistant_tokens_schedule", "constant")
    if schedule in ("heuristic", "heuristic_transient"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} (one sequence's draft length, adapted to its acceptance) is "
            "not implemented for batches: pass num_assistant_tokens_schedule='auto' (one length per round for the "
            "batch, from measured costs and acceptance) or 'constant', or generate one row at a time."
        )
    if float(settings.get("assistant_confidence_threshold") or 0.0) > 0:
        raise ValueError(
            f"assistant_confidence_threshold={settings['assistant_confidence_threshold']} is not implemented for "
            "batches: pass assistant_confidence_threshold=0 (or num_assistant_tokens_schedule='auto', which chooses "
            "the draft length from the acceptance seen), or generate one row at a time."
        )
    k = int(settings.get("num_assistant_tokens", DEFAULT_DRAFT_LENGTH))
    return {"depth": k, "top_k": 1, "total": k, "auto": settings.get("num_assistant_tokens_schedule") == "auto",
            "tree_auto": False, "most": k}


def batch_policy(model, draft, input_ids: torch.LongTensor, carried=None) -> Eagle3DraftLengthPolicy:
    """
    The ``"auto"`` draft-length policy of a batched call: one length per round for every row, chosen under the
    costs of this batch (the target's forwards and the draft's, timed at this batch size).

    Args:
        model: the target.
        draft: the draft.
        input_ids (`torch.LongTensor` [B, L]): the batch.
        carried (`dict`, *optional*): the acceptance carried from the draft's previous call.
    """
    return Eagle3DraftLengthPolicy.from_carried(measure_costs(model, draft, input_ids), carried)


def check_batch(input_ids: torch.LongTensor, attention_mask, generation_config, cache, nodes: int) -> torch.Tensor:
    """
    Check, before any work, what only the batched loop needs (left padding; every entry inside a sliding window),
    and return the number of left pads of each row.

    Args:
        input_ids (`torch.LongTensor` [B, L]): the padded prompts.
        attention_mask (`torch.Tensor` [B, L] or `None`): 1 at real tokens; left padding only.
        generation_config (`GenerationConfig`): the call's config.
        cache (`Cache`): the target's cache for the call.
        nodes (`int`): the most tokens a round verifies per row (root included).

    Raises:
        ValueError: with the fix, for a setting the batched loop cannot do.
    """
    window = sliding_window(cache)
    if generation_config.max_length + nodes >= window:
        raise ValueError(
            f"Batched EAGLE-3 decoding keeps every row's cache entries inside the target's sliding window "
            f"({window}), so max_length + tokens per round ({generation_config.max_length} + {nodes}) must stay "
            "below it. Generate fewer tokens, or decode the rows one at a time (batch 1 has no such limit)."
        )
    if attention_mask is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.long)
    mask = attention_mask.bool()
    real = mask.sum(-1)
    pads = (mask.shape[1] - real).cpu()
    left_padded = (mask.long().cumsum(-1) == 0).sum(-1).cpu() == pads
    if not bool(left_padded.all()) or bool((real == 0).any()):
        raise ValueError("Batched EAGLE-3 decoding needs left-padded prompts with at least one token each "
                         "(tokenizer.padding_side = 'left'); the attention mask has zeros after a real token.")
    return pads


# ------------------------------------------------------------------------------------------------ the loop
def eagle3_batched_decoding(
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
    EAGLE-3 decoding of a left-padded batch (chains or trees), run in place of ``GenerationMixin._assisted_decoding``
    with the arguments Transformers prepared for it (see :func:`~hf_eagle3.core.generate_hook.loop_arguments`).

    Each round, in order: **draft** (the draft consumes every unfinished row's verified features in one forward, then
    drafts all the rows' chains or trees, one forward per level), **verify** (one target forward of every row's
    nodes: 4D mask over the row's valid cache entries and its tree, per-row positions), **accept** (per row, :func:`~hf_eagle3.core.acceptance.walk_tree`, then the length limit and
    EOS), **commit** (the target cache keeps each row's accepted path, the accepted features wait for the draft) and
    **retire** (finished rows leave the batch). Output: the rows as plain batched ``generate`` lays them out (padded
    prompt, generated tokens, ``pad_token_id`` after a row's end).

    Args:
        model: the target.
        call: the active EAGLE-3 call (draft, feature capture, settings).
        input_ids (`torch.LongTensor` [B, L]): the left-padded prompts.
        logits_processor (`LogitsProcessorList`): applied per row to the target's logits, with the row's own prefix.
        stopping_criteria (`StoppingCriteriaList`): checked per row after each round.
        generation_config (`GenerationConfig`): ``do_sample``, ``max_length``, EOS, pad, ``return_dict_in_generate``,
            ``output_scores``, ``output_logits``.
        streamer: must be ``None`` (Transformers' streamers take one row; the generate hook refuses them before).
        drafter_class (`type`, *optional*): the batch's drafter (default :class:`Eagle3BatchTreeDrafter`), built as
            ``drafter_class(draft, rows, capacity)``.
        model_kwargs (`dict`): the prepared model kwargs (``cache``, ``attention_mask``, ...).

    Returns:
        `torch.LongTensor` [B, L + new], or a `GenerateDecoderOnlyOutput` when ``return_dict_in_generate`` (its
        ``scores`` / ``logits`` hold, per step, one row per sequence; rows already finished get ``-inf`` scores
        and zero logits there; ``past_key_values`` is ``None``: the cache has holes).
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if streamer is not None:
        raise ValueError("Transformers' streamers take one sequence; stream with a batch of one.")
    loop = _BatchLoop(model, call, drafter_class or Eagle3BatchTreeDrafter, input_ids, logits_processor,
                      stopping_criteria, generation_config, model_kwargs)
    loop.prefill()
    while loop.rows:
        started = time.perf_counter()
        trees, drafted, feed = loop.draft()
        logits, features, start = loop.verify(trees)
        kept, depths = loop.accept(trees, logits, features)
        loop.commit(kept, start)
        loop.retire()
        loop.observe(trees, depths, kept, drafted, feed, time.perf_counter() - started)
    return _outputs(loop.finished, generation_config, input_ids, loop.run, GenerateDecoderOnlyOutput)


class _BatchLoop:
    r"""
    The state of one batched ``generate`` call and its steps (see :func:`eagle3_batched_decoding`).

    The target cache's rows carry a validity mask (``valid`` [B, T]: left padding and holes are False) and each row's
    next position (``positions`` [B]: its real tokens so far); ``rows`` are the unfinished rows, in cache order.

    Args:
        model (`PreTrainedModel`): the target.
        call: the active EAGLE-3 call (draft, feature capture, settings).
        drafter_class (`type`): the batch's drafter.
        input_ids (`torch.LongTensor` [B, L]): the left-padded prompts.
        logits_processor (`LogitsProcessorList`): the call's processors.
        stopping_criteria (`StoppingCriteriaList`): the call's stopping criteria.
        generation_config (`GenerationConfig`): the call's config.
        model_kwargs (`dict`): the prepared model kwargs.
    """

    def __init__(self, model, call, drafter_class, input_ids, logits_processor, stopping_criteria, generation_config,
                 model_kwargs):
        self.model, self.model_kwargs, self.input_ids = model, model_kwargs, input_ids
        self.draft_model, self.capture = call.draft, call.capture
        self.shape = _round_shape(call, self.draft_model)
        self.cache_key, self.cache = decoding_cache(model_kwargs, generation_config, "Batched EAGLE-3 decoding")
        self.attention_mask = model_kwargs.get("attention_mask")
        self.pads = check_batch(input_ids, self.attention_mask, generation_config, self.cache,
                                self.shape["most"] + 1).tolist()  # a host tensor
        self.window = sliding_window(self.cache)
        shape = self.shape  # the draft cache holds the longest row and one round's tree
        capacity = generation_config.max_length + shape["depth"] * shape["top_k"] + shape["depth"] + 2
        self.drafter = drafter_class(self.draft_model, input_ids.shape[0], capacity)  # before any timing forward
        self.run = _BatchRun(self.draft_model)
        call.generator = self.run
        if self.shape["auto"]:
            self.run.policy = batch_policy(model, self.draft_model, input_ids,
                                           getattr(self.draft_model, "_draft_length_state", None))
            self.capture.clear()  # the timing forwards (once per target and batch size) went through the hooks
        self.chooser = None  # tree_total_tokens="auto": one size per round for the batch
        if self.shape["tree_auto"]:
            self.chooser = TreeSizeChooser(target_costs(model, input_ids, sizes=AUTO_SIZES))
            self.capture.clear()
        self.ranking = None  # "tree_auto": the round's candidate_ranking (probabilities, frontier masses)
        self.next_depth = self.shape["depth"]  # "tree_auto": the levels of the next round's trees
        self.stopping_criteria = stopping_criteria
        self.host_stopping = HostStopping.of(stopping_criteria)
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_token_ids(generation_config)
        self.processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
        self.device, self.dtype = input_ids.device, model.dtype
        self.rows, self.finished = [], [None] * input_ids.shape[0]
        self.valid = self.positions = None

    def _features(self) -> torch.Tensor:
        """The target features of its last forward, on the draft's device and in its dtype (the capture cleared)."""
        weight = self.draft_model.fc.weight
        features = self.capture.features(weight.device, weight.dtype)
        self.capture.clear()
        return features

    def prefill(self) -> None:
        """The padded prompts in one forward: each row's first token, and its prompt's features for its draft."""
        input_ids, processors = self.input_ids, self.processors
        last = prefill(self.model, input_ids, self.model_kwargs, self.cache, self.max_length + self.shape["most"] + 1)
        scores = processors(input_ids, last) if processors is not None else last
        first = torch.multinomial(scores.softmax(-1), 1)[:, 0] if self.do_sample else scores.argmax(-1)
        features = self._features()
        self.valid = (self.attention_mask.bool() if self.attention_mask is not None
                      else torch.ones(input_ids.shape, dtype=torch.bool, device=self.device))
        self.positions = self.valid.sum(-1)  # position of each row's next token (its root): real tokens so far
        # Each row's prompt positions, moved to the left (the drafter's feeds are right-padded), and the token after
        # each of them (the prompt's next one, then the first generated).
        length = input_ids.shape[1]
        index = (torch.tensor(self.pads)[:, None] + torch.arange(length)).clamp(max=length - 1).to(features.device)
        following = torch.cat([input_ids[:, 1:], first[:, None]], dim=1).to(features.device)
        self.drafter.add(take_positions(features, index), take_positions(following, index),
                         [length - p for p in self.pads])
        for b, token in enumerate(first.tolist()):
            row = _Row(b, input_ids[b].tolist() + [token])
            row.scores.append(scores[b : b + 1])
            row.logits.append(last[b : b + 1])
            row.stats.record(0, 0)
            self.rows.append(row)
        self.retire()

    def draft(self) -> tuple[list, int, int]:
        """The draft consumes every row's verified positions and drafts every row's tree, one forward per step for
        the batch (one length for all with "auto"; no deeper than the roomiest row can still use).

        Returns:
            ``(trees, drafted, feed)``: one `DraftTree` per row, the draft length asked for, the mean positions fed.
        """
        shape, policy, chooser, drafter = self.shape, self.run.policy, self.chooser, self.drafter
        feed = round(sum(drafter.num_pending(b) for b in range(len(self.rows))) / len(self.rows))
        if policy is not None:
            k = policy.choose(shape["depth"], feed=feed)
            shape = dict(shape, depth=k, total=k)
        depth = min(shape["depth"], max(self.max_length - len(row.ids) - 1 for row in self.rows))
        self.ranking = None
        if chooser is not None and depth >= 1 and not chooser.draft_this_round():
            depth = 0  # a plain step for the batch; the feed waits
        elif chooser is not None:
            depth = min(depth, self.next_depth)
        roots = torch.tensor([row.ids[-1] for row in self.rows], dtype=torch.long, device=drafter.device)
        trees = drafter.round_trees(depth, shape["top_k"], shape["total"], roots)
        if chooser is not None and depth >= 1:
            self.ranking = Eagle3TreeDrafter.candidate_ranking(drafter.last_candidates)
        return trees, shape["depth"] if depth >= 1 else 0, feed

    def verify(self, trees: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One target forward of every row's tree (compacting the cache first when holes made it too long).

        Returns:
            ``(logits [B, N, V] float32, features [B, N, 3T], start)``: ``start`` is where the forward's entries begin
            in the cache.
        """
        nodes = max(t.tokens.shape[0] for t in trees)
        # The longest row's cached tokens, from host lengths (positions[b] == len(ids) - 1 - pads[b]): no read-back.
        longest = max(len(row.ids) - 1 - self.pads[row.index] for row in self.rows)
        if self.valid.shape[1] + nodes > min(2 * longest + COMPACT_SLACK, self.window - 1):
            self.valid = compact(self.cache, self.valid)  # far longer than the longest row, or near the window
        start, device = self.valid.shape[1], self.device
        depths = torch.stack([_padded(t.depths, nodes) for t in trees]).to(device)
        outputs = self.model(
            input_ids=torch.stack([_padded(t.tokens, nodes) for t in trees]).to(device),
            position_ids=self.positions[:, None] + depths,
            attention_mask=batch_tree_mask(self.cache, self.valid, trees, nodes, self.dtype),
            use_cache=True,
            **{self.cache_key: self.cache},
        )
        logits = outputs.logits[:, -nodes:].to(dtype=torch.float32, device=device)
        return logits, self._features(), start

    def accept(self, trees: list, logits: torch.Tensor, features: torch.Tensor) -> list:
        """Per row: the acceptance walk, the length limit and EOS; the row's tokens, scores, statistics and the
        verified features for its draft are extended.

        Returns:
            ``(kept, depths)``: per row, the tree nodes whose cache entries stay (the root first), and the depth of
            its tree.
        """
        # One read-back for the whole batch: every row's planes (tree, then the argmax or the sampling decisions).
        nodes, sizes, planes, processed = logits.shape[1], [t.tokens.shape[0] for t in trees], [], []
        for b, (tree, n) in enumerate(zip(trees, sizes)):
            row_planes, row_processed = round_planes(tree, logits[b, :n], self.do_sample, self.processors)
            planes.append(torch.stack([_padded(plane, nodes) for plane in row_planes]))
            processed.append(row_processed)
        host, ranking = read_back(torch.stack(planes), self.ranking)
        if ranking is not None:
            self.ranking = ranking
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
            row.scores += walk.scores[: len(new)]
            row.logits += walk.logits[: len(new)]
            row.stats.record(depths[-1], len(new) - 1)
        # The accepted paths' features wait for the draft's next feed (one block for the batch, right-padded).
        width = max(len(p) for p in kept)
        index = torch.tensor([p + [0] * (width - len(p)) for p in kept], device=features.device)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in following], device=features.device)
        self.drafter.add(take_positions(features, index), tokens, [len(p) for p in kept])
        return kept, depths

    def commit(self, kept: list, start: int) -> None:
        """The target cache keeps each row's accepted path; a shorter path than the longest leaves holes. When every
        row keeps every entry of the forward in order (a round that drafted nothing), the cache stays as it is."""
        width = max(len(p) for p in kept)
        index = torch.zeros(len(kept), width, dtype=torch.long)
        block = torch.zeros(len(kept), width, dtype=torch.bool)
        for b, p in enumerate(kept):
            index[b, : len(p)] = torch.tensor(p)
            block[b, : len(p)] = True
        everything = self.cache.get_seq_length() == start + width and all(p == list(range(width)) for p in kept)
        if not everything:
            gather_entries(self.cache, index.to(self.device), start)
        self.valid = torch.cat([self.valid, block.to(self.device)], dim=1)
        self.positions = self.positions + block.sum(-1).to(self.device)

    def retire(self) -> None:
        """Rows that are done (EOS, ``max_length`` or a stopping criterion) leave the batch and its cache."""
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
        if len(remaining) < len(self.rows):
            kept = [i for i, r in enumerate(self.rows) if r in remaining]
            self.drafter.keep_rows(kept)
            keep = torch.tensor(kept, dtype=torch.long, device=self.device)
            keep_rows(self.cache, keep)
            self.valid, self.positions = self.valid[keep], self.positions[keep]
        self.rows = remaining

    def observe(self, trees: list, depths: list, kept: list, drafted: int, feed: int, seconds: float) -> None:
        """For "auto": the round's acceptance (every row: its tree's depth and the nodes kept) and wall time; with
        ``tree_total_tokens="auto"``, the size of the next round's trees."""
        policy, chooser = self.run.policy, self.chooser
        if policy is not None:
            for depth, path in zip(depths, kept):
                policy.observe(depth, len(path) - 1)
            policy.observe_time(drafted, seconds, feed=feed)
        if chooser is None:
            return
        if not drafted:
            chooser.update_plain(seconds)
            return
        total = trees[0].tokens.shape[0] - 1
        accepted = sum(len(path) - 1 for path in kept) / len(kept)  # per row, as the probabilities are
        nodes, self.next_depth = chooser.observe_tree_round(
            self.ranking, total, accepted, max(seconds - chooser.target_seconds(total + 1), 0.0), trees[0].max_depth,
            seconds, self.shape["depth"], fed=feed)
        self.shape = dict(self.shape, total=nodes)


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


class _BatchRun:
    """Per-call state published at the end of ``generate`` (``finish`` is called by the generate hook): the summed
    statistics as ``draft.last_stats``, one per row as ``draft.last_batch_stats``."""

    def __init__(self, draft):
        self.draft = draft
        self.rows = []
        self.policy = None  # the "auto" draft-length policy, when the call uses it


    def finish(self) -> Eagle3Stats:
        """Publish the statistics on the draft and return their sum."""
        return publish_stats(self.draft, self.rows, self.policy)


def _outputs(finished: list, generation_config, input_ids, run: _BatchRun, output_class):
    """Lay the rows out as plain batched ``generate`` does, and the statistics on the run."""
    run.rows = [row.stats for row in finished]
    pad = generation_config.pad_token_id  # generate's default when unset: the first eos token, else 0
    if pad is None:
        eos = generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        pad = eos if eos is not None else 0
    pad = int(pad)
    length = max(len(row.ids) for row in finished)
    sequences = torch.tensor([row.ids + [pad] * (length - len(row.ids)) for row in finished],
                             dtype=input_ids.dtype, device=input_ids.device)
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = length - input_ids.shape[1]

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
                        logits=per_step("logits", 0.0), past_key_values=None)
