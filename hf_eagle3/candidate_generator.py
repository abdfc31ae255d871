"""EAGLE-3 chain drafting as a Transformers ``CandidateGenerator``, and the ``generate`` hook that selects it.

Core file: imports only torch/transformers and the other core files (``tree_decoding`` at import time, the
others lazily inside functions, since ``modeling_eagle3`` imports this module).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation import candidate_generator as _cg
from transformers.generation import utils as _gen_utils

from .cost_model import Eagle3DraftLengthPolicy, measure_costs
from .tree_decoding import _TREE_DRAFTER_CLASS, TREE_SETTINGS, install_tree_hook, pop_tree_settings

CandidateGenerator = _cg.CandidateGenerator
HOOK_VERSION = 1
DRAFT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
SCHEDULES = ("constant", "heuristic", "heuristic_transient", "auto")
# Settings a draft checkpoint carries in its generation_config.json (chain and tree drafting).
SAVED_DRAFT_SETTINGS = DRAFT_SETTINGS + TREE_SETTINGS


def is_eagle3_draft(model) -> bool:
    """
    Whether ``model`` is an EAGLE-3 draft (from this package or a remote-code copy of it).

    Args:
        model (`object`): any object, typically the ``assistant_model`` passed to ``generate``.
    """
    return bool(getattr(type(model), "_is_eagle3_draft", False))


@dataclass
class Eagle3Stats:
    """Acceptance statistics of EAGLE-3 decoding, summed over drafting rounds (and calls, with ``+``).

    Args:
        num_drafts: rounds in which the draft proposed at least one token (one target forward each).
        drafted_per_position: ``drafted_per_position[i]`` = rounds that proposed a token at position i.
        accepted_per_position: ``accepted_per_position[i]`` = rounds whose token at position i was accepted.
        num_target_forwards: all target forwards, the prefill (which has no draft) included.
        num_output_tokens: tokens generated.
        num_rounds_without_draft: target forwards after a call's prefill that verified no draft (``"auto"`` chose
            not to draft, or ``max_length`` left no room).
    """

    num_drafts: int = 0
    drafted_per_position: list = field(default_factory=list)
    accepted_per_position: list = field(default_factory=list)
    num_target_forwards: int = 0
    num_output_tokens: int = 0
    num_rounds_without_draft: int = 0

    @property
    def num_draft_tokens(self) -> int:
        """Total drafted tokens."""
        return sum(self.drafted_per_position)

    @property
    def num_accepted_tokens(self) -> int:
        """Total accepted drafted tokens."""
        return sum(self.accepted_per_position)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafting round, counting the target's bonus token: ``1 + accepted / num_drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_draft_length(self) -> float:
        """Tokens drafted per drafting round."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list:
        """Fraction of drafting rounds whose token i was accepted (vLLM's "acceptance at token i")."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """
        Add one drafting round (one target forward).

        Args:
            drafted (`int`): tokens the round proposed (0 for the prefill, which has no draft).
            accepted (`int`): how many of them, from the first, the target accepted.
        """
        prefill = self.num_target_forwards == 0  # a call's statistics start with its prefill
        self.num_target_forwards += 1
        self.num_output_tokens += accepted + 1
        if drafted == 0:
            self.num_rounds_without_draft += 0 if prefill else 1
            return
        self.num_drafts += 1
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def __add__(self, other: "Eagle3Stats") -> "Eagle3Stats":
        """The statistics of both, summed (per-position lists padded with zeros to the longer one)."""
        n = max(len(self.drafted_per_position), len(other.drafted_per_position))

        def pad(x):
            return list(x) + [0] * (n - len(x))

        return Eagle3Stats(
            num_drafts=self.num_drafts + other.num_drafts,
            drafted_per_position=[a + b for a, b in zip(pad(self.drafted_per_position), pad(other.drafted_per_position))],
            accepted_per_position=[a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))],
            num_target_forwards=self.num_target_forwards + other.num_target_forwards,
            num_output_tokens=self.num_output_tokens + other.num_output_tokens,
            num_rounds_without_draft=self.num_rounds_without_draft + other.num_rounds_without_draft,
        )

    def to_dict(self) -> dict:
        """The statistics and the derived rates as a JSON-friendly dict."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_target_forwards": self.num_target_forwards,
            "num_output_tokens": self.num_output_tokens,
            "num_rounds_without_draft": self.num_rounds_without_draft,
            "mean_draft_length": self.mean_draft_length,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
        }

    def report(self) -> str:
        """The report of vLLM's EAGLE example: mean acceptance length, then acceptance at each token."""
        lines = ["-" * 50, f"mean acceptance length: {self.mean_acceptance_length:.2f}", "-" * 50]
        lines += [f"acceptance at token {i}: {r:.2f}" for i, r in enumerate(self.acceptance_rate_per_position)]
        return "\n".join(lines)

    def rounds_summary(self) -> str:
        """One line on the drafting rounds: how many drafted, their mean length, how many drafted nothing."""
        return (f"rounds drafted: {self.num_drafts} (mean k {self.mean_draft_length:.2f}), rounds without a draft: "
                f"{self.num_rounds_without_draft}")


class Eagle3CandidateGenerator(CandidateGenerator):
    r"""
    `CandidateGenerator` that proposes a chain of tokens with an EAGLE-3 draft fed by the target's own hidden states.

    The target's features arrive through an [`Eagle3FeatureCapture`] installed for the ``generate`` call. Each round
    the draft first consumes the features of the positions the target verified since it last ran (paired with the
    token that followed each), then drafts ``num_assistant_tokens`` tokens, feeding its own pre-norm output forward.
    The draft keeps its KV cache across rounds and crops the drafted (speculative) part at the start of the next round.

    The first round has no features yet, so it proposes nothing: the target's prefill produces the first token.

    Args:
        draft (`Eagle3DraftModel`): the draft, already bound to the target.
        capture (`Eagle3FeatureCapture`): hooks on the target.
        input_ids (`torch.LongTensor`): the prompt.
        generation_config (`GenerationConfig`): the target's generation config for this call.
        logits_processor (`LogitsProcessorList`): the target's processors; applied to the draft's scores (over the
            target vocabulary) when sampling, so that the returned candidate logits are the distribution the
            candidates were sampled from.
        num_assistant_tokens (`int`): draft tokens per round (initial value for the heuristic schedules, the longest
            draft for ``"auto"``).
        num_assistant_tokens_schedule (`str`): ``"constant"``, ``"heuristic"`` (+2 after a fully accepted round,
            -1 otherwise, kept on the draft's generation config after the call), ``"heuristic_transient"`` (same,
            not kept) or ``"auto"`` (each round the length, 0 included, with the most expected tokens per second
            under the round costs measured on this machine and the acceptance seen so far; see
            :class:`~hf_eagle3.cost_model.Eagle3DraftLengthPolicy`).
        assistant_confidence_threshold (`float`): stop drafting in a round once the draft's probability of its own
            token falls below this (0 disables it; when set, each draft step reads one value back from the device).
        target (`PreTrainedModel`, *optional*): the target, whose forwards ``"auto"`` times once (required for it).
    """

    def __init__(
        self,
        draft,
        capture,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        logits_processor=None,
        num_assistant_tokens: int = 5,
        num_assistant_tokens_schedule: str = "constant",
        assistant_confidence_threshold: float | None = 0.0,
        target=None,
    ):
        from .logits_process import Eagle3D2TLogitsProcessor
        from .modeling_eagle3 import Eagle3KVCache

        if num_assistant_tokens_schedule not in SCHEDULES:
            raise ValueError(
                f"num_assistant_tokens_schedule={num_assistant_tokens_schedule!r}: EAGLE-3 supports "
                f"{', '.join(repr(s) for s in SCHEDULES)}."
            )
        if int(num_assistant_tokens) < 1:
            raise ValueError(f"num_assistant_tokens must be >= 1, got {num_assistant_tokens}")
        if num_assistant_tokens_schedule == "auto" and target is None:
            raise ValueError("num_assistant_tokens_schedule='auto' needs the target (to time its forwards).")
        self.draft = draft
        self.capture = capture
        self.target = target
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.d2t = Eagle3D2TLogitsProcessor(draft.d2t, draft.config.vocab_size)
        self.logits_processor = logits_processor if logits_processor is not None else []
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.num_assistant_tokens = int(num_assistant_tokens)
        self.schedule = num_assistant_tokens_schedule
        self.confidence_threshold = float(assistant_confidence_threshold or 0.0)
        self.cache = Eagle3KVCache()
        self.stats = Eagle3Stats()
        self.policy: Eagle3DraftLengthPolicy | None = None  # created on the first round of "auto"
        self._fed = 0  # positions whose real (target) features are in the draft cache
        self._pending = []  # verified features not fed yet (rounds that drafted nothing defer the feed)
        self._last_len = input_ids.shape[1]  # length of the sequence handed to the target last round
        self._last_k = 0  # tokens drafted last round
        self._last_feed = 0  # positions fed last round
        self._round_start = None  # wall clock at the start of the last round ("auto" measures rounds)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """
        Fetches the candidates to be tried for the current input.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, sequence_length)`): the sequence so far.

        Return:
            `(candidate_input_ids, candidate_logits)`: the sequence followed by the drafted tokens, and (when
            sampling) the processed draft scores over the target vocabulary `(1, k, vocab_size)`, else `None`.
        """
        now = time.perf_counter()
        if self.policy is not None and self._round_start is not None:
            self.policy.observe_time(self._last_k, now - self._round_start, feed=self._last_feed)
        self._round_start = now
        cur_len = input_ids.shape[1]
        self._collect_features(cur_len)
        self._last_len, self._last_k, self._last_feed = cur_len, 0, 0
        if not self._pending and self._fed == 0:  # first round: the target has not run yet
            if self.schedule == "auto" and self.policy is None:
                self.policy = self._make_policy(input_ids)
                self._round_start = None  # the timing forwards are not part of a round
            return input_ids, None
        k = min(self.num_assistant_tokens, self.max_length - cur_len - 1)
        if self.policy is not None:
            k = self.policy.choose(k, feed=cur_len - 1 - self._fed)
        if k <= 0:  # max_length reached, or "auto" drafts nothing: a plain target step, the feed waits
            return input_ids, None
        ids = input_ids.to(self.device)
        self._last_feed = cur_len - 1 - self._fed
        out = self._feed(ids)
        tokens, scores = [], []
        seq = ids
        for step in range(k):
            token, processed = self._select(seq, out.logits[:, -1])
            tokens.append(token)
            if processed is not None:
                scores.append(processed)
            seq = torch.cat([seq, token[:, None]], dim=-1)
            if self.confidence_threshold > 0 and step < k - 1:
                probs = (processed if processed is not None else self.d2t(seq, out.logits[:, -1].float())).softmax(-1)
                if probs[0, token[0]].item() < self.confidence_threshold:
                    break
            if step == k - 1:
                break
            out = self.draft(
                input_ids=token[:, None],
                hidden_states=out.hidden_states[:, -1:],
                position_ids=torch.full((1, 1), cur_len - 1 + step, device=self.device),
                cache=self.cache,
                logits_to_keep=1,
            )
        self._last_k = len(tokens)
        candidate_logits = torch.stack(scores, dim=1) if scores else None
        return seq, candidate_logits

    def _collect_features(self, cur_len: int) -> None:
        """Keep the verified part of the target's last forward (positions ``< cur_len - 1``) for the next feed."""
        features = self.capture.features(self.device, self.dtype)
        if features is None:
            return
        self.capture.clear()
        # The target's last forward covered positions [start, previous length + previous k).
        start = self._last_len + self._last_k - features.shape[1]
        known = self._fed + sum(f.shape[1] for f in self._pending)
        if start != known:
            raise RuntimeError(
                f"EAGLE-3 feature bookkeeping lost track (target forward started at {start}, draft has {known} "
                "positions). Was the target called outside generate during the call?"
            )
        if cur_len - 1 > start:
            self._pending.append(features[:, : cur_len - 1 - start])

    def _feed(self, ids: torch.LongTensor):
        """Crop the draft's speculative cache entries and run it over the pending verified positions."""
        cur_len = ids.shape[1]
        features = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending, dim=1)
        self._pending = []
        self.cache.crop(self._fed)
        out = self.draft(
            input_ids=ids[:, self._fed + 1 : cur_len],
            target_features=features,
            position_ids=torch.arange(self._fed, cur_len - 1, device=self.device)[None],
            cache=self.cache,
            logits_to_keep=1,
        )
        self._fed = cur_len - 1
        return out

    def _make_policy(self, input_ids: torch.LongTensor) -> Eagle3DraftLengthPolicy:
        """The ``"auto"`` policy: measured costs (once per process) and the acceptance carried from the last call."""
        costs = measure_costs(self.target, self.draft, input_ids)
        self.capture.clear()  # the timing forwards ran through the hooks
        return Eagle3DraftLengthPolicy.from_carried(costs, getattr(self.draft, "_draft_length_state", None))

    def _select(self, seq: torch.LongTensor, draft_scores: torch.FloatTensor):
        """Pick the next draft token (target id) from draft-vocabulary scores; return it and the processed scores."""
        if not self.do_sample and not self.logits_processor:
            return self.d2t.map_tokens(draft_scores.argmax(-1)), None
        scores = self.d2t(seq, draft_scores.float())
        for processor in self.logits_processor:  # greedy too, as Transformers' assisted decoding does
            scores = processor(seq, scores)
        if not self.do_sample:
            return scores.argmax(-1), None
        token = torch.multinomial(scores.softmax(-1), num_samples=1)[:, 0]
        return token, scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """
        Records the round's acceptance and adapts the draft length for the heuristic schedules.

        Args:
            input_ids (`torch.LongTensor`): the sequence after this round.
            scores (`torch.FloatTensor`): the target's processed scores of this round.
            num_matches (`int`): how many drafted tokens were accepted.
        """
        num_matches = int(num_matches)
        self.stats.record(self._last_k, num_matches)
        if self.policy is not None:
            self.policy.observe(self._last_k, num_matches)
        if self._last_k and self.schedule in ("heuristic", "heuristic_transient"):
            if num_matches == self._last_k:
                self.num_assistant_tokens += 2
            else:
                self.num_assistant_tokens = max(1, self.num_assistant_tokens - 1)

    def finish(self) -> Eagle3Stats:
        """End of the call: persist the heuristic draft length and publish the statistics on the draft."""
        if self.schedule == "heuristic":
            self.draft.generation_config.num_assistant_tokens = self.num_assistant_tokens
        if self.policy is not None:
            self.draft._draft_length_state = self.policy.carried()
        self.draft._record_stats(self.stats)
        return self.stats


# ------------------------------------------------------------------------------------------------- generate hook
@dataclass
class _Eagle3Call:
    draft: object
    capture: object
    settings: dict
    generator: Eagle3CandidateGenerator | None = None
    tree: dict | None = None  # tree settings (see tree_decoding.py); None = chain drafting


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_active_call", default=None)


def _user_draft_settings(kwargs: dict) -> dict:
    """Draft-length settings the user gave to this ``generate`` call (kwargs first, then a passed config)."""
    defaults = GenerationConfig()
    given = {}
    config = kwargs.get("generation_config")
    for key in DRAFT_SETTINGS:
        if kwargs.get(key) is not None:
            given[key] = kwargs[key]
        elif config is not None and getattr(config, key, None) is not None:
            if getattr(config, key) != getattr(defaults, key, None):
                given[key] = getattr(config, key)
    return given


def resolve_draft_settings(saved, given: dict) -> dict:
    """
    The draft-length settings of a call: the draft's saved ones, overridden by those given to ``generate``.

    A ``num_assistant_tokens`` given without a schedule means exactly that many tokens per round: it turns a saved
    ``"auto"`` schedule into ``"constant"``.

    Args:
        saved (`GenerationConfig`): the draft's generation config.
        given (`dict`): the settings the user gave to this call (see :data:`DRAFT_SETTINGS`).
    """
    settings = {key: getattr(saved, key, None) for key in DRAFT_SETTINGS}
    settings = {k: v for k, v in settings.items() if v is not None}
    settings.update(given)
    explicit_k = "num_assistant_tokens" in given and "num_assistant_tokens_schedule" not in given
    if explicit_k and settings.get("num_assistant_tokens_schedule") == "auto":
        settings["num_assistant_tokens_schedule"] = "constant"
    return settings


_GENERATOR_CLASS: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_generator_class", default=None)


@contextlib.contextmanager
def use_drafting(chain=None, tree=None):
    """
    Within the block, EAGLE-3 calls of ``generate`` draft with ``chain`` (a subclass of
    :class:`Eagle3CandidateGenerator` taking the same arguments) and/or ``tree`` (a subclass of
    :class:`~hf_eagle3.tree_decoding.Eagle3TreeDrafter`) instead of the defaults: how benchmarks swap in instrumented
    drafting (e.g. ``hf-eagle3 bench --oracle``) without another code path.

    Args:
        chain (`type`, *optional*): the chain candidate generator class.
        tree (`type`, *optional*): the tree drafter class.
    """
    tokens = [(_GENERATOR_CLASS, _GENERATOR_CLASS.set(chain)), (_TREE_DRAFTER_CLASS, _TREE_DRAFTER_CLASS.set(tree))]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def _batch_size(args, kwargs) -> int | None:
    for value in list(args[:1]) + [kwargs.get("input_ids"), kwargs.get("inputs"), kwargs.get("inputs_embeds")]:
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    return None


def _eagle3_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        draft = kwargs.get("assistant_model")
        if draft is None or not is_eagle3_draft(draft) or _ACTIVE.get() is not None:
            return original(self, *args, **kwargs)
        from .feature_capture import Eagle3FeatureCapture, find_decoder_layers

        batch = _batch_size(args, kwargs)
        if batch is not None and batch != 1:
            raise ValueError(
                f"EAGLE-3 decoding through `generate(assistant_model=draft)` handles one sequence at a time, got a "
                f"batch of {batch}. Loop over the prompts (or call generate without the draft for batches)."
            )
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if kwargs.get("inputs_embeds") is not None and not isinstance(ids, torch.Tensor):
            raise ValueError(
                "EAGLE-3 decoding needs the prompt's token ids (the draft pairs each target feature with the next "
                "token): pass `input_ids` too (the target still reads `inputs_embeds` for the prompt)."
            )
        if kwargs.get("prompt_lookup_num_tokens") is not None:
            raise ValueError("Pass either `assistant_model` (an EAGLE-3 draft) or `prompt_lookup_num_tokens`, not both.")
        tree = pop_tree_settings(self, draft, kwargs)  # removes the tree_* kwargs; validates before any work
        draft.bind_target(self)
        layers = find_decoder_layers(self, draft.config.target_layers_path)
        layer_ids = draft.config.resolve_feature_layer_ids(len(layers))
        capture = Eagle3FeatureCapture(self, layer_ids, draft.config.target_layers_path)
        call = _Eagle3Call(draft=draft, capture=capture, settings=_user_draft_settings(kwargs), tree=tree)
        token = _ACTIVE.set(call)
        capture.install()
        try:
            return original(self, *args, **kwargs)
        finally:
            capture.remove()
            _ACTIVE.reset(token)
            if call.generator is not None:
                call.generator.finish()

    generate._hf_eagle3_hook = HOOK_VERSION
    return generate


def _eagle3_get_candidate_generator(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        assistant = bound.arguments.get("assistant_model")
        call = _ACTIVE.get()
        if assistant is None or not is_eagle3_draft(assistant):
            return original(self, *args, **kwargs)
        if call is None or call.draft is not assistant:
            raise RuntimeError("EAGLE-3 drafts must be used through `target.generate(..., assistant_model=draft)`.")
        generation_config = bound.arguments["generation_config"]
        settings = resolve_draft_settings(assistant.generation_config, call.settings)
        generator_class = _GENERATOR_CLASS.get() or Eagle3CandidateGenerator
        call.generator = generator_class(
            assistant,
            call.capture,
            bound.arguments["input_ids"],
            generation_config,
            bound.arguments.get("logits_processor"),
            num_assistant_tokens=settings.get("num_assistant_tokens", 5),
            num_assistant_tokens_schedule=settings.get("num_assistant_tokens_schedule", "constant"),
            assistant_confidence_threshold=settings.get("assistant_confidence_threshold", 0.0),
            target=self,
        )
        return call.generator

    _get_candidate_generator._hf_eagle3_hook = HOOK_VERSION
    return _get_candidate_generator


def install_generate_hook() -> None:
    """Make ``generate(assistant_model=<EAGLE-3 draft>)`` use :class:`Eagle3CandidateGenerator` (idempotent).

    Also installs the tree hook (:func:`~hf_eagle3.tree_decoding.install_tree_hook`), which runs
    :func:`~hf_eagle3.tree_decoding.eagle3_tree_decoding` instead when ``tree_*`` settings are given. Every other call
    of ``generate`` is left exactly as it was. Raises ``RuntimeError`` on a Transformers version whose generation
    internals this hook does not know.
    """
    mixin = _gen_utils.GenerationMixin
    needed = ("generate", "_get_candidate_generator", "_assisted_decoding")
    missing = [name for name in needed if not hasattr(mixin, name)]
    if missing:
        import transformers

        raise RuntimeError(
            f"hf_eagle3 cannot hook transformers {transformers.__version__}: GenerationMixin lacks {missing}. "
            "Install a supported version (see hf_eagle3's pyproject.toml, transformers>=5.0)."
        )
    params = inspect.signature(mixin._get_candidate_generator).parameters
    if not {"generation_config", "input_ids", "logits_processor", "assistant_model"} <= set(params):
        import transformers

        raise RuntimeError(
            f"hf_eagle3 cannot hook transformers {transformers.__version__}: unexpected signature of "
            "GenerationMixin._get_candidate_generator. Install a supported version (see pyproject.toml)."
        )
    if getattr(mixin.generate, "_hf_eagle3_hook", None) is None:
        mixin.generate = _eagle3_generate(mixin.generate)
    if getattr(mixin._get_candidate_generator, "_hf_eagle3_hook", None) is None:
        mixin._get_candidate_generator = _eagle3_get_candidate_generator(mixin._get_candidate_generator)
    install_tree_hook()
