"""Rotary position embeddings of the EAGLE-3 draft: inverse frequencies, scalings and partial rotation.

The draft's RoPE comes from the DRAFT's config (``rope_theta``, ``draft_rope_scaling``, ``partial_rotary_factor``),
never from the target's.
"""

from __future__ import annotations

import math

import torch

BUILTIN_ROPE_TYPES = ("default", "linear", "llama3")  # computed by :func:`rope_inv_freq` itself


def rotary_dim(config) -> int:
    """
    Return how many channels of each head RoPE rotates (``head_dim`` times ``partial_rotary_factor``, even).

    Args:
        config (`Eagle3Config`): gives ``head_dim`` and ``partial_rotary_factor``.
    """
    factor = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    dim = int(config.head_dim * factor)
    return dim - dim % 2


def _rope_kind(config) -> str:
    """The ``rope_type`` (or legacy ``type``) of ``config.draft_rope_scaling``; ``"default"`` without scaling."""
    scaling = config.draft_rope_scaling or {}
    return scaling.get("rope_type") or scaling.get("type") or "default"


def rope_inv_freq(config) -> torch.Tensor:
    """
    Return the RoPE inverse frequencies of the draft.

    ``default``, ``linear`` and ``llama3`` scaling are computed here; other static scalings that Transformers knows
    (``yarn``, as in drafts exported for gpt-oss or DeepSeek targets, ``proportional``, ...) come from Transformers'
    own RoPE initialisers, so they match what the target's modeling code computes. Scalings that depend on the
    sequence length (``dynamic``, ``longrope``) are refused. With ``partial_rotary_factor`` < 1 the frequencies
    cover only the rotated channels (:func:`rotary_dim`).

    Args:
        config (`Eagle3Config`): gives ``head_dim``, ``rope_theta``, ``draft_rope_scaling`` and
            ``partial_rotary_factor``.

    Returns:
        `torch.FloatTensor` of shape `(rotary_dim // 2,)`, float32.
    """
    kind = _rope_kind(config)
    if kind not in BUILTIN_ROPE_TYPES:
        return _transformers_rope(config)[0]
    dim = rotary_dim(config)
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.draft_rope_scaling or {}
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def rope_attention_scaling(config) -> float:
    """
    Return the factor RoPE scaling applies to ``cos`` and ``sin`` (1.0 except for scalings such as ``yarn``).

    Args:
        config (`Eagle3Config`): gives ``draft_rope_scaling``.
    """
    if _rope_kind(config) in BUILTIN_ROPE_TYPES:
        return 1.0
    return float(_transformers_rope(config)[1])


def _transformers_rope(config) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` from Transformers' RoPE initialiser of ``config.draft_rope_scaling``."""
    from transformers import LlamaConfig

    from .transformers_compat import ROPE_INIT_FUNCTIONS

    kind = _rope_kind(config)
    params = dict(config.draft_rope_scaling)
    params.pop("type", None)
    if kind in ("dynamic", "longrope") or kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported by the EAGLE-3 draft: supported are default, linear, "
            f"llama3 and the static Transformers scalings ({', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic', 'longrope'}))}). "
            "Set `draft_rope_scaling` in the draft's config to one of them (drafts are trained on short contexts; "
            "the scaling only matters beyond `original_max_position_embeddings`)."
        )
    params.update(rope_type=kind, rope_theta=config.rope_theta)
    factor = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    if factor != 1.0:
        params["partial_rotary_factor"] = factor
    heads = config.num_attention_heads
    llama = LlamaConfig(
        hidden_size=heads * config.head_dim,
        num_attention_heads=heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=params,
    )
    with torch.device("cpu"):  # also when the model is being built on the meta device (from_pretrained)
        inv, attention_scaling = ROPE_INIT_FUNCTIONS[kind](llama, torch.device("cpu"))
    return inv.float(), attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """
    Rotate ``x`` by the half-split (neox) RoPE convention of Llama; channels beyond ``cos``'s width pass unchanged.

    Args:
        x (`torch.Tensor` [B, heads, L, D]): queries or keys.
        cos, sin (`torch.Tensor` [B, 1, L, R]): from :meth:`Eagle3DraftModel.rope`, R = :func:`rotary_dim` <= D.
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    head, tail = x[..., :rot], x[..., rot:]
    x1, x2 = head.chunk(2, dim=-1)
    return torch.cat((head * cos + torch.cat((-x2, x1), dim=-1) * sin, tail), dim=-1)
