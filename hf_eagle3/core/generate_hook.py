"""The one place that hooks Transformers' ``generate``: while an EAGLE-3 draft is the ``assistant_model`` of a call,
``generate`` makes the call's own feature capture (:func:`feature_source`), ``_get_candidate_generator`` returns the
chain drafter (:class:`~hf_eagle3.core.candidate_generator.Eagle3CandidateGenerator`) and ``_assisted_decoding`` runs
the package's loop (:func:`~hf_eagle3.core.decoding_loop.eagle3_decoding`) for trees and for batches (see
:func:`route_assisted_decoding`). Every other call of ``generate`` is left exactly as it was.

:func:`install_generate_hook` installs the three patches (idempotent); the package's ``__init__`` calls it, and so
does ``auto_entry.py``, the module a remote-code bundle's ``AutoModel`` loads.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch

from . import transformers_compat as compat
from .candidate_generator import Eagle3CandidateGenerator
from .decoding_loop import eagle3_decoding
from .feature_capture import Eagle3FeatureCapture, Eagle3OutputFeatures, find_decoder_layers
from .settings import DEFAULT_DRAFT_LENGTH, pop_tree_settings, resolve_draft_settings, user_draft_settings
from .target_cache import cache_entry

HOOK_VERSION = 1


def is_eagle3_draft(model) -> bool:
    """
    Whether ``model`` is an EAGLE-3 draft (from this package or a remote-code copy of it).

    Args:
        model (`object`): any object, typically the ``assistant_model`` passed to ``generate``.
    """
    return bool(getattr(type(model), "_is_eagle3_draft", False))


@dataclass
class _Eagle3Call:
    """The state of one EAGLE-3 ``generate`` call: the draft, the capture on the target, the user's draft-length
    settings, the tree settings (``None``: chain drafting), and the drafter created for it (``finish``-ed at the end).
    """

    draft: object
    capture: object
    settings: dict
    generator: object = None  # the call's chain generator or tree run; its finish() publishes the statistics
    tree: dict | None = None  # tree settings (see settings.pop_tree_settings); None = chain drafting


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_active_call", default=None)


# The drafter classes of this context (None: the defaults); set by `use_drafting`.
_GENERATOR_CLASS: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_generator_class", default=None)
_DRAFTER_CLASS: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_drafter_class", default=None)
_FEATURE_SOURCE: contextvars.ContextVar = contextvars.ContextVar("hf_eagle3_feature_source", default=None)
FEATURE_SOURCES = ("outputs", "hooks")


@contextlib.contextmanager
def use_drafting(chain=None, drafter=None, features=None):
    """
    Within the block, EAGLE-3 calls of ``generate`` draft with ``chain`` (a subclass of
    :class:`Eagle3CandidateGenerator` taking the same arguments, for batch-1 chains) and/or ``drafter`` (a subclass
    of :class:`~hf_eagle3.core.drafter.Eagle3Drafter`, for the package's loop: trees, and chains in
    batches) instead of the defaults: how
    benchmarks swap in instrumented drafting (e.g. ``hf-eagle3 bench --oracle``) without another code path.
    ``features="hooks"`` makes every call take the target's features from forward hooks even where the target's
    outputs can hold them (how the two sources are compared); ``"outputs"`` asks for the outputs and fails on releases
    that cannot select hidden states.

    Args:
        chain (`type`, *optional*): the chain candidate generator class.
        drafter (`type`, *optional*): the drafter class of the package's loop.
        features (`str`, *optional*): ``"outputs"`` or ``"hooks"`` (default: see :func:`feature_source`).
    """
    if features is not None and features not in FEATURE_SOURCES:
        raise ValueError(f"features={features!r}: choose one of {FEATURE_SOURCES}.")
    if features == "outputs" and not compat.SELECTS_HIDDEN_STATES:
        raise ValueError(f"features='outputs' needs transformers>=5.25 (installed: {compat.transformers.__version__}).")
    tokens = [(_GENERATOR_CLASS, _GENERATOR_CLASS.set(chain)), (_DRAFTER_CLASS, _DRAFTER_CLASS.set(drafter)),
              (_FEATURE_SOURCE, _FEATURE_SOURCE.set(features))]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def _batch_size(args, kwargs) -> int | None:
    """The batch size of ``generate``'s prompt (ids, ``inputs`` or embeddings), ``None`` when none is a tensor."""
    for value in list(args[:1]) + [kwargs.get("input_ids"), kwargs.get("inputs"), kwargs.get("inputs_embeds")]:
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    return None


def check_batch_call(target, args: tuple, kwargs: dict) -> None:
    """
    Refuse, before any work, what a batched EAGLE-3 call of ``generate`` cannot do: a streamer (Transformers'
    streamers take one sequence), or padding without an ``attention_mask`` (the pad token in the batch and no mask).

    Args:
        target (`PreTrainedModel`): the target.
        args (`tuple`): ``generate``'s positional arguments.
        kwargs (`dict`): its keyword arguments.
    """
    if kwargs.get("streamer") is not None:
        raise ValueError("Transformers' streamers take one sequence (batch 1): drop the streamer for a batch, or "
                         "generate one row at a time to stream it.")
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if kwargs.get("attention_mask") is not None or not isinstance(ids, torch.Tensor):
        return
    pad = kwargs.get("pad_token_id")
    for config in (kwargs.get("generation_config"), target.generation_config):
        if pad is None and config is not None:
            pad = config.pad_token_id
    if pad is not None and bool((ids == pad).any()):
        raise ValueError("This batch holds the pad token but no attention_mask: pass the tokenizer's attention_mask "
                         "(left padding) to generate, so that the padding stays masked.")


def check_prompt(ids, kwargs: dict) -> None:
    """
    Refuse, before any work, a prompt of no tokens (``input_ids`` of shape ``[B, 0]``): the target has no position to
    start from (plain ``generate`` fails on it too) and the draft no token to pair with the target's first features.
    ``generate`` called without ``input_ids`` starts from the BOS token and is not refused.

    Args:
        ids (`torch.Tensor` or `None`): ``generate``'s prompt ids (positional, ``input_ids`` or ``inputs``).
        kwargs (`dict`): ``generate``'s keyword arguments.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() == 0 or ids.shape[-1] > 0:
        return
    embeds = (" (`inputs_embeds` is given, but EAGLE-3 still needs the prompt's token ids)"
              if kwargs.get("inputs_embeds") is not None else "")
    raise ValueError(
        f"EAGLE-3 decoding got an empty prompt: input_ids of shape {tuple(ids.shape)}{embeds}. Pass at least one "
        "token per row (e.g. the tokenizer's BOS token: `input_ids=torch.tensor([[tokenizer.bos_token_id]])`), or "
        "call generate without input_ids to start from the model's BOS token."
    )


def check_ensemble_weight(generation_config, tree: bool, batched: bool) -> None:
    """
    Refuse, before any target forward, ``assistant_ensemble_weight`` (Transformers 5.24+: lossy static-ensemble
    verification) in the package's loop, whose acceptance of trees and batches is lossless only, and for batch-1 chains
    on releases whose loop would not read it. Batch-1 chains run in Transformers' loop, which honours it where it
    defines it (``VERIFIES_ENSEMBLE``).

    Args:
        generation_config (`GenerationConfig`): the call's prepared config.
        tree (`bool`): the call drafts trees.
        batched (`bool`): the call has more than one row.
    """
    weight = getattr(generation_config, "assistant_ensemble_weight", None)
    if weight is None:
        return
    if not (tree or batched):
        if compat.VERIFIES_ENSEMBLE:
            return
        raise ValueError(
            f"assistant_ensemble_weight={weight} (static-ensemble verification) is not read by the assisted decoding "
            f"of transformers {compat.transformers.__version__}: install transformers>=5.24 to use it, or set "
            "assistant_ensemble_weight=None for lossless verification."
        )
    what = " and ".join(name for name, asked in (("trees", tree), ("batches", batched)) if asked)
    fix = " and ".join(step for step, needed in (("generate one row at a time", batched),
                                                 ("drop the tree_* settings", tree)) if needed)
    raise ValueError(
        f"assistant_ensemble_weight={weight} (static-ensemble verification) is not implemented for EAGLE-3 {what}, "
        f"which verify losslessly: {fix} (batch-1 chain drafting honours it), or set assistant_ensemble_weight=None "
        "for lossless verification."
    )


def feature_source(draft) -> str:
    """
    Where a call takes the target's features: ``"outputs"`` (the target's forwards return the selected hidden states,
    on releases that select hidden states by index: Transformers hands them to the chain drafter,
    ``requires_model_outputs``, and the package's loop reads them from the forwards it runs) unless
    :func:`use_drafting` asks for ``"hooks"`` or the draft names the target's layer list (``target_layers_path``);
    else ``"hooks"`` (forward pre-hooks on three decoder layers that keep only the calling thread's forwards).

    Args:
        draft (`Eagle3DraftModel`): the call's draft.
    """
    asked = _FEATURE_SOURCE.get()
    if asked is not None:
        return asked
    if compat.SELECTS_HIDDEN_STATES and draft.config.target_layers_path is None:
        return "outputs"
    return "hooks"


def _eagle3_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        draft = kwargs.get("assistant_model")
        if draft is None or not is_eagle3_draft(draft) or _ACTIVE.get() is not None:
            return original(self, *args, **kwargs)
        batch = _batch_size(args, kwargs)
        if batch is not None and batch > 1:
            check_batch_call(self, args, kwargs)
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if kwargs.get("inputs_embeds") is not None and not isinstance(ids, torch.Tensor):
            raise ValueError(
                "EAGLE-3 decoding needs the prompt's token ids (the draft pairs each target feature with the next "
                "token): pass `input_ids` too (the target still reads `inputs_embeds` for the prompt)."
            )
        check_prompt(ids, kwargs)
        if kwargs.get("prompt_lookup_num_tokens") is not None:
            raise ValueError("Pass either `assistant_model` (an EAGLE-3 draft) or `prompt_lookup_num_tokens`, not both.")
        tree = pop_tree_settings(self, draft, kwargs)  # removes the tree_* kwargs; validates before any work
        draft.bind_target(self)
        layers = find_decoder_layers(self, draft.config.target_layers_path)
        layer_ids = draft.config.resolve_feature_layer_ids(len(layers))
        if feature_source(draft) == "outputs":
            capture = Eagle3OutputFeatures(layer_ids, len(layers))
        else:
            capture = Eagle3FeatureCapture(self, layer_ids, draft.config.target_layers_path)
        call = _Eagle3Call(draft=draft, capture=capture, settings=user_draft_settings(kwargs), tree=tree)
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
        _, cache = cache_entry(bound.arguments.get("model_kwargs") or {})
        recurrent = compat.recurrent_layers(cache)
        if compat.unrollable_attention_layers(cache):
            raise ValueError(
                f"The target's {type(cache).__name__} is longer than the sliding window of some of its layers (it is "
                "sized for the longest generate call on this model so far), so those layers cannot be rolled back "
                "after a rejected draft. Use the default dynamic cache (drop cache_implementation)."
            )
        if recurrent and not compat.ROLLS_BACK_RECURRENT_STATES:
            raise ValueError(
                f"This target has recurrent / linear-attention layers ({len(recurrent)} of them); rolling them back "
                f"after a rejected draft needs transformers>=5.25 (installed: {compat.transformers.__version__}). "
                f"Fix: pip install 'transformers{compat.SUPPORTED_RANGE}' with a release of 5.25 or newer."
            )
        settings = resolve_draft_settings(assistant.generation_config, call.settings)
        generator_class = _GENERATOR_CLASS.get() or Eagle3CandidateGenerator
        call.generator = generator_class(
            assistant,
            call.capture,
            bound.arguments["input_ids"],
            generation_config,
            bound.arguments.get("logits_processor"),
            num_assistant_tokens=settings.get("num_assistant_tokens", DEFAULT_DRAFT_LENGTH),
            num_assistant_tokens_schedule=settings.get("num_assistant_tokens_schedule", "constant"),
            assistant_confidence_threshold=settings.get("assistant_confidence_threshold", 0.0),
            target=self,
            recurrent_target=bool(recurrent),
        )
        return call.generator

    _get_candidate_generator._hf_eagle3_hook = HOOK_VERSION
    return _get_candidate_generator


def route_assisted_decoding(model, original, args: tuple, kwargs: dict):
    """
    Which loop runs the assisted decoding of a ``generate`` call while an EAGLE-3 call is active: the package's loop
    (:mod:`~hf_eagle3.core.decoding_loop`) for trees and for more than one row, else Transformers' own loop (batch-1
    chain drafting runs there, through the candidate generator).
    Other calls run Transformers' loop unchanged.

    Args:
        model (`PreTrainedModel`): the target.
        original (`Callable`): Transformers' ``GenerationMixin._assisted_decoding``.
        args (`tuple`): its positional arguments (after ``self``).
        kwargs (`dict`): its keyword arguments.
    """
    call = _ACTIVE.get()
    if call is None:
        return original(model, *args, **kwargs)
    named = loop_arguments(original, model, args, kwargs)
    batched = named["input_ids"].shape[0] > 1
    if not batched and getattr(call, "tree", None) is None:
        check_ensemble_weight(named["generation_config"], tree=False, batched=False)
        return original(model, *args, **kwargs)
    check_ensemble_weight(named["generation_config"], getattr(call, "tree", None) is not None, batched)
    recurrent = compat.recurrent_layers(cache_entry(named["model_kwargs"])[1])
    if recurrent:
        fix = ("generate one row at a time (chain drafting rolls such layers back)" if batched else
               "drop the tree_* settings to use chain drafting, which rolls such layers back")
        if not compat.ROLLS_BACK_RECURRENT_STATES:
            fix += f" on transformers>=5.25 (installed: {compat.transformers.__version__})"
        raise ValueError(
            f"EAGLE-3 {'batches' if batched else 'trees'} keep only the accepted entries of the target's KV cache, "
            f"which the {len(recurrent)} recurrent / linear-attention layers of this target cannot do: {fix}."
        )
    return eagle3_decoding(model, call, **named, drafter_class=_DRAFTER_CLASS.get())


LOOP_ARGUMENTS = compat.ASSISTED_DECODING_PARAMS


def loop_arguments(original, model, args: tuple, kwargs: dict) -> dict:
    """
    The arguments of Transformers' ``_assisted_decoding`` call that the EAGLE-3 loops read, by name:
    :data:`LOOP_ARGUMENTS` and ``model_kwargs`` (the prepared model inputs: cache, attention mask, ...). The others
    (``synced_gpus``, ``inputs_tensor``, ``assistant_model``, the tokenizers) do not concern them.

    Args:
        original (`Callable`): Transformers' ``GenerationMixin._assisted_decoding``.
        model (`PreTrainedModel`): the target.
        args (`tuple`): the call's positional arguments (after ``self``).
        kwargs (`dict`): its keyword arguments.
    """
    signature = inspect.signature(original)
    bound = signature.bind(model, *args, **kwargs).arguments
    var_keyword = next(p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD)
    named = {name: bound.get(name) for name in LOOP_ARGUMENTS}
    named["model_kwargs"] = dict(bound.get(var_keyword, {}))
    return named


def _eagle3_assisted_decoding(original):
    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        return route_assisted_decoding(self, original, args, kwargs)

    _assisted_decoding._hf_eagle3_hook = HOOK_VERSION
    return _assisted_decoding


def install_generate_hook() -> None:
    """Make ``generate(assistant_model=<EAGLE-3 draft>)`` run EAGLE-3 decoding (idempotent).

    Wraps ``GenerationMixin.generate`` (capture, settings, per-call state), ``_get_candidate_generator`` (chain
    drafting: :class:`Eagle3CandidateGenerator`) and ``_assisted_decoding`` (:func:`route_assisted_decoding`: the
    package's loop for trees and batches), through :mod:`~hf_eagle3.core.transformers_compat`, which checks first that the
    installed Transformers has them (``ImportError`` naming the version and the fix when not). Every other call of
    ``generate`` is left exactly as it was.
    """
    compat.check_transformers()
    compat.wrap_generation_method("generate", _eagle3_generate)
    compat.wrap_generation_method("_get_candidate_generator", _eagle3_get_candidate_generator)
    compat.wrap_generation_method("_assisted_decoding", _eagle3_assisted_decoding)
