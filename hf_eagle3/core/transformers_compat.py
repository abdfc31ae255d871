"""Every private Transformers name hf-eagle3 touches, the releases it is needed on, and the supported range.

Transformers has no public way to plug a drafter of its own into ``generate`` (its ``_get_candidate_generator`` picks
among the built-in generators by name), nor to run another decoding loop for trees and batches. So the package
wraps three ``GenerationMixin`` methods and reads a few cache internals; this module is the only place that names
them (:data:`PRIVATE_NAMES`), checks them when the package is imported (:func:`check_transformers`) and patches the
methods (:func:`wrap_generation_method`). What Transformers offers publicly is used wherever it does the job:

- the ``CandidateGenerator`` protocol (``requires_model_outputs`` / ``model_kwargs_overrides``): the target's
  outputs are handed to the chain drafter each round, and on releases that select hidden states by index
  (:data:`SELECTS_HIDDEN_STATES`) the drafter takes its features from them instead of forward hooks;
- ``num_drafting_tokens`` (5.25+): sizes the history of recurrent states a hybrid target keeps for the roll-back
  (:data:`ROLLS_BACK_RECURRENT_STATES`).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import transformers
from transformers.generation import utils as _generation_utils

# The releases the test suite passes on: the floor (inclusive) and the bound (exclusive), as in pyproject.toml.
TESTED_FLOOR = (5, 20)
TESTED_BOUND = (5, 26)
SUPPORTED_RANGE = f">={TESTED_FLOOR[0]}.{TESTED_FLOOR[1]},<{TESTED_BOUND[0]}.{TESTED_BOUND[1]}"


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``"5.25.0"``, ``"5.26.0.dev0"``)."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return parts[0], parts[1] if len(parts) > 1 else 0


RELEASE = _release(transformers.__version__)
# `output_hidden_states=[i, j, k]` keeps only those hidden states (earlier releases take any true value for "all").
SELECTS_HIDDEN_STATES = RELEASE >= (5, 25)
# `cache.activate_past_recording(recurrent_states_to_keep=n)`: assisted decoding rolls back linear-attention layers.
ROLLS_BACK_RECURRENT_STATES = RELEASE >= (5, 25)
# `assistant_ensemble_weight`: static-ensemble verification in Transformers' assisted loop, on the releases whose
# GenerationConfig defines it (5.24 and 5.25 do; a release without it keeps the setting on a passed GenerationConfig
# as a plain attribute and never reads it).
VERIFIES_ENSEMBLE = hasattr(transformers.GenerationConfig(), "assistant_ensemble_weight")
# Assisted decoding on `cache_implementation="static"` (earlier releases refuse it before any work).
ASSISTS_ON_STATIC_CACHE = RELEASE >= (5, 24)


@dataclass(frozen=True)
class PrivateName:
    """One private Transformers name the package touches: where it lives, what it is for, on which releases."""

    name: str
    why: str
    releases: str


# The private surface (docs/transformers_versions.md prints this table).
PRIVATE_NAMES = (
    PrivateName("GenerationMixin._get_candidate_generator", "wrapped: returns the EAGLE-3 chain drafter when the "
                "assistant is an EAGLE-3 draft (Transformers chooses among its own generators by name)", "5.20-5.25"),
    PrivateName("GenerationMixin._assisted_decoding", "wrapped: runs the package's loop for trees and for batches of "
                "more than one row (Transformers' loop takes one row and chains)", "5.20-5.25"),
    PrivateName("transformers.cache_utils.DynamicLayer", "subclassed by the tree and batch loops' preallocated target "
                "cache (`PreallocatedLayer`), which relies on its `keys` / `values` / `is_initialized` attributes "
                "(the class is exported, those attributes are internals)", "5.20-5.25"),
    PrivateName("transformers.cache_utils.DynamicSlidingWindowLayer", "tree and batch verification gather the "
                "accepted entries of sliding-window layers and shrink them back to the window", "5.20-5.25"),
    PrivateName("transformers.cache_utils.LinearAttentionCacheLayerMixin", "recognise recurrent / linear-attention "
                "layers of hybrid targets, to refuse trees and batches before any work", "5.20-5.25"),
    PrivateName("GenerationMixin._valid_auto_compile_criteria", "the package's loop on a static cache compiles the "
                "target's round forwards exactly where Transformers' own decoding would (a compile_config, an "
                "accelerator, no offload; used from 5.24, where assisted decoding takes a static cache)", "5.20-5.25"),
    PrivateName("transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS", "the draft's RoPE scalings (llama3, linear, "
                "yarn, ...) computed as the target computes them", "5.20-5.25"),
)


def _import_private(dotted: str):
    """``transformers.<module>.<name>`` or ``None`` when the release lacks it (reported by :func:`check_transformers`)."""
    import importlib

    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name, None)


# The private module-level names of PRIVATE_NAMES, imported once (None where the release lacks one).
_IMPORTED = {entry.name: _import_private(entry.name) for entry in PRIVATE_NAMES if entry.name.startswith("transformers.")}
DynamicLayer = _IMPORTED["transformers.cache_utils.DynamicLayer"]
DynamicSlidingWindowLayer = _IMPORTED["transformers.cache_utils.DynamicSlidingWindowLayer"]
LinearAttentionCacheLayerMixin = _IMPORTED["transformers.cache_utils.LinearAttentionCacheLayerMixin"]
ROPE_INIT_FUNCTIONS = _IMPORTED["transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS"]
GenerationMixin = _generation_utils.GenerationMixin

# The parameters the wrappers read by name.
_GET_CANDIDATE_GENERATOR_PARAMS = {"generation_config", "input_ids", "logits_processor", "assistant_model"}
ASSISTED_DECODING_PARAMS = ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "streamer")

_warned = False


def _fix() -> str:
    return f"install a tested release: pip install 'transformers{SUPPORTED_RANGE}'"


def missing_private_names() -> list[str]:
    """The names of :data:`PRIVATE_NAMES` (and wrapped signatures) the installed Transformers lacks or changed."""
    missing = []
    if not callable(getattr(GenerationMixin, "_valid_auto_compile_criteria", None)):
        missing.append("GenerationMixin._valid_auto_compile_criteria")
    for method, params in (("_get_candidate_generator", _GET_CANDIDATE_GENERATOR_PARAMS),
                           ("_assisted_decoding", set(ASSISTED_DECODING_PARAMS))):
        fn = getattr(GenerationMixin, method, None)
        if fn is None:
            missing.append(f"GenerationMixin.{method}")
            continue
        signature = inspect.signature(fn).parameters.values()
        names = {p.name for p in signature}
        var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature)
        if not params <= names or (method == "_assisted_decoding" and not var_keyword):
            missing.append(f"GenerationMixin.{method} (its parameters {sorted(params - names) or '**model_kwargs'})")
    missing += [name for name, value in _IMPORTED.items() if value is None]
    if not callable(getattr(GenerationMixin, "generate", None)):
        missing.append("GenerationMixin.generate")
    return missing


def check_transformers() -> None:
    """
    Check the installed Transformers when the package is imported.

    A release outside :data:`SUPPORTED_RANGE` gets one ``UserWarning`` naming the tested range (per process); a
    private name the package needs that the release lacks raises ``ImportError`` naming the installed version and the
    fix, so that nothing fails later in the middle of ``generate``.
    """
    global _warned
    version = transformers.__version__
    missing = missing_private_names()
    if missing:
        raise ImportError(
            f"hf_eagle3 cannot run on transformers {version}: it lacks {', '.join(missing)}. Fix: {_fix()}."
        )
    if not TESTED_FLOOR <= RELEASE < TESTED_BOUND and not _warned:
        _warned = True
        warnings.warn(
            f"hf_eagle3 is tested with transformers{SUPPORTED_RANGE}; transformers {version} is installed. "
            f"If decoding misbehaves, {_fix()}.",
            UserWarning,
            stacklevel=3,
        )


def wrap_generation_method(name: str, make_wrapper) -> None:
    """
    Replace ``GenerationMixin.<name>`` by ``make_wrapper(original)`` unless a wrapper of ours is already there
    (from this copy of the package or another one: a remote-code bundle).

    Args:
        name (`str`): ``"generate"``, ``"_get_candidate_generator"`` or ``"_assisted_decoding"``.
        make_wrapper (`Callable`): takes the current method, returns the wrapper (marked ``_hf_eagle3_hook``).
    """
    current = getattr(GenerationMixin, name)
    if getattr(current, "_hf_eagle3_hook", None) is None and getattr(current, "_hf_eagle3_tree_hook", None) is None:
        setattr(GenerationMixin, name, make_wrapper(current))


def is_sliding_layer(layer) -> bool:
    """
    Whether ``layer`` is a sliding-window layer of a ``DynamicCache``.

    Args:
        layer (`CacheLayerMixin`): a layer of the target's cache.
    """
    return DynamicSlidingWindowLayer is not None and type(layer) is DynamicSlidingWindowLayer


def is_plain_dynamic_layer(layer) -> bool:
    """
    Whether ``layer`` is a full-attention ``DynamicLayer`` (not a subclass: quantised, indexed, hybrid layers).

    Args:
        layer (`CacheLayerMixin`): a layer of the target's cache.
    """
    return type(layer) is DynamicLayer


def _cache_layers(cache) -> list:
    """The layers of a decoder cache (of its self-attention part for an encoder-decoder cache); none for ``None``."""
    return getattr(getattr(cache, "self_attention_cache", cache), "layers", None) or []


def recurrent_layers(cache) -> list[int]:
    """
    The indices of the layers of ``cache`` that hold recurrent or convolution states (linear attention, Mamba, short
    convolutions of hybrid targets).

    Args:
        cache (`Cache` or `None`): the target's cache of a ``generate`` call (its layers are created from the config).
    """
    return [i for i, layer in enumerate(_cache_layers(cache)) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def unrollable_attention_layers(cache) -> list[int]:
    """
    The indices of the attention layers of ``cache`` that say they cannot be cropped back (a static sliding-window
    layer shorter than the static cache), known as soon as the cache is built.

    Args:
        cache (`Cache` or `None`): the target's cache of a ``generate`` call.
    """
    return [i for i, layer in enumerate(_cache_layers(cache))
            if not isinstance(layer, LinearAttentionCacheLayerMixin) and getattr(layer, "is_croppable", True) is False]


def round_forward(model, model_kwargs: dict, generation_config):
    """
    What runs the target's forwards of the package's rounds on a static cache: Transformers' compiled call
    (``model.get_compiled_call(generation_config.compile_config)``) where its own decoding would compile (a static cache
    and an accelerator, or a ``compile_config`` that asks for every device; no offload, a compileable quantiser),
    else the model itself.

    Args:
        model (`PreTrainedModel`): the target.
        model_kwargs (`dict`): the prepared model kwargs (the static cache among them).
        generation_config (`GenerationConfig`): the call's config.

    Returns:
        ``(callable, compiled)``: the forward, and whether it is the compiled one.
    """
    if model._valid_auto_compile_criteria(model_kwargs, generation_config):
        return model.get_compiled_call(generation_config.compile_config), True
    return model, False


def compiled_graphs() -> int:
    """
    How many graphs torch has compiled in this process (its dynamo counter, private to torch and read only here): a
    forward after which it grew compiled (or recompiled) a graph, whatever the reason (a new width, batch size or
    cache capacity).
    """
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def eos_token_ids(generation_config) -> set[int]:
    """
    The end-of-sequence token ids of a ``generate`` call.

    Args:
        generation_config (`GenerationConfig`): the call's config (after ``generate`` merged the model's defaults).
    """
    eos = generation_config.eos_token_id
    if eos is None:
        return set()
    if hasattr(eos, "tolist"):
        eos = eos.tolist()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
