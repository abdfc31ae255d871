"""The drafting settings of a ``generate`` call: the names, their defaults, how the draft's saved values and those
given to ``generate`` combine, and their validation.

Imports only transformers and the standard library.
"""

from __future__ import annotations

from transformers import GenerationConfig

# Chain drafting: draft length and its schedule (Transformers' own names for assisted decoding).
DRAFT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
SCHEDULES = ("constant", "heuristic", "heuristic_transient", "auto")
# Tokens drafted per round when neither the call nor the draft says (a fixed chain), and the draft length that
# tools (``check``, ``evaluate``, the speculators export) measure or write by default.
DEFAULT_DRAFT_LENGTH = 5
# Tree drafting (see docs/trees.md): given to ``generate`` or saved on the draft's generation config.
TREE_SETTINGS = ("tree_total_tokens", "tree_depth", "tree_top_k")
TREE_DEFAULTS = {"tree_total_tokens": 16, "tree_depth": 5, "tree_top_k": 4}
TREE_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# Settings a draft checkpoint carries in its generation_config.json (chain and tree drafting).
SAVED_DRAFT_SETTINGS = DRAFT_SETTINGS + TREE_SETTINGS


def user_draft_settings(kwargs: dict) -> dict:
    """
    The draft-length settings the user gave to this ``generate`` call (kwargs first, then a passed config; a config
    value equal to Transformers' default counts as not given).

    Args:
        kwargs (`dict`): the keyword arguments of ``generate``.
    """
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pop_tree_settings(target, draft, kwargs: dict) -> dict | None:
    """Pop the tree settings from ``generate``'s kwargs and resolve them; ``None`` when no tree was asked for.

    Precedence: ``generate`` kwargs, then a ``generation_config`` passed to ``generate``, then
    ``draft.generation_config``. Settings not given take :data:`TREE_DEFAULTS`. A chain asked for in the call
    (``num_assistant_tokens`` or ``num_assistant_tokens_schedule`` given to ``generate``, no ``tree_*``) is a chain,
    whatever tree the draft saved: a setting given is never overridden by a saved one.

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
    if not given and any(kwargs.get(key) is not None for key in DRAFT_SETTINGS[:2]):
        return None  # a chain asked for in the call
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
