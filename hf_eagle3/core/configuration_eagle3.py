"""Configuration of EAGLE-3 draft models, and the checks of a draft's ``config.json`` before it is read: valid
JSON, the fields a draft needs, and which published layout it is in (:func:`detect_layout`). Converting the published
layouts to and from :class:`Eagle3Config` is :mod:`hf_eagle3.core.config_layouts`.
"""

from __future__ import annotations

import json
import os

from transformers import PreTrainedConfig

# Architectures under which EAGLE-3 drafts are published in the "flat" layout (``midlayer.*`` weights).
FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle", "Eagle3DraftModel")


class DraftConfigError(ValueError):
    """A draft's ``config.json`` is not valid JSON, or a field is missing or of the wrong kind (the message names
    the file, the field and what was expected)."""


# Fields a draft config must give (in the flat and native layouts at the top level, in the speculators layout in
# ``transformer_layer_config``), with what is expected; then fields that may be absent or null.
_REQUIRED_FIELDS = {
    "vocab_size": "a positive integer (the target's vocabulary size)",
    "hidden_size": "a positive integer (the draft's hidden size)",
    "intermediate_size": "a positive integer (the draft's MLP width)",
    "num_attention_heads": "a positive integer (the draft's attention heads)",
}
_OPTIONAL_INT_FIELDS = ("draft_vocab_size", "num_key_value_heads", "head_dim", "target_hidden_size",
                        "max_position_embeddings")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_config_dict(cfg, source: str | os.PathLike = "config.json") -> str:
    """Check that a parsed draft ``config.json`` has the fields a draft needs; return its layout.

    Args:
        cfg: the parsed ``config.json``.
        source: the file, named in the error.

    Returns:
        The layout (see :func:`detect_layout`).

    Raises:
        DraftConfigError: naming ``source``, the field and what was expected.
    """
    if not isinstance(cfg, dict):
        raise DraftConfigError(f"{source}: expected a JSON object (a draft config), got {type(cfg).__name__}.")
    try:
        layout = detect_layout(cfg)
    except ValueError as err:
        raise DraftConfigError(f"{source}: {err}") from None
    fields, prefix = cfg, ""
    if layout == "speculators":
        fields, prefix = cfg.get("transformer_layer_config"), "transformer_layer_config."
        if not isinstance(fields, dict):
            raise DraftConfigError(f"{source}: field 'transformer_layer_config' is {fields!r}; expected an object "
                                   "with the draft layer's config (hidden_size, num_attention_heads, ...).")
        if "vocab_size" not in fields and "vocab_size" in cfg:
            fields = dict(fields, vocab_size=cfg["vocab_size"])  # also accepted at the top level
    for name, expected in _REQUIRED_FIELDS.items():
        if name not in fields:
            raise DraftConfigError(f"{source}: field '{prefix}{name}' is missing; expected {expected}.")
        if not _is_positive_int(fields[name]):
            raise DraftConfigError(f"{source}: field '{prefix}{name}' is {fields[name]!r}; expected {expected}.")
    for name in _OPTIONAL_INT_FIELDS:
        where = cfg if name in ("draft_vocab_size", "target_hidden_size") else fields
        value = where.get(name)
        if value is not None and not _is_positive_int(value):
            field = name if where is cfg else prefix + name
            raise DraftConfigError(f"{source}: field '{field}' is {value!r}; expected a positive integer or null.")
    return layout


def read_config_file(path: str | os.PathLike) -> dict:
    """Read and check a draft's ``config.json``.

    Args:
        path: the file.

    Returns:
        The parsed config.

    Raises:
        DraftConfigError: when the file is not valid JSON or lacks a field a draft needs (naming file and field).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise DraftConfigError(f"{path}: not valid JSON ({err}); expected the JSON object of a draft config.") from None
    check_config_dict(cfg, path)
    return cfg


FEATURE_LAYERS = 3  # target layers an EAGLE-3 draft reads unless its config lists more (what every engine reads)


def default_feature_layer_ids(num_target_layers: int, count: int = FEATURE_LAYERS) -> list[int]:
    """The reference EAGLE-3 capture indices ``[2, N // 2, N - 3]`` (inputs of those layers), clipped for tiny targets;
    for ``count`` > 3, that many indices spread evenly from the reference's lowest to its highest (rounded).

    Args:
        num_target_layers (`int`): number of decoder layers N of the target.
        count (`int`): how many layers (at least 3).

    Raises:
        ValueError: for fewer than 3 layers.
    """
    n = num_target_layers
    low, high = min(2, n - 1), max(n - 3, 0)
    if count < FEATURE_LAYERS:
        raise ValueError(f"An EAGLE-3 draft reads at least {FEATURE_LAYERS} target layers, asked for {count}.")
    if count == FEATURE_LAYERS:
        return [low, n // 2, high]
    return [round(low + i * (high - low) / (count - 1)) for i in range(count)]


class Eagle3Config(PreTrainedConfig):
    r"""
    Configuration of an EAGLE-3 draft model: one Llama-style decoder layer that reads three hidden states of a target
    model (more where ``feature_layer_ids`` lists more; fused by ``fc``) together with the embedding of the next token,
    and predicts over a (smaller) draft vocabulary that ``d2t`` maps onto the target vocabulary.

    Args:
        vocab_size (`int`): size of the TARGET vocabulary (the draft's token ids are target ids).
        draft_vocab_size (`int`, *optional*): size of the draft head's vocabulary; defaults to ``vocab_size``.
        hidden_size (`int`): the draft's hidden size H.
        intermediate_size (`int`): MLP width.
        num_attention_heads (`int`), num_key_value_heads (`int`, *optional*), head_dim (`int`, *optional*):
            attention shape; ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
        hidden_act (`str`): MLP activation (``"silu"``).
        rms_norm_eps (`float`): RMSNorm epsilon.
        max_position_embeddings (`int`): nominal context of the draft.
        rope_theta (`float`): RoPE base of the DRAFT (10000 when a checkpoint gives none).
        draft_rope_scaling (`dict`, *optional*): RoPE scaling (``{"rope_type": "llama3" | "linear" | "yarn" | ..., ...}``;
            any static scaling of Transformers' ``ROPE_INIT_FUNCTIONS``).
        attention_bias (`bool`), mlp_bias (`bool`): biases in the projections.
        target_hidden_size (`int`, *optional*): hidden size T of the target; defaults to ``hidden_size``.
        norm_before_residual (`bool`): take the residual after ``hidden_norm`` (some drafts) instead of before.
        norm_output (`bool`): EAGLE 3.1: the layer's output is normed before it is fed to the next draft step, and
            ``lm_head`` reads that normed state (no second norm).
        norm_before_fc (`bool`): RMSNorm (``input_norm``, width 3T) on the fused features before ``fc``.
        fc_norm (`bool`): one RMSNorm per captured feature (``fc_norm.{0,1,2}``, width T) before ``fc``.
        qk_norm (`bool`): Qwen3-style per-head RMSNorm on queries and keys.
        has_embed_tokens (`bool`): the draft carries its own ``embed_tokens`` ([vocab_size, H]); otherwise it uses
            the target's input embedding, shared and not copied.
        has_lm_head (`bool`): the draft carries its own ``lm_head``; otherwise it uses the target's output head,
            restricted to the draft vocabulary through ``d2t`` (bound by ``bind_target``).
        draft_sliding_window (`int`, *optional*): sliding-window attention of the draft layer (a key is attended
            while its position is greater than the query's minus the window); ``None`` = full attention.
        partial_rotary_factor (`float`): fraction of each head's channels that RoPE rotates (1.0 = all).
        feature_layer_ids (`list[int]`, *optional*): which target hidden states feed the draft, as indices of
            ``output_hidden_states`` (index i = INPUT of decoder layer i, 0 = embeddings), sorted ascending on
            construction (engines concatenate the captured layers in that order).
            ``None`` means the reference default ``[2, N // 2, N - 3]`` for a target of N layers.
        target_layers_path (`str`, *optional*): dotted path of the target's decoder-layer list (e.g.
            ``"model.layers"``) when it cannot be found automatically.
        target_model_type (`str`, *optional*), target_name_or_path (`str`, *optional*): informative.
        initializer_range (`float`): std of the random initialisation.
    """

    model_type = "eagle3_draft"

    def __init__(
        self,
        vocab_size: int = 32000,
        draft_vocab_size: int | None = None,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        draft_rope_scaling: dict | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        target_hidden_size: int | None = None,
        norm_before_residual: bool = False,
        norm_output: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        qk_norm: bool = False,
        has_embed_tokens: bool = False,
        has_lm_head: bool = True,
        draft_sliding_window: int | None = None,
        partial_rotary_factor: float = 1.0,
        feature_layer_ids: list[int] | None = None,
        target_layers_path: str | None = None,
        target_model_type: str | None = None,
        target_name_or_path: str | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size or vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = float(rope_theta)
        self.draft_rope_scaling = draft_rope_scaling
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.target_hidden_size = target_hidden_size or hidden_size
        self.norm_before_residual = norm_before_residual
        self.norm_output = bool(norm_output)
        self.norm_before_fc = norm_before_fc
        self.fc_norm = fc_norm
        self.qk_norm = qk_norm
        self.has_embed_tokens = has_embed_tokens
        self.has_lm_head = bool(has_lm_head)
        self.draft_sliding_window = int(draft_sliding_window) if draft_sliding_window else None
        self.partial_rotary_factor = float(partial_rotary_factor if partial_rotary_factor is not None else 1.0)
        # Engines concatenate the captured layers in ascending order, whatever order a config lists them in.
        self.feature_layer_ids = sorted(feature_layer_ids) if feature_layer_ids is not None else None
        self.target_layers_path = target_layers_path
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.initializer_range = initializer_range
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        if self.feature_layer_ids is not None and len(self.feature_layer_ids) < FEATURE_LAYERS:
            raise ValueError(f"feature_layer_ids must list at least {FEATURE_LAYERS} layers (low, mid, high, ...), "
                             f"got {self.feature_layer_ids}")

    @property
    def num_feature_layers(self) -> int:
        """How many target layers the draft reads (``fc`` fuses that many hidden states): 3 unless
        ``feature_layer_ids`` lists more."""
        return len(self.feature_layer_ids) if self.feature_layer_ids is not None else FEATURE_LAYERS

    @classmethod
    def _dict_from_json_file(cls, json_file: str | os.PathLike):
        """Read ``config.json`` for ``from_pretrained``, with an error naming the file and field when malformed."""
        cfg = read_config_file(json_file)
        decode = getattr(cls, "_decode_special_floats", None)  # Transformers >= 5 writes NaN/inf as strings
        return decode(cfg) if decode is not None else cfg

    def resolve_feature_layer_ids(self, num_target_layers: int) -> list[int]:
        """
        Return the capture indices for a target with ``num_target_layers`` decoder layers.

        Index i means the INPUT of decoder layer i (``output_hidden_states[i]``); ``feature_layer_ids=None`` gives
        the reference default ``[2, N // 2, N - 3]``.

        Args:
            num_target_layers (`int`): number of decoder layers N of the target.

        Raises:
            ValueError: when an index is outside ``[0, num_target_layers)``.
        """
        n = num_target_layers
        ids = self.feature_layer_ids
        if ids is None:
            ids = default_feature_layer_ids(n)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(
                f"feature_layer_ids {ids} are out of range for a target with {n} decoder layers (valid: 0..{n - 1}, "
                "index i = input of layer i). This draft was probably made for a deeper target; set "
                "`draft.config.feature_layer_ids` to valid indices, or use the draft's own target."
            )
        return list(ids)


def detect_layout(cfg: dict) -> str:
    """
    Name the checkpoint layout of a draft's ``config.json``: ``"native"``, ``"speculators"`` or ``"flat"``.

    Args:
        cfg (`dict`): the parsed ``config.json``.

    Raises:
        ValueError: when ``cfg`` is not the config of an EAGLE-3 draft in any known layout.
    """
    if cfg.get("model_type") == Eagle3Config.model_type:
        return "native"
    if cfg.get("speculators_model_type") == "eagle3" or "transformer_layer_config" in cfg:
        return "speculators"
    archs = cfg.get("architectures") or []
    if any(a in FLAT_ARCHITECTURES for a in archs) or "draft_vocab_size" in cfg:
        return "flat"
    raise ValueError(
        f"config.json (model_type={cfg.get('model_type')!r}, architectures={archs}) is not an EAGLE-3 draft: "
        f"expected model_type '{Eagle3Config.model_type}', a `speculators` eagle3 config, or one of the flat "
        f"architectures {FLAT_ARCHITECTURES}."
    )
