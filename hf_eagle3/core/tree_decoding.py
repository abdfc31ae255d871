"""The decoding loop of EAGLE-3 with EAGLE-2-style dynamic draft trees: tree drafting, one-forward tree verification
and lossless tree sampling, run in place of Transformers' assisted-decoding loop.

``target.generate(ids, assistant_model=draft, tree_total_tokens=..., tree_depth=..., tree_top_k=...)`` (or the same
names on ``draft.generation_config``) selects it: the ``generate`` hook (``generate_hook.py``) pops the settings and
routes ``GenerationMixin._assisted_decoding`` to :func:`eagle3_tree_decoding`, with the arguments Transformers
prepared (logits processors, stopping criteria, streamer, cache). See ``docs/trees.md``.

Each round is a straight line of steps (:class:`_TreeLoop`): :meth:`~_TreeLoop.draft_round` (feed the draft the
verified positions, draft a tree), :meth:`~_TreeLoop.verify` (one target forward over the tree),
:meth:`~_TreeLoop.accept` (the round's one read-back, then :func:`~hf_eagle3.core.acceptance.accept_row`, as the
batched loop does for each row) and :meth:`~_TreeLoop.commit` (keep the accepted path in the target's
cache, hand its features to the draft, extend the outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import TreeWalk, accept_row, read_back, round_planes
from .cost_model import Stopwatch, target_costs
from .stats import Eagle3Stats, publish_stats
from .stopping import HostStopping
from .target_cache import decoding_cache, gather_cache, prefill, tree_attention_mask
from .transformers_compat import eos_token_ids
from .tree_drafter import DraftTree, Eagle3TreeDrafter
from .tree_policy import AUTO_FIRST, AUTO_SIZES, TreeSizeChooser, auto_most_nodes


class _TreeRun:
    """Per-call state published at the end of ``generate`` (``finish`` is called by the generate hook)."""

    def __init__(self, draft):
        self.draft = draft
        self.stats = Eagle3Stats()

    def finish(self):
        """Publish the statistics on the draft (``last_stats`` / ``cumulative_stats``) and return them."""
        return publish_stats(self.draft, [self.stats])


@dataclass
class _Round:
    """What a round's drafting step decided, and (for ``"auto"``) its marks on the device's timeline
    (:class:`~hf_eagle3.core.cost_model.Stopwatch`), read after the round's read-back."""

    tree: DraftTree
    drafting: bool  # a tree was drafted (else the root alone: a plain target step)
    depth: int  # the depth allowed this round (0: ``max_length`` leaves no room for a draft)
    started: object = None  # mark at the start of drafting
    fed_at: object = None  # mark after the draft's feed
    drafted_at: object = None  # mark after the tree's selection
    ended: object = None  # mark after the verification, just before the read-back
    fed: int = 0  # verified positions fed to the draft at the start of the round
    levels: int = 0  # tree levels expanded
    ranking: object = None  # candidate_ranking's probabilities and frontier masses: on the device, then host lists


class _TreeLoop:
    r"""
    The state of one tree-decoding ``generate`` call and its steps.

    Args:
        model (`PreTrainedModel`): the target.
        call: the active EAGLE-3 call (draft, feature capture, tree settings).
        drafter_class (`type`): the tree drafter class (:class:`Eagle3TreeDrafter` or a subclass), instantiated with
            the draft once the inputs are checked.
        input_ids (`torch.LongTensor` [1, L]): the prompt.
        logits_processor (`LogitsProcessorList`): applied to the target's logits at every tree node.
        stopping_criteria (`StoppingCriteriaList`): checked after each round (on the host for the default ones).
        generation_config (`GenerationConfig`): the call's generation config.
        streamer (`BaseStreamer`, *optional*): receives each round's new tokens.
        model_kwargs (`dict`): the prepared model kwargs (``cache``, ``attention_mask``, ``position_ids``, ...).

    Raises:
        ValueError: for inputs or settings tree decoding does not support (batch > 1, no ids, no or an unsupported
            cache, attentions or hidden states asked for).
    """

    def __init__(self, model, call, drafter_class, input_ids, logits_processor, stopping_criteria, generation_config,
                 streamer, model_kwargs):
        if input_ids.shape[0] != 1:
            raise ValueError(f"EAGLE-3 tree decoding handles one sequence at a time, got a batch of {input_ids.shape[0]}.")
        if input_ids.shape[1] == 0:
            raise ValueError("EAGLE-3 tree decoding needs `input_ids` (a prompt given only as `inputs_embeds` is not "
                             "supported).")
        self.cache_key, self.cache = decoding_cache(model_kwargs, generation_config, "EAGLE-3 tree decoding")
        if hasattr(self.cache, "activate_past_recording"):  # sliding layers keep what a rollback needs until the gather
            self.cache.activate_past_recording()

        self.model, self.model_kwargs = model, model_kwargs
        self.settings, self.capture, self.stats = call.tree, call.capture, call.generator.stats
        self.drafter = drafter_class(call.draft)
        self.generation_config = generation_config
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_token_ids(generation_config)
        self.want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
        self.want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
        self.scores_out = () if self.want_scores else None
        self.logits_out = () if self.want_logits else None
        self.processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
        self.streamer = streamer
        self.input_ids = input_ids
        self.device = input_ids.device
        self.dtype = model.dtype
        # Padding of the prompt (batch of one with a 2D mask that has zeros) stays masked in the tree forwards.
        attention_mask = model_kwargs.get("attention_mask")
        self.prefix_allowed = None
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            self.prefix_allowed = attention_mask[0].bool()
        position_ids = model_kwargs.get("position_ids")
        self.position_offset = 0 if position_ids is None else int(position_ids[0, -1]) - (input_ids.shape[1] - 1)
        self.chooser = self.stopwatch = None  # tree_total_tokens="auto" (see start_auto)
        self.next_total = self.next_depth = None  # "auto": the next round's nodes and levels
        self.round_from = None  # "auto": where the next round's timeline starts (the previous round's end mark)
        self.stopping_criteria, self.host_stopping = stopping_criteria, HostStopping.of(stopping_criteria)
        self.last_token = None  # the sequence's last token, on the host (set by the prefill and every commit)

    def finished(self) -> bool:
        """Whether generation stops after this round: on the host for the default criteria (no device sync), else by
        calling the stopping criteria on the sequence."""
        if self.host_stopping is not None:
            return self.host_stopping.done(self.input_ids.shape[1], self.last_token)
        return bool(self.stopping_criteria(self.input_ids, self.scores_out).all())

    # ------------------------------------------------------------------------------------------------------ steps
    def _pick(self, seq: torch.LongTensor, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The target's token after ``seq`` (sampled or argmax of the processed scores) and those scores."""
        scores = self.processors(seq, logits) if self.processors is not None else logits
        if self.do_sample:
            return int(torch.multinomial(scores.softmax(-1)[0], 1)), scores
        return int(scores[0].argmax()), scores

    def prefill(self) -> None:
        """The target's forward over the prompt: the first token, and the prompt's features for the draft."""
        total = self.settings["total_tokens"]  # the most drafted nodes a round verifies:
        nodes = auto_most_nodes(self.settings["depth"], self.settings["top_k"]) if total == "auto" else total
        last = prefill(self.model, self.input_ids, self.model_kwargs, self.cache, self.max_length + nodes + 1)
        self.cache.crop(0)  # sliding layers back to their window
        token, processed = self._pick(self.input_ids, last)
        self._extend([token], [processed], [last])
        self.last_token = token
        self.stats.record(0, 0)
        self.drafter.state.collect(self.capture, self.input_ids[0, 1:])  # every prompt position is verified

    def start_auto(self) -> None:
        """For ``tree_total_tokens="auto"``: time the target's forwards (once per target) and create the chooser; the
        first round drafts :data:`~hf_eagle3.core.tree_policy.AUTO_FIRST` nodes, each later one as many as the
        chooser picks from the previous round's candidates (read back with that round's planes)."""
        self.chooser = TreeSizeChooser(target_costs(self.model, self.input_ids, sizes=AUTO_SIZES))
        self.capture.clear()  # the timing forwards (run once per target) went through the hooks
        self.stopwatch = Stopwatch(self.device)
        self.next_total = min(AUTO_FIRST, auto_most_nodes(self.settings["depth"], self.settings["top_k"]))
        self.next_depth = self.settings["depth"]

    def draft_round(self) -> _Round:
        """Feed the draft the verified positions and draft this round's tree (the root alone when not drafting).
        No read-back: the size of an ``"auto"`` tree was chosen from the previous round's candidates."""
        chooser, drafter = self.chooser, self.drafter
        mark = self.stopwatch.mark if chooser is not None else (lambda: None)
        depth = min(self.settings["depth"], self.max_length - self.input_ids.shape[1] - 1)
        one = _Round(None, depth >= 1 and (chooser is None or chooser.draft_this_round()), depth, started=mark())
        if not one.drafting:  # a round without a tree defers the feed: the verified positions stay pending
            one.tree = DraftTree.root_only(self.input_ids[0, -1:].to(drafter.device))
            return one
        one.fed = drafter.state.num_pending
        drafter.feed()
        one.fed_at = mark()
        top_k, total = self.settings["top_k"], self.settings["total_tokens"]
        if chooser is not None:  # the candidates stay top_k wide, so that the next round's tree may grow
            total, depth = self.next_total, min(depth, self.next_depth)
        else:
            top_k, depth = min(top_k, total), min(depth, total)  # deeper or wider nodes could never be kept
        candidates = drafter.expand(depth, top_k)
        one.levels = candidates[4]
        one.tree = drafter.select(candidates, self.input_ids[0, -1:], total)
        if chooser is not None:
            one.ranking = Eagle3TreeDrafter.candidate_ranking(candidates)
        one.drafted_at = mark()
        return one

    def verify(self, tree: DraftTree) -> torch.Tensor:
        """
        One target forward over every node of ``tree`` (tree mask, depth-based positions).

        Args:
            tree (`DraftTree`): the round's tree.

        Returns:
            `torch.FloatTensor` [n, V]: the target's float32 logits at each node.
        """
        device = self.device
        mask = tree_attention_mask(self.cache, tree.ancestors.to(device), tree.depths.to(device), self.prefix_allowed,
                                   self.dtype)
        root_position = self.cache.get_seq_length() + self.position_offset
        outputs = self.model(
            input_ids=tree.tokens.to(device)[None],
            position_ids=(root_position + tree.depths.to(device))[None],
            attention_mask=mask,
            use_cache=True,
            **{self.cache_key: self.cache},
        )
        return outputs.logits[0, -tree.tokens.shape[0]:].to(dtype=torch.float32, device=device)

    def accept(self, one: _Round, logits: torch.Tensor) -> tuple[TreeWalk, list, int]:
        """
        The path the target accepts and the round's new tokens: the round's one read-back (the tree, the target's
        choices or sampling decisions, and for ``"auto"`` the candidates' path probabilities).

        Args:
            one (`_Round`): the round (its verified tree).
            logits (`torch.FloatTensor` [n, V]): what :meth:`verify` returned.

        Returns:
            ``(walk, new_tokens, tree_depth)``: the :class:`~hf_eagle3.core.acceptance.TreeWalk`, the accepted tokens and
            the bonus clipped to ``max_length`` and the first EOS, and the tree's depth.
        """
        planes, processed = round_planes(one.tree, logits, self.do_sample, self.processors)
        if self.chooser is not None:
            one.ended = self.stopwatch.mark()
        host, one.ranking = read_back(planes, one.ranking)
        walk, new_tokens = accept_row(host, logits, self.do_sample, processed,
                                      self._process if self.processors is not None else None,
                                      self.max_length - self.input_ids.shape[1], self.eos)
        return walk, new_tokens, max(host[2])

    def _process(self, path: list, row: torch.Tensor) -> torch.Tensor:
        """The logits processors at a tree node: ``row`` [1, V] with the node's own prefix (sequence, then ``path``)."""
        path = torch.tensor(path, dtype=self.input_ids.dtype, device=self.device)
        return self.processors(torch.cat([self.input_ids, path[None]], dim=-1), row)

    def commit(self, one: _Round, walk: TreeWalk, new_tokens: list, tree_depth: int) -> None:
        """
        Keep the accepted path in the target's cache, hand its features to the draft (pending until the next feed),
        extend the sequence and the outputs, and record the round.

        Args:
            one (`_Round`): the round's drafting record.
            walk (`TreeWalk`): the acceptance walk.
            new_tokens (`list[int]`): the round's new tokens (from :meth:`accept`).
            tree_depth (`int`): the tree's depth.
        """
        kept = len(new_tokens) - 1  # accepted drafts that stay
        keep = torch.tensor([0] + walk.accepted[:kept], dtype=torch.long, device=self.device)
        gather_cache(self.cache, keep, one.tree.tokens.shape[0])
        new = torch.tensor([new_tokens], dtype=self.input_ids.dtype, device=self.device)
        self.drafter.state.collect(self.capture, new[0], keep=keep)
        self._extend(new, walk.scores[: len(new_tokens)], walk.logits[: len(new_tokens)])
        self.last_token = new_tokens[-1]
        self.stats.record(tree_depth, kept)
        if self.chooser is not None:
            self._observe(one, len(walk.accepted))

    def _observe(self, one: _Round, accepted: int) -> None:
        """For ``"auto"``: record the round's acceptance and times with the chooser, and size the next round's tree
        from this round's candidates. The marks were all passed by the read-back; a round's time runs from the
        previous round's end mark to its own (so the read-back, the walk and the commit are counted once)."""
        chooser, watch = self.chooser, self.stopwatch
        round_seconds = watch.seconds(self.round_from if self.round_from is not None else one.started, one.ended)
        self.round_from = one.ended
        if one.drafting:
            self.next_total, self.next_depth = chooser.observe_tree_round(
                one.ranking, one.tree.tokens.shape[0] - 1, accepted, watch.seconds(one.started, one.drafted_at),
                max(1, one.levels), round_seconds, self.settings["depth"],
                feed_seconds=watch.seconds(one.started, one.fed_at), fed=one.fed)
        elif one.depth >= 1:
            chooser.update_plain(round_seconds)

    def _extend(self, new, scores: list, logits: list) -> None:
        """Append the new tokens to the sequence (and the padding mask), the streamer and the returned outputs."""
        new = torch.as_tensor(new, dtype=self.input_ids.dtype, device=self.device).view(1, -1)
        self.input_ids = torch.cat([self.input_ids, new], dim=-1)
        if self.prefix_allowed is not None:
            self.prefix_allowed = torch.cat([self.prefix_allowed, self.prefix_allowed.new_ones(new.shape[1])])
        if self.streamer is not None:
            self.streamer.put(new.cpu())
        if self.want_scores:
            self.scores_out += tuple(scores)
        if self.want_logits:
            self.logits_out += tuple(logits)

    def output(self):
        """What ``generate`` returns: the sequences, or a `GenerateDecoderOnlyOutput`."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        if self.streamer is not None:
            self.streamer.end()
        if self.generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=self.input_ids, scores=self.scores_out, logits=self.logits_out,
                                             **{self.cache_key: self.cache})
        return self.input_ids


def eagle3_tree_decoding(
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
    The decoding loop of EAGLE-3 with dynamic trees, run in place of ``GenerationMixin._assisted_decoding`` with the
    arguments Transformers prepared for it (see :func:`~hf_eagle3.core.generate_hook.loop_arguments`).

    Prefill with the target; then each round: the draft consumes the verified features and drafts a tree; the target
    verifies all its nodes in one forward (4D tree mask, depth-based positions); the longest path the target agrees
    with is accepted (greedy: child == argmax at its parent; sampling:
    :func:`~hf_eagle3.core.acceptance.sample_among_children`), plus the target's bonus token; both KV caches keep only the
    accepted path.

    Args:
        model: the target.
        call: the active EAGLE-3 call (draft, feature capture, tree settings); its ``generator`` is set to the
            call's statistics holder, which the generate hook publishes at the end.
        input_ids (`torch.LongTensor` [1, L]): the prompt.
        logits_processor (`LogitsProcessorList`): applied to the target's logits at every tree node, with the node's
            own prefix.
        stopping_criteria (`StoppingCriteriaList`): checked after each round.
        generation_config (`GenerationConfig`): ``do_sample``, ``max_length``, EOS, ``return_dict_in_generate``,
            ``output_scores``, ``output_logits``.
        streamer (`BaseStreamer`, *optional*): receives each round's new tokens.
        drafter_class (`type`, *optional*): the tree drafter class (default :class:`Eagle3TreeDrafter`).
        model_kwargs (`dict`): the prepared model kwargs (``cache``, ``attention_mask``, ``position_ids``, ...).

    Returns:
        `torch.LongTensor` of the sequences, or a `GenerateDecoderOnlyOutput` when ``return_dict_in_generate``.
    """
    call.generator = _TreeRun(call.draft)
    loop = _TreeLoop(model, call, drafter_class or Eagle3TreeDrafter, input_ids, logits_processor, stopping_criteria,
                     generation_config, streamer, model_kwargs)
    loop.prefill()
    if loop.settings["total_tokens"] == "auto":
        loop.start_auto()
    while not loop.finished():
        one = loop.draft_round()
        logits = loop.verify(one.tree)
        walk, new_tokens, tree_depth = loop.accept(one, logits)
        loop.commit(one, walk, new_tokens, tree_depth)
    return loop.output()
