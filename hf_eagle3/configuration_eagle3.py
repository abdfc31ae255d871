"""Configuration of EAGLE-3 draft models, and conversion from the published checkpoint layouts.

Core file: imports only torch/transformers, so it can be copied next to a checkpoint for ``trust_remote_code``.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any

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


def default_feature_layer_ids(num_target_layers: int) -> list[int]:
    """The reference EAGLE-3 capture indices ``[2, N // 2, N - 3]`` (inputs of those layers), clipped for tiny targets.

    Args:
        num_target_layers (`int`): number of decoder layers N of the target.
    """
    n = num_target_layers
    return [min(2, n - 1), n // 2, max(n - 3, 0)]


class Eagle3Config(PreTrainedConfig):
    r"""
    Configuration of an EAGLE-3 draft model: one Llama-style decoder layer that reads three hidden states of a target
    model (fused by ``fc``) together with the embedding of the next token, and predicts over a (smaller) draft
    vocabulary that ``d2t`` maps onto the target vocabulary.

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
        if self.feature_layer_ids is not None and len(self.feature_layer_ids) != 3:
            raise ValueError(f"feature_layer_ids must list 3 layers (low, mid, high), got {self.feature_layer_ids}")

    @classmethod
    def _dict_from_json_file(cls, json_file: str | os.PathLike):
        """Read ``config.json`` for ``from_pretrained``, with an error naming the file and field when malformed."""
        cfg = read_config_file(json_file)
        decode = getattr(cls, "_decode_special_floats", None)  # Transformers >= 5 writes NaN/inf as strings
        return decode(cfg) if decode is not None else cfg

    def resolve_feature_layer_ids(self, num_target_layers: int) -> list[int]:
        """
        Return the three capture indices for a target with ``num_target_layers`` decoder layers.

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
                "`draft.config.feature_layer_ids` to three valid indices, or use the draft's own target."
            )
        return list(ids)


_LAYER_TYPE_NAMES = ("full_attention", "sliding_attention")


def _pick_layer_type(value, layer_type: str | None):
    """A per-layer-type RoPE dict (``{"full_attention": {...}, "sliding_attention": {...}}``) reduced to the entry of
    ``layer_type`` (else the sliding one, as speculators does, else the full one); other values are returned as is."""
    if not isinstance(value, dict) or not any(isinstance(value.get(k), dict) for k in _LAYER_TYPE_NAMES):
        return value
    for key in (layer_type, "sliding_attention", "full_attention"):
        if key is not None and isinstance(value.get(key), dict):
            return value[key]
    return None


def _rope_from_dict(cfg: dict, layer_type: str | None = None) -> tuple[float, dict | None, float]:
    """Return ``(rope_theta, rope_scaling, partial_rotary_factor)`` from a config dict written in 4.x or 5.x style.

    ``rope_theta`` and ``partial_rotary_factor`` may sit at the top level or inside ``rope_parameters`` /
    ``rope_scaling`` (the dict wins, as in Transformers 5); RoPE parameters nested per layer type are reduced to
    the draft layer's type. ``rope_theta`` defaults to 10000 only when given nowhere.
    """
    params = _pick_layer_type(cfg.get("rope_parameters"), layer_type)
    scaling = _pick_layer_type(cfg.get("rope_scaling"), layer_type)
    theta, partial = cfg.get("rope_theta"), cfg.get("partial_rotary_factor")
    chosen = None
    for d in (scaling, params):  # later wins: rope_parameters over rope_scaling over the top level
        if isinstance(d, dict):
            theta = d["rope_theta"] if d.get("rope_theta") is not None else theta
            partial = d["partial_rotary_factor"] if d.get("partial_rotary_factor") is not None else partial
            d = {k: v for k, v in d.items() if k not in ("rope_theta", "partial_rotary_factor")}
            if "type" in d and "rope_type" not in d:
                d["rope_type"] = d.pop("type")
            if d.get("rope_type", "default") != "default":
                chosen = d
    return float(theta if theta is not None else 10000.0), chosen, float(partial if partial is not None else 1.0)


_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
    "initializer_range",
)

# Fields of a draft config that hf-eagle3 reads (any layout), and fields known not to change the draft's math.
_READ_FIELDS = set(_LAYER_FIELDS) | {
    "vocab_size", "draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
    "norm_output", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "layer_types",
    "sliding_window", "use_sliding_window", "max_window_layers", "eagle_config", "eagle_aux_hidden_state_layer_ids",
    "transformer_layer_config", "speculators_config", "speculators_model_type", "target_name_or_path", "model_type",
    "architectures", "use_qk_norm", "num_hidden_layers", "tie_word_embeddings",
}
_HARMLESS_FIELDS = {
    "torch_dtype", "dtype", "transformers_version", "_name_or_path", "auto_map", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "pretraining_tp", "attention_dropout", "speculators_version", "embed_requires_grad",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "tokenizer_class",
    "is_decoder", "is_encoder_decoder", "add_cross_attention", "problem_type", "chunk_size_feed_forward",
    "tie_encoder_decoder", "cross_attention_hidden_size", "finetuning_task", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "pruned_heads", "torchscript", "hidden_dropout",
    "cache_implementation", "has_no_defaults_at_init", "keys_to_ignore_at_inference", "base_model_tp_plan",
    "base_model_pp_plan", "head_dim_scaling", "draft_id_to_target_id", "target_layer_count",
}
# Fields whose non-neutral values change the draft's computation in ways hf-eagle3 does not implement: an error.
_MATH_FIELDS = {
    "num_hidden_layers": 1,
    "logit_scale": 1.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_aux_norm": False,
    "sliding_window_non_causal": False,
    "parallel_draft_step": 1,
    "use_aux_hidden_state": True,
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
}
_MATH_MEANING = {
    "num_hidden_layers": "a draft with several decoder layers",
    "logit_scale": "scaled draft logits",
    "final_logit_softcapping": "soft-capped draft logits",
    "attn_logit_softcapping": "soft-capped attention scores",
    "use_aux_norm": "an extra norm on the auxiliary hidden states",
    "sliding_window_non_causal": "non-causal sliding-window attention",
    "parallel_draft_step": "parallel drafting",
    "use_aux_hidden_state": "an EAGLE draft without the fused target features",
    "use_input_layernorm_in_first_layer": "no input_layernorm on the embeddings",
    "use_last_layernorm": "no final norm",
    "use_mtp_layernorm": "MTP layer norms",
}
# Keys of ModelOpt's `eagle_config` known not to change the math when the ones above are neutral.
_EAGLE_CONFIG_HARMLESS = {"eagle_aux_hidden_state_layer_ids", "norm_before_fc", "norm_output", "next_layer_regular",
                          "parallel_draft_heads_num_layers", "eagle_decoder_type", "has_lm_head", "draft_vocab_size",
                          "use_aux_hidden_state", "use_input_layernorm_in_first_layer", "use_last_layernorm",
                          "use_mtp_layernorm", "parallel_draft_step"}


def _is_neutral(value, neutral) -> bool:
    if value is None or value == neutral:
        return True
    return neutral is False and value is False or neutral is None and value in (0, False)


def check_fields(cfg: dict, layout: str, source: str | os.PathLike = "config.json") -> list[str]:
    """Check a draft config for fields hf-eagle3 does not read.

    Fields that change the draft's computation in a way hf-eagle3 does not implement (several draft layers, logit
    scaling, ModelOpt options off their EAGLE-3 value, ...) raise an error naming them. Other fields hf-eagle3 does
    not know are returned (the loader warns once about them).

    Args:
        cfg (`dict`): the parsed ``config.json``.
        layout (`str`): what :func:`detect_layout` returned.
        source (`str`): the file, named in messages.

    Returns:
        The names of the ignored unknown fields (dotted for nested ones).

    Raises:
        DraftConfigError: naming each math-changing field that is set.
    """
    if layout == "native":
        return []
    scopes = [("", cfg)]
    if layout == "speculators" and isinstance(cfg.get("transformer_layer_config"), dict):
        scopes.append(("transformer_layer_config.", cfg["transformer_layer_config"]))
    if isinstance(cfg.get("eagle_config"), dict):
        scopes.append(("eagle_config.", cfg["eagle_config"]))
    bad, unknown = [], []
    for prefix, fields in scopes:
        for key, value in fields.items():
            if key in _MATH_FIELDS and not _is_neutral(value, _MATH_FIELDS[key]):
                if key == "num_hidden_layers" and prefix == "eagle_config.":
                    continue
                bad.append(f"'{prefix}{key}' = {value!r} ({_MATH_MEANING[key]})")
            elif prefix == "eagle_config.":
                if key not in _EAGLE_CONFIG_HARMLESS:
                    unknown.append(prefix + key)
            elif key not in _READ_FIELDS | _HARMLESS_FIELDS | set(_MATH_FIELDS) and not key.startswith("_"):
                unknown.append(prefix + key)
    if bad:
        raise DraftConfigError(
            f"{source}: this draft uses fields that change its computation and that hf-eagle3 does not implement: "
            + "; ".join(bad) + ". Loading it anyway would draft with other math than it was trained with; set the "
            "field to its EAGLE-3 value only if the checkpoint does not actually use it."
        )
    return unknown


def _sliding_window(layer: dict, source) -> int | None:
    """The draft layer's sliding window as vLLM reads it: ``layer_types`` (draft-relative: entry 0 is the draft
    layer, vLLM subtracts the target's layer count from the layer index) says ``sliding_attention`` and
    ``sliding_window`` gives the width; without ``layer_types`` the attention is full."""
    types = layer.get("layer_types")
    if not types:
        return None
    if not isinstance(types, list) or types[0] not in _LAYER_TYPE_NAMES:
        raise DraftConfigError(f"{source}: 'layer_types' is {types!r}; the draft layer (entry 0) must be "
                               "'full_attention' or 'sliding_attention'.")
    if types[0] != "sliding_attention":
        return None
    window = layer.get("sliding_window")
    if not _is_positive_int(window):
        raise DraftConfigError(f"{source}: the draft layer is 'sliding_attention' but 'sliding_window' is "
                               f"{window!r}; expected a positive integer.")
    return window


def _nested_first(cfg: dict, key: str, default=False):
    """ModelOpt keeps some flags inside ``eagle_config``; vLLM reads the nested value before the top-level one."""
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if eagle.get(key) is not None:
        return eagle[key]
    return cfg.get(key, default)


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


def config_dict_to_native(cfg: dict, source: str | os.PathLike = "config.json") -> tuple[dict, str]:
    """Convert a published draft ``config.json`` dict to :class:`Eagle3Config` keyword arguments.

    Layer ids are converted to our convention (index i = input of layer i): the `speculators` top-level
    ``eagle_aux_hidden_state_layer_ids`` already use it; SGLang/SpecForge ``eagle_config.eagle_aux_hidden_state_layer_ids``
    name the OUTPUT of a layer, so 1 is added. Unknown fields that change the math raise an error; other unknown
    fields are ignored with one warning.

    Args:
        cfg (`dict`): the parsed ``config.json`` (not modified).
        source (`str`): the file, named in errors.

    Returns:
        ``(kwargs, layout)``: keyword arguments for :class:`Eagle3Config` (plus ``_num_assistant_tokens`` when a
        `speculators` config names its draft length) and the layout name (see :func:`detect_layout`).
    """
    layout = check_config_dict(cfg, source)
    unknown = check_fields(cfg, layout, source)
    if unknown:
        warnings.warn(f"{source}: ignoring fields hf-eagle3 does not read (not known to change the draft's math): "
                      f"{', '.join(sorted(unknown))}.", UserWarning, stacklevel=3)
    cfg = copy.deepcopy(cfg)
    if layout == "native":
        for k in ("transformers_version", "model_type", "auto_map"):
            cfg.pop(k, None)
        return cfg, layout
    layer = dict(cfg.get("transformer_layer_config") or {}) if layout == "speculators" else cfg
    out = {k: layer[k] for k in _LAYER_FIELDS if layer.get(k) is not None}
    out["vocab_size"] = layer.get("vocab_size", cfg.get("vocab_size"))
    window = _sliding_window(layer, source)
    out["draft_sliding_window"] = window
    layer_type = (layer.get("layer_types") or [None])[0]
    out["rope_theta"], out["draft_rope_scaling"], out["partial_rotary_factor"] = _rope_from_dict(layer, layer_type)
    out["draft_vocab_size"] = cfg.get("draft_vocab_size") or out["vocab_size"]
    out["target_hidden_size"] = cfg.get("target_hidden_size")
    out["norm_before_fc"] = bool(_nested_first(cfg, "norm_before_fc"))
    out["norm_output"] = bool(_nested_first(cfg, "norm_output"))
    out["fc_norm"] = bool(cfg.get("fc_norm", False))
    out["has_embed_tokens"] = False  # decided from the weights by the loader
    if out["norm_before_fc"] and out["fc_norm"]:
        raise DraftConfigError(f"{source}: 'norm_before_fc' and 'fc_norm' are both set; a draft has one or the "
                               "other (speculators refuses both).")
    if layer.get("model_type") == "qwen3" or layer.get("use_qk_norm") or any(
            a.startswith("Qwen3") for a in layer.get("architectures") or []):
        out["qk_norm"] = True
    if layout == "speculators":
        nbr = cfg.get("norm_before_residual")
        out["norm_before_residual"] = True if nbr is None else bool(nbr)  # vLLM's default for this layout
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        out["feature_layer_ids"] = list(ids) if ids else None
        verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
        out["target_name_or_path"] = verifier.get("name_or_path")
        proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
        if proposals and proposals[0].get("speculative_tokens"):
            out["_num_assistant_tokens"] = int(proposals[0]["speculative_tokens"])
        return out, layout
    out["norm_before_residual"] = bool(cfg.get("norm_before_residual", False))
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        out["feature_layer_ids"] = [i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    elif cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["feature_layer_ids"] = list(cfg["eagle_aux_hidden_state_layer_ids"])
    return out, layout


def _rope_fields(config: Eagle3Config, out: dict) -> None:
    """Write the draft's RoPE (``rope_theta`` at the top level, read by every engine; scaling and partial factor)."""
    out["rope_theta"] = config.rope_theta
    if config.draft_rope_scaling:
        out["rope_scaling"] = dict(config.draft_rope_scaling)
    if config.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = config.partial_rotary_factor


def _window_fields(config: Eagle3Config, out: dict) -> None:
    """Write a sliding-window draft layer as vLLM and speculators read it (``layer_types`` + ``sliding_window``)."""
    if config.draft_sliding_window:
        out["layer_types"] = ["sliding_attention"]
        out["sliding_window"] = config.draft_sliding_window


def native_to_flat_config(config: Eagle3Config) -> dict[str, Any]:
    """Return a flat-layout ``config.json`` dict (as the EAGLE authors / SGLang publish) for ``config``.

    Written as the EAGLE authors' own checkpoints are: ``target_hidden_size`` only when it differs from
    ``hidden_size`` (the reference ``EaModel`` reads that key as "the draft has its own embedding"), the optional
    variants only when the draft uses them. Layer ids are written in SGLang's ``eagle_config`` convention (output of
    layer id, i.e. ours minus 1).

    Args:
        config (`Eagle3Config`): the draft's configuration.
    """
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    for k in _LAYER_FIELDS:
        out[k] = getattr(config, k)
    _rope_fields(config, out)
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    for flag in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm"):
        if getattr(config, flag):
            out[flag] = True
    _window_fields(config, out)
    if config.feature_layer_ids is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.feature_layer_ids]}
    return out


def native_to_speculators_config(config: Eagle3Config, num_speculative_tokens: int = 5) -> dict[str, Any]:
    """Return a `speculators`-layout ``config.json`` dict (as vLLM and speculators load) for ``config``.

    Layer ids are written as top-level ``eagle_aux_hidden_state_layer_ids`` (our convention: input of layer i);
    ``norm_before_residual`` always (a missing value means true to vLLM), ``norm_output`` / ``norm_before_fc`` /
    ``fc_norm`` when set, a sliding window as ``transformer_layer_config.layer_types`` / ``sliding_window``.

    Args:
        config (`Eagle3Config`): the draft's configuration.
        num_speculative_tokens (`int`): ``speculative_tokens`` of the greedy proposal method (vLLM's default draft
            length).
    """
    layer = {
        "model_type": "qwen3" if config.qk_norm else "llama",
        "architectures": ["Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    for k in _LAYER_FIELDS:
        layer[k] = getattr(config, k)
    _rope_fields(config, layer)
    _window_fields(config, layer)
    out = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": bool(config.norm_before_residual),
        "target_hidden_size": config.target_hidden_size,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "verifier": {"name_or_path": config.target_name_or_path, "architectures": []},
        },
    }
    for flag in ("norm_output", "norm_before_fc", "fc_norm"):
        if getattr(config, flag):
            out[flag] = True
    if config.feature_layer_ids is not None:
        out["eagle_aux_hidden_state_layer_ids"] = list(config.feature_layer_ids)
    return out
