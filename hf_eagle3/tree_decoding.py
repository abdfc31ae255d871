"""EAGLE-2-style dynamic draft trees for EAGLE-3 drafts: tree drafting, one-forward tree verification and lossless
tree sampling, run in place of Transformers' assisted-decoding loop.

``target.generate(ids, assistant_model=draft, tree_total_tokens=..., tree_depth=..., tree_top_k=...)`` (or the same
names on ``draft.generation_config``) selects it: the ``generate`` hook pops the settings, and the
``GenerationMixin._assisted_decoding`` hook installed here runs :func:`eagle3_tree_decoding` with the arguments
Transformers prepared (logits processors, stopping criteria, streamer, cache). See ``docs/trees.md``.

Core file: imports only torch/transformers and the other core files.
"""

from __future__ import annotations

import contextvars
import functools
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation import utils as _gen_utils

from .cost_model import ProbeSchedule, interpolate, smooth, synchronize, target_costs

try:  # sliding-window layers of hybrid models (Gemma 3, Mistral with a window, ...)
    from transformers.cache_utils import DynamicSlidingWindowLayer
except ImportError:  # pragma: no cover - older Transformers
    DynamicSlidingWindowLayer = None

TREE_HOOK_VERSION = 1
TREE_SETTINGS = ("tree_total_tokens", "tree_depth", "tree_top_k")
TREE_DEFAULTS = {"tree_total_tokens": 16, "tree_depth": 5, "tree_top_k": 4}
TREE_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
AUTO_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tree inputs (root included) whose target forward cost "auto" measures
AUTO_MAX_NODES = 63  # largest tree "auto" chooses (64 target inputs with the root)
AUTO_PRIOR_WEIGHT = 2.0  # pseudo-tokens of the prior calibration 1.0 (see `TreeSizeChooser`)
MIN_ROUNDS_BEFORE_SKIPPING = 8  # rounds with a tree measured before "auto" may decide to draft none
SKIP_BELOW = 0.9  # draft no tree while trees make less than this fraction of a plain step's tokens per second
SMOOTHING = 0.1  # exponential smoothing of the recent rounds' tokens and seconds
USUAL_FEED = 8  # positions a feed covers after a round with a tree (more: a feed deferred by rounds without one)


# ------------------------------------------------------------------------------------------------------ settings
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pop_tree_settings(target, draft, kwargs: dict) -> dict | None:
    """Pop the tree settings from ``generate``'s kwargs and resolve them; ``None`` when no tree was asked for.

    Precedence: ``generate`` kwargs, then a ``generation_config`` passed to ``generate``, then
    ``draft.generation_config``. Settings not given take :data:`TREE_DEFAULTS`.

    Args:
        target: the target model (its attention implementation is checked).
        draft: the EAGLE-3 draft.
        kwargs: the keyword arguments of ``generate`` (modified in place: the ``tree_*`` keys are removed).

    Returns:
        ``{"total_tokens": int | "auto", "depth": int, "top_k": int}`` or ``None``.

    Raises:
        ValueError: for settings out of range, or a target whose attention cannot take a tree mask.
    """
    given = {}
    for key in TREE_SETTINGS:
        value = kwargs.pop(key, None)
        if value is not None:
            given[key] = value
    for source in (kwargs.get("generation_config"), getattr(draft, "generation_config", None)):
        for key in TREE_SETTINGS:
            if key not in given and source is not None and getattr(source, key, None) is not None:
                given[key] = getattr(source, key)
    if not given:
        return None
    settings = {**TREE_DEFAULTS, **given}
    total, depth, top_k = settings["tree_total_tokens"], settings["tree_depth"], settings["tree_top_k"]
    if not (total == "auto" or (_is_int(total) and total >= 1)):
        raise ValueError(f"tree_total_tokens must be an int >= 1 or 'auto', got {total!r}")
    if not (_is_int(depth) and depth >= 1):
        raise ValueError(f"tree_depth must be an int >= 1, got {depth!r}")
    if not (_is_int(top_k) and top_k >= 1):
        raise ValueError(
            f"tree_top_k must be an int >= 1, got {top_k!r} (it is the number of children per tree node; generate's "
            "own `top_k` is the sampling filter and is unrelated)"
        )
    check_tree_target(target)
    return {"total_tokens": total, "depth": depth, "top_k": top_k}


def check_tree_target(target) -> None:
    """
    Raise ``ValueError`` unless ``target`` can verify a tree (decoder-only, ``sdpa`` or ``eager`` attention).

    Args:
        target (`PreTrainedModel`): the target model.
    """
    config = target.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("EAGLE-3 tree decoding supports decoder-only targets only.")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impls = {getattr(config, "_attn_implementation", None), getattr(text, "_attn_implementation", None)} - {None}
    bad = sorted(str(i) for i in impls if i not in TREE_ATTN_IMPLEMENTATIONS)
    if bad:
        raise ValueError(
            f"EAGLE-3 tree verification passes a 4D float attention mask, which attn_implementation={bad[0]!r} does "
            f"not take. Load the target with attn_implementation='sdpa' (or 'eager'), or drop the tree_* settings "
            "to use chain drafting."
        )


# ------------------------------------------------------------------------------------------------ target KV cache
def _sliding_layer(layer) -> bool:
    return DynamicSlidingWindowLayer is not None and type(layer) is DynamicSlidingWindowLayer


def check_tree_cache(cache) -> None:
    """
    Raise ``ValueError`` unless every layer of ``cache`` is one whose entries :func:`gather_cache` can select.

    Args:
        cache (`Cache`): the target's KV cache of this ``generate`` call.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"EAGLE-3 tree decoding keeps the accepted path of the target's KV cache with a gather, implemented for "
            f"DynamicCache (full and sliding-window layers); got {type(cache).__name__}. Use the default cache "
            "(no cache_implementation), or drop the tree_* settings to use chain drafting."
        )
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer and not _sliding_layer(layer):
            raise ValueError(
                f"EAGLE-3 tree decoding cannot gather cache layer {i} of type {type(layer).__name__} (supported: "
                "DynamicLayer, DynamicSlidingWindowLayer). Drop the tree_* settings to use chain drafting."
            )


def gather_cache(cache, keep: torch.LongTensor, num_new: int) -> None:
    """Keep, of the last ``num_new`` entries of every layer of ``cache``, only those at indices ``keep`` (in order).

    Entries before the last ``num_new`` are untouched. Sliding-window layers are then shrunk back to their window,
    as ``crop`` does after a chain round.

    Args:
        cache (`DynamicCache`): the target's cache right after a forward of ``num_new`` tokens.
        keep (`torch.LongTensor`): indices in ``[0, num_new)`` to keep (may be empty).
        num_new (`int`): tokens of that forward.
    """
    check_tree_cache(cache)
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue  # e.g. layers that share another layer's KV
        start = layer.keys.shape[-2] - num_new
        end = start + keep.numel()
        index = keep.to(layer.keys.device) + start
        # Move the kept entries to the front of the new block in place, then drop the rest (no copy of the prefix).
        layer.keys[..., start:end, :] = layer.keys.index_select(-2, index)
        layer.values[..., start:end, :] = layer.values.index_select(-2, index)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if _sliding_layer(layer):
            layer.cumulative_length += keep.numel() - num_new
            layer.crop(0)  # back to `sliding_window - 1` entries once past the window


def tree_attention_mask(cache, ancestors: torch.BoolTensor, depths: torch.LongTensor, prefix_allowed, dtype):
    """The 4D additive masks of a tree forward: each node sees the cached prefix and its ancestors (itself included).

    Sliding-window layers also hide the prefix entries outside the window. Built from each layer's
    ``get_mask_sizes`` before the forward, so the key length matches what the layer returns.

    Args:
        cache (`DynamicCache`): the target's cache (before the forward).
        ancestors (`torch.BoolTensor` [n, n]): ``ancestors[i, j]``: node j is node i or an ancestor of it.
        depths (`torch.LongTensor` [n]): depth of each node (the root, the sequence's last token, is 0).
        prefix_allowed (`torch.BoolTensor` [past] or `None`): False at padded prefix positions.
        dtype: the target's dtype.

    Returns:
        A float tensor [1, 1, n, kv_length] (0 = attend, dtype min = masked); or, for models with both full and
        sliding layers, ``{"full_attention": ..., "sliding_attention": ...}``.
    """
    n = ancestors.shape[0]
    device = ancestors.device
    past = cache.get_seq_length()
    query = past + depths  # cache index of each node
    masks = {}
    for layer in cache.layers:
        kind = "sliding_attention" if _sliding_layer(layer) else "full_attention"
        if kind in masks:
            if kind == "sliding_attention" and layer.sliding_window != masks["_window"]:
                raise ValueError("EAGLE-3 tree decoding needs one sliding window size across the target's layers.")
            continue
        if layer.is_initialized:
            kv_length, kv_offset = layer.get_mask_sizes(n)
        else:
            kv_length, kv_offset = past + n, 0
        columns = kv_offset + torch.arange(kv_length - n, device=device)
        allowed_prefix = torch.ones(n, kv_length - n, dtype=torch.bool, device=device)
        allowed_tree = ancestors
        if prefix_allowed is not None:
            allowed_prefix = allowed_prefix & prefix_allowed.to(device)[columns][None]
        if kind == "sliding_attention":
            window = layer.sliding_window
            masks["_window"] = window
            allowed_prefix = allowed_prefix & (columns[None] > query[:, None] - window)
            allowed_tree = allowed_tree & (depths[:, None] - depths[None] < window)
        allowed = torch.cat([allowed_prefix, allowed_tree], dim=-1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        masks[kind] = mask[None, None]
    masks.pop("_window", None)
    return next(iter(masks.values())) if len(masks) == 1 else masks


# ------------------------------------------------------------------------------------------------ tree drafting
@dataclass
class DraftTree:
    """A draft tree, in an order where parents come before their children. Node 0 is the root: the last token of the
    sequence (verified, not drafted).

    Args:
        tokens (`torch.LongTensor` [n]): target-vocabulary ids; ``tokens[0]`` is the root's.
        parents (`torch.LongTensor` [n]): parent of each node (``parents[0] == 0``).
        depths (`torch.LongTensor` [n]): depth of each node (root 0).
        ancestors (`torch.BoolTensor` [n, n]): ``ancestors[i, j]``: j is i or an ancestor of i.
        scores (`torch.FloatTensor` [n - 1] or `None`): cumulative draft log-probability of nodes 1..n-1 (``None``
            for trees built without drafting: a lone root, or the chains that time the target).
        max_depth (`int`): an upper bound of the tree's depth (the number of expansion levels used).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    ancestors: torch.BoolTensor
    scores: torch.FloatTensor
    max_depth: int


class Eagle3TreeDrafter:
    r"""
    Drafts EAGLE-2-style dynamic trees with an EAGLE-3 draft.

    Each round the draft first consumes the verified positions' target features (:meth:`feed`), then
    :meth:`expand` grows candidates level by level: the ``top_k`` most likely children of each of the ``top_k``
    frontier nodes, scored by cumulative log-probability; the next frontier is the ``top_k`` best of them. All the
    frontier nodes of one level go through the draft in one forward, each attending over the real cache and its own
    ancestors (tree mask, depth-based positions). :meth:`select` keeps the best ``total_tokens`` candidates, a set
    closed under parents. The draft KV entries of the tree are dropped at the next :meth:`feed`.

    Args:
        draft (`Eagle3DraftModel`): the draft, bound to the target.
    """

    def __init__(self, draft):
        from .logits_process import Eagle3D2TLogitsProcessor
        from .modeling_eagle3 import Eagle3KVCache

        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.d2t = Eagle3D2TLogitsProcessor(draft.d2t, draft.config.vocab_size)
        self.cache = Eagle3KVCache()
        self.fed = 0  # positions whose target features are in the draft cache
        self._hidden = None  # pre-norm output at the last fed position [1, 1, H]
        self._logits = None  # draft scores there [1, draft_vocab]

    def feed(self, features: torch.Tensor, tokens: torch.LongTensor) -> None:
        """
        Consume verified positions (dropping the draft KV entries of the previous tree first).

        Args:
            features (`torch.Tensor` [1, f, 3T]): target features of positions ``fed .. fed + f - 1``.
            tokens (`torch.LongTensor` [f]): the token that follows each of those positions.
        """
        self.cache.crop(self.fed)
        f = tokens.shape[-1]
        out = self.draft(
            input_ids=tokens.view(1, f).to(self.device),
            target_features=features,
            position_ids=torch.arange(self.fed, self.fed + f, device=self.device)[None],
            cache=self.cache,
            logits_to_keep=1,
        )
        self.fed += f
        self._hidden, self._logits = out.hidden_states[:, -1:], out.logits[:, -1]

    def expand(self, depth: int, top_k: int, should_expand=None):
        """
        Grow the candidates of this round for ``depth`` levels (``depth - 1`` draft forwards of ``top_k`` tokens).

        Args:
            depth (`int`): levels of the tree (>= 1).
            top_k (`int`): children per expanded node, and frontier width (capped at the draft vocabulary).
            should_expand (`Callable[[torch.FloatTensor], bool]`, *optional*): called before each further level with
                the frontier's cumulative log-probabilities; ``False`` stops the expansion there (fewer levels).

        Returns:
            ``(scores, draft_ids, parents, depths, levels)``: the first four over the candidates 1..M in level order
            (``parents`` are candidate numbers, 0 = the root); ``levels`` the number of levels (an int).
        """
        self.cache.crop(self.fed)
        real = self.fed
        logp = torch.log_softmax(self._logits[0].float(), dim=-1)
        k = min(top_k, logp.shape[-1])
        scores, ids = logp.topk(k)
        all_scores, all_ids = [scores], [ids]
        all_parents = [torch.zeros(k, dtype=torch.long, device=self.device)]
        all_depths = [torch.ones(k, dtype=torch.long, device=self.device)]
        frontier = torch.arange(1, k + 1, device=self.device)  # candidate numbers of the frontier
        hidden = self._hidden.expand(1, k, self._hidden.shape[-1])
        eye = torch.eye(k, dtype=torch.bool, device=self.device)
        ancestors = torch.zeros(k, 0, dtype=torch.bool, device=self.device)  # frontier x earlier tree entries
        base = 1 + k  # candidate number of the next level's first child
        for level in range(1, depth):
            if should_expand is not None and not should_expand(scores):
                break
            mask = torch.cat([torch.ones(k, real, dtype=torch.bool, device=self.device), ancestors, eye], dim=-1)
            out = self.draft(
                input_ids=self.d2t.map_tokens(ids)[None],
                hidden_states=hidden,
                position_ids=torch.full((1, k), real - 1 + level, device=self.device),
                cache=self.cache,
                attention_mask=mask,
            )
            child_logp, child_ids = torch.log_softmax(out.logits[0].float(), dim=-1).topk(k, dim=-1)
            child_scores = (scores[:, None] + child_logp).flatten()
            child_ids = child_ids.flatten()
            all_scores.append(child_scores)
            all_ids.append(child_ids)
            all_parents.append(frontier.repeat_interleave(k))
            all_depths.append(torch.full((k * k,), level + 1, dtype=torch.long, device=self.device))
            if level == depth - 1:
                break
            scores, best = child_scores.topk(k)
            slot = best // k  # parent's place in the current frontier
            frontier, ids = base + best, child_ids[best]
            hidden = out.hidden_states[:, slot]
            ancestors = torch.cat([ancestors[slot], eye[slot]], dim=-1)
            base += k * k
        return torch.cat(all_scores), torch.cat(all_ids), torch.cat(all_parents), torch.cat(all_depths), len(all_ids)

    @staticmethod
    def ranking_key(scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """
        Ranking of candidates: the cumulative log-probability, with a tiny per-depth penalty so that a child always
        ranks strictly below its parent (ties, and ``-inf`` scores, would otherwise break the closure under parents).

        Args:
            scores (`torch.FloatTensor` [M]): cumulative log-probabilities of the candidates.
            depths (`torch.LongTensor` [M]): their depths.

        Returns:
            `torch.DoubleTensor` [M]: higher is better.
        """
        return scores.double().clamp(min=-1e6) - 1e-9 * depths.double()

    def select(self, candidates, root_token: torch.LongTensor, total_tokens: int) -> DraftTree:
        """Keep the ``total_tokens`` best candidates (closed under parents) and build the tree around the root.

        Args:
            candidates: what :meth:`expand` returned.
            root_token (`torch.LongTensor` [1]): the sequence's last token.
            total_tokens (`int`): nodes to keep besides the root (at most the number of candidates).
        """
        scores, ids, parents, depths, levels = candidates
        key = self.ranking_key(scores, depths)
        n = min(int(total_tokens), key.shape[0])
        chosen = key.topk(n).indices.sort().values  # level order: parents first
        number = torch.zeros(key.shape[0] + 1, dtype=torch.long, device=self.device)
        number[chosen + 1] = torch.arange(1, n + 1, device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        tree_parents = torch.cat([zero, number[parents[chosen]]])
        tree_depths = torch.cat([zero, depths[chosen]])
        tokens = torch.cat([root_token.view(1).to(self.device), self.d2t.map_tokens(ids[chosen])])
        max_depth = min(n, levels)
        ancestors = torch.eye(n + 1, dtype=torch.bool, device=self.device)
        rows, node = torch.arange(n + 1, device=self.device), torch.arange(n + 1, device=self.device)
        for _ in range(max_depth):
            node = tree_parents[node]
            ancestors[rows, node] = True
        return DraftTree(tokens, tree_parents, tree_depths, ancestors, scores[chosen], max_depth)


# The tree drafter class of this context (None: Eagle3TreeDrafter); set by candidate_generator.use_drafting.
_TREE_DRAFTER_CLASS: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_tree_drafter_class", default=None)


# ------------------------------------------------------------------------------------------------ "auto" tree size


class TreeSizeChooser:
    r"""
    Chooses ``total_tokens`` each round for ``tree_total_tokens="auto"``: the size that maximises expected tokens per
    second, ``(1 + c * sum of the path probabilities of the N best candidates) / (draft time + target time(N + 1))``.

    The draft's own path probability of a node (``exp`` of its cumulative log-probability) estimates the chance that
    the target accepts it (the calibration EAGLE-2 builds on), so the sum over the tree estimates the accepted
    length. ``c`` corrects that estimate with the acceptance seen so far: ``(accepted + w) / (predicted + w)``, prior
    1.0 with weight ``w`` = :data:`AUTO_PRIOR_WEIGHT` tokens. The target's forward time for 1 to 64 tokens is measured
    once per target (and device / dtype) on the machine at hand, and interpolated linearly.

    Args:
        costs (`dict[int, float]`): seconds of a target forward of n tokens, for a few n.
    """

    def __init__(self, costs: dict):
        self.costs = dict(costs)
        self.accepted = 0.0
        self.predicted = 0.0
        self.draft_seconds = 0.0
        self.draft_forwards = 0
        self.round_seconds = 0.0
        self.rounds = 0
        self.recent_tokens = None  # smoothed tokens and seconds of the recent rounds with a tree
        self.recent_seconds = None
        self.plain_seconds = None  # smoothed seconds of the recent rounds without one
        self.usual_feed = None  # smoothed seconds of feeding the draft the positions of one round
        self.probes = ProbeSchedule()

    def target_seconds(self, n: int) -> float:
        """
        Interpolated (linearly extrapolated beyond the largest measured size) forward time for ``n`` tokens.

        Args:
            n (`int`): tokens of the target forward (the root included).
        """
        return interpolate(self.costs, n)

    def draft_this_round(self) -> bool:
        """
        Whether to draft a tree this round: while the recent rounds with a tree made clearly fewer tokens per second
        than a plain target step would (below :data:`SKIP_BELOW` of it; the step measured, or the one-token forward
        time before any), draft nothing but the probes of a :class:`~hf_eagle3.cost_model.ProbeSchedule`.
        """
        if self.rounds < MIN_ROUNDS_BEFORE_SKIPPING:
            return True  # too little measured yet
        plain = self.plain_seconds if self.plain_seconds is not None else self.target_seconds(1)
        if self.recent_tokens / self.recent_seconds * plain >= SKIP_BELOW:
            self.probes.drafting()
            return True
        return self.probes.probe_now()

    def update_plain(self, seconds: float) -> None:
        """
        Record a round without a tree.

        Args:
            seconds (`float`): its wall time.
        """
        self.plain_seconds = smooth(self.plain_seconds, seconds, SMOOTHING)

    @property
    def calibration(self) -> float:
        """Observed over predicted acceptance, shrunk towards 1.0."""
        return (self.accepted + AUTO_PRIOR_WEIGHT) / (self.predicted + AUTO_PRIOR_WEIGHT)

    def choose(self, path_probs: list[float]) -> int:
        """
        Return the number of drafted nodes N >= 1 with the most expected tokens per second.

        Args:
            path_probs (`list[float]`): the candidates' path probabilities, sorted in decreasing order.
        """
        best, best_rate, expected, c = 1, -1.0, 1.0, self.calibration
        draft = self.draft_seconds / self.rounds if self.rounds else 0.0
        for n, p in enumerate(path_probs[:AUTO_MAX_NODES], start=1):
            expected += c * p
            rate = expected / (draft + self.target_seconds(n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def should_expand(self, frontier_logp: torch.Tensor) -> bool:
        """
        Whether drafting one more tree level pays for itself: the children of the frontier can add at most
        ``c * sum(exp(frontier_logp))`` expected tokens (a child's path probability never exceeds its parent's), for
        the cost of one draft forward; expand while that beats the tokens per second of the rounds so far.

        Args:
            frontier_logp (`torch.FloatTensor`): cumulative log-probabilities of the nodes the level would expand.
        """
        if not self.rounds or not self.draft_forwards or self.round_seconds <= 0:
            return True  # nothing measured yet
        level_seconds = self.draft_seconds / self.draft_forwards
        rate = (self.rounds + self.accepted) / self.round_seconds  # tokens per second so far
        gain = self.calibration * float(frontier_logp.float().exp().sum())
        return gain > level_seconds * rate

    def update(self, predicted: float, accepted: int, draft_seconds: float, draft_forwards: int = 1,
               round_seconds: float | None = None, feed_seconds: float = 0.0, fed: int = 1) -> None:
        """
        Record one round.

        Args:
            predicted (`float`): the chosen tree's predicted accepted length (sum of its path probabilities).
            accepted (`int`): drafted tokens the target accepted.
            draft_seconds (`float`): time spent drafting the round.
            draft_forwards (`int`): draft forwards in that time (the feed plus one per expanded level).
            round_seconds (`float`, *optional*): the whole round (drafting and verification); default
                ``draft_seconds``.
            feed_seconds (`float`): the part of it spent feeding the draft.
            fed (`int`): positions fed. A feed after rounds without a tree covers many positions at once: for the
                decision to draft (:meth:`draft_this_round`) the round is counted with a usual feed instead.
        """
        seconds = draft_seconds if round_seconds is None else round_seconds
        if fed <= USUAL_FEED:
            self.usual_feed = smooth(self.usual_feed, feed_seconds, SMOOTHING)
        else:  # the prompt's feed, or one deferred by rounds without a tree: counted as a usual one
            seconds += (self.usual_feed or 0.0) - feed_seconds
        self.predicted += predicted
        self.accepted += accepted
        self.draft_seconds += draft_seconds
        self.draft_forwards += draft_forwards
        self.round_seconds += seconds
        self.rounds += 1
        weight = max(SMOOTHING, 1.0 / self.rounds)  # a running mean first, then exponential smoothing
        self.recent_tokens = smooth(self.recent_tokens, accepted + 1.0, weight)
        self.recent_seconds = smooth(self.recent_seconds, seconds, weight)


# ------------------------------------------------------------------------------------------------ verification
def sample_among_children(probs: torch.Tensor, child_tokens: list[int]):
    """Multi-candidate speculative sampling at one tree node (recursive rejection sampling, deterministic drafts).

    Try the children in order: accept child x with probability ``p(x)`` under the current (renormalised) ``p``; on
    rejection set ``p(x) = 0`` and renormalise. If every child is rejected, sample from the residual. The returned
    token is distributed exactly as ``probs`` (see docs/trees.md).

    Args:
        probs (`torch.FloatTensor` [V]): the target's distribution at the node (after its logits processors).
        child_tokens (`list[int]`): the children's tokens, distinct, in the order to try them.

    Returns:
        ``(index, None)`` when child ``index`` is accepted, else ``(None, token)`` with the residual sample.
    """
    if child_tokens:
        index = torch.tensor(child_tokens, device=probs.device)
        p_children = probs[index].double().tolist()
        uniforms = torch.rand(len(child_tokens), dtype=torch.float64).tolist()
        remaining = 1.0
        for i, (p, u) in enumerate(zip(p_children, uniforms)):
            if remaining > 0 and u * remaining < p:
                return i, None
            remaining -= p
        residual = probs.clone()
        residual[index] = 0
        if residual.sum() > 0:
            probs = residual
    return None, int(torch.multinomial(probs / probs.sum(), 1))


class _TreeRun:
    """Per-call state published at the end of ``generate`` (``finish`` is called by the generate hook)."""

    def __init__(self, draft):
        from .candidate_generator import Eagle3Stats

        self.draft = draft
        self.stats = Eagle3Stats()

    def finish(self):
        """Publish the statistics on the draft (``last_stats`` / ``cumulative_stats``) and return them."""
        self.draft._record_stats(self.stats)
        return self.stats


def eagle3_tree_decoding(
    model,
    call,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    r"""
    The decoding loop of EAGLE-3 with dynamic trees; takes ``GenerationMixin._assisted_decoding``'s arguments.

    Prefill with the target; then each round: the draft consumes the verified features and drafts a tree; the target
    verifies all its nodes in one forward (4D tree mask, depth-based positions); the longest path the target agrees
    with is accepted (greedy: child == argmax at its parent; sampling: :func:`sample_among_children`), plus the
    target's bonus token; both KV caches keep only the accepted path.

    Args:
        model: the target.
        call: the active EAGLE-3 call (draft, feature capture, tree settings).
        input_ids (`torch.LongTensor` [1, L]): the prompt.
        logits_processor (`LogitsProcessorList`): applied to the target's logits at every tree node, with the node's
            own prefix.
        stopping_criteria (`StoppingCriteriaList`): checked after each round.
        generation_config (`GenerationConfig`): ``do_sample``, ``max_length``, EOS, ``return_dict_in_generate``,
            ``output_scores``, ``output_logits``.
        streamer (`BaseStreamer`, *optional*): receives each round's new tokens.
        model_kwargs: the prepared model kwargs (``cache``, ``attention_mask``, ``position_ids``, ...).

    The other arguments of ``_assisted_decoding`` (``synced_gpus``, ``inputs_tensor``, ``assistant_model``,
    ``assistant_tokenizer``, ``tokenizer``) are accepted and ignored.

    Returns:
        `torch.LongTensor` of the sequences, or a `GenerateDecoderOnlyOutput` when ``return_dict_in_generate``.
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    settings = call.tree
    draft, capture = call.draft, call.capture
    run = _TreeRun(draft)
    call.generator = run
    if input_ids.shape[0] != 1:
        raise ValueError(f"EAGLE-3 tree decoding handles one sequence at a time, got a batch of {input_ids.shape[0]}.")
    if input_ids.shape[1] == 0:
        raise ValueError("EAGLE-3 tree decoding needs `input_ids` (a prompt given only as `inputs_embeds` is not "
                         "supported).")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("EAGLE-3 tree decoding does not return attentions or hidden states; drop output_attentions / "
                         "output_hidden_states (scores and logits are supported).")
    cache_key = "cache" if model_kwargs.get("cache") is not None else "past_key_values"  # renamed in 5.2x
    cache = model_kwargs.get(cache_key)
    if cache is None or not generation_config.use_cache:
        raise ValueError("EAGLE-3 tree decoding requires a cache (use_cache=True).")
    check_tree_cache(cache)
    if hasattr(cache, "activate_past_recording"):  # sliding layers keep what a rollback needs until the gather
        cache.activate_past_recording()

    do_sample = bool(generation_config.do_sample)
    max_length = generation_config.max_length
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = set() if eos is None else set(eos.view(-1).tolist())
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores_out = () if want_scores else None
    logits_out = () if want_logits else None
    processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
    device = input_ids.device
    dtype = model.dtype

    drafter = (_TREE_DRAFTER_CLASS.get() or Eagle3TreeDrafter)(draft)
    # Padding of the prompt (batch of one with a 2D mask that has zeros) stays masked in the tree forwards.
    attention_mask = model_kwargs.get("attention_mask")
    prefix_allowed = None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        prefix_allowed = attention_mask[0].bool()
    position_ids = model_kwargs.get("position_ids")
    position_offset = 0 if position_ids is None else int(position_ids[0, -1]) - (input_ids.shape[1] - 1)

    def pick(seq: torch.LongTensor, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        scores = processors(seq, logits) if processors is not None else logits
        if do_sample:
            return int(torch.multinomial(scores.softmax(-1)[0], 1)), scores
        return int(scores[0].argmax()), scores

    # ---- prefill
    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    if "logits_to_keep" in model_inputs:
        model_inputs["logits_to_keep"] = 1
    outputs = model(**model_inputs)
    check_tree_cache(cache)  # layers are created lazily by the first forward
    cache.crop(0)  # sliding layers back to their window
    last = outputs.logits[:, -1].to(dtype=torch.float32, device=device)
    token, processed = pick(input_ids, last)
    new = torch.tensor([[token]], device=device)
    if want_scores:
        scores_out += (processed,)
    if want_logits:
        logits_out += (last,)
    input_ids = torch.cat([input_ids, new], dim=-1)
    if prefix_allowed is not None:
        prefix_allowed = torch.cat([prefix_allowed, prefix_allowed.new_ones(1)])
    if streamer is not None:
        streamer.put(new.cpu())
    run.stats.record(0, 0)
    pending = (capture.features(drafter.device, drafter.dtype), input_ids[0, 1:])
    capture.clear()
    del outputs, model_inputs

    def verify(tree: DraftTree):
        mask = tree_attention_mask(cache, tree.ancestors.to(device), tree.depths.to(device), prefix_allowed, dtype)
        root_position = cache.get_seq_length() + position_offset
        return model(
            input_ids=tree.tokens.to(device)[None],
            position_ids=(root_position + tree.depths.to(device))[None],
            attention_mask=mask,
            use_cache=True,
            **{cache_key: cache},
        )

    chooser = None
    if settings["total_tokens"] == "auto":
        chooser = TreeSizeChooser(target_costs(model, input_ids, sizes=AUTO_SIZES))
        capture.clear()  # the timing forwards (run once per target) went through the hooks

    unfinished = not bool(stopping_criteria(input_ids, scores_out).all())
    while unfinished:
        seq_len = input_ids.shape[1]
        depth = min(settings["depth"], max_length - seq_len - 1)
        started = time.perf_counter()
        drafting = depth >= 1 and (chooser is None or chooser.draft_this_round())
        predicted = 0.0
        if drafting:
            fed = pending[1].shape[0]
            drafter.feed(*pending)  # a round without a tree defers the feed: the features wait in ``pending``
            pending = None
            if chooser is not None:
                synchronize(drafter.device)
                feed_seconds = time.perf_counter() - started
            top_k, total = settings["top_k"], settings["total_tokens"]
            if total != "auto":
                top_k, depth = min(top_k, total), min(depth, total)  # deeper or wider nodes could never be kept
            candidates = drafter.expand(depth, top_k, chooser.should_expand if chooser is not None else None)
            if chooser is not None:
                key = Eagle3TreeDrafter.ranking_key(candidates[0], candidates[3]).sort(descending=True).values
                probs = key.exp().tolist()
                total = chooser.choose(probs)
                predicted = sum(probs[:total])
            tree = drafter.select(candidates, input_ids[0, -1:], total)
        else:
            zero = torch.zeros(1, dtype=torch.long, device=drafter.device)
            tree = DraftTree(input_ids[0, -1:].to(drafter.device), zero, zero,
                             torch.ones(1, 1, dtype=torch.bool, device=drafter.device), None, 0)
        if chooser is not None:
            synchronize(drafter.device)
        draft_seconds = time.perf_counter() - started

        outputs = verify(tree)
        n = tree.tokens.shape[0]
        logits = outputs.logits[0, -n:].to(dtype=torch.float32, device=device)
        rows = [tree.tokens, tree.parents, tree.depths]
        if processors is None and not do_sample:
            rows.append(logits.argmax(-1).to(tree.tokens.device))
        host = torch.stack(rows).tolist()
        tokens, parents = host[0], host[1]
        argmax = host[3] if len(host) > 3 else None
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)  # in decreasing draft score: the candidate order

        # Walk down the tree from the root along the children the target accepts.
        accepted, node, visited_scores, visited_logits = [], 0, [], []
        while True:
            row = logits[node : node + 1]
            if argmax is not None:
                scores, choice = row, argmax[node]
            else:
                path = torch.tensor([tokens[a] for a in accepted], dtype=input_ids.dtype, device=device)
                scores = processors(torch.cat([input_ids, path[None]], dim=-1), row) if processors is not None else row
                choice = None if do_sample else int(scores[0].argmax())
            visited_scores.append(scores)
            visited_logits.append(row)
            kids = children[node]
            if do_sample:
                index, bonus = sample_among_children(scores[0].softmax(-1), [tokens[c] for c in kids])
                if index is None:
                    break
                node = kids[index]
            else:
                match = [c for c in kids if tokens[c] == choice]
                if not match:
                    bonus = choice
                    break
                node = match[0]
            accepted.append(node)

        valid = [tokens[a] for a in accepted] + [bonus]
        valid = valid[: max_length - seq_len]
        for i, t in enumerate(valid):
            if t in eos:
                valid = valid[: i + 1]
                break
        kept = len(valid) - 1  # accepted drafts that stay
        keep = torch.tensor([0] + accepted[:kept], dtype=torch.long, device=device)
        gather_cache(cache, keep, n)
        features = capture.features(drafter.device, drafter.dtype)
        capture.clear()
        del outputs
        new = torch.tensor([valid], dtype=input_ids.dtype, device=device)
        verified = (features[:, keep.to(drafter.device)], new[0])
        pending = verified if pending is None else (torch.cat([pending[0], verified[0]], dim=1),
                                                   torch.cat([pending[1], verified[1]]))
        input_ids = torch.cat([input_ids, new], dim=-1)
        if prefix_allowed is not None:
            prefix_allowed = torch.cat([prefix_allowed, prefix_allowed.new_ones(len(valid))])
        if streamer is not None:
            streamer.put(new.cpu())
        if want_scores:
            scores_out += tuple(visited_scores[: len(valid)])
        if want_logits:
            logits_out += tuple(visited_logits[: len(valid)])
        run.stats.record(max(host[2]), kept)
        if chooser is not None and drafting:
            chooser.update(predicted, len(accepted), draft_seconds, draft_forwards=max(1, candidates[4]),
                           round_seconds=time.perf_counter() - started, feed_seconds=feed_seconds, fed=fed)
        elif chooser is not None and depth >= 1:
            chooser.update_plain(time.perf_counter() - started)
        unfinished = not bool(stopping_criteria(input_ids, scores_out).all())

    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores_out, logits=logits_out, **{cache_key: cache})
    return input_ids


# ------------------------------------------------------------------------------------------------------- the hook
def _tree_assisted_decoding(original):
    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        from .candidate_generator import _ACTIVE

        call = _ACTIVE.get()
        if call is None or getattr(call, "tree", None) is None:
            return original(self, *args, **kwargs)
        return eagle3_tree_decoding(self, call, *args, **kwargs)

    _assisted_decoding._hf_eagle3_tree_hook = TREE_HOOK_VERSION
    return _assisted_decoding


def install_tree_hook() -> None:
    """Route ``_assisted_decoding`` to :func:`eagle3_tree_decoding` while an EAGLE-3 tree call is active (idempotent).

    Every other assisted-decoding call runs Transformers' own loop unchanged.
    """
    mixin = _gen_utils.GenerationMixin
    if getattr(mixin._assisted_decoding, "_hf_eagle3_tree_hook", None) is None:
        mixin._assisted_decoding = _tree_assisted_decoding(mixin._assisted_decoding)
