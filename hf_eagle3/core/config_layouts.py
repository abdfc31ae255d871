"""The published layouts of a draft's ``config.json`` ("flat": the EAGLE authors, SGLang, SpecForge; "speculators":
vLLM's draft library; see :func:`~hf_eagle3.core.configuration_eagle3.detect_layout`): which of their fields hf-eagle3
reads, which change the draft's math (an error when hf-eagle3 does not implement them), and the conversions to
:class:`~hf_eagle3.core.configuration_eagle3.Eagle3Config` keyword arguments and back.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

from .configuration_eagle3 import DraftConfigError, Eagle3Config, _is_positive_int, check_config_dict
from .settings import DEFAULT_DRAFT_LENGTH

_LAYER_TYPE_NAMES = ("full_attention", "sliding_attention")


def outputs_of_layers(ids) -> list[int]:
    """Layer ids in the output-of-layer convention (SGLang's ``eagle_config``, OpenVINO GenAI's
    ``hidden_layers_list``: the output of decoder layer ``i``) from ours (hidden state ``i``: the input of layer ``i``).

    Args:
        ids (`list[int]`): hidden-state indices in our convention (``0`` is the embedding output).
    """
    return [int(i) - 1 for i in ids]


def inputs_of_layers(ids) -> list[int]:
    """The inverse of :func:`outputs_of_layers`: output-of-layer ids to hidden-state indices (ours).

    Args:
        ids (`list[int]`): decoder layer ids whose outputs are read.
    """
    return [int(i) + 1 for i in ids]


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
        out["feature_layer_ids"] = inputs_of_layers(eagle["eagle_aux_hidden_state_layer_ids"])
    elif cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["feature_layer_ids"] = list(cfg["eagle_aux_hidden_state_layer_ids"])
    return out, layout


def _layer_fields(config: Eagle3Config, out: dict) -> dict:
    """Write the draft's decoder layer into ``out`` as every engine reads it: its shape and activation, its RoPE
    (``rope_theta`` at the top level; scaling and partial factor when used) and a sliding window as
    ``layer_types`` + ``sliding_window`` (vLLM and speculators); return ``out``."""
    for k in _LAYER_FIELDS:
        out[k] = getattr(config, k)
    out["rope_theta"] = config.rope_theta
    if config.draft_rope_scaling:
        out["rope_scaling"] = dict(config.draft_rope_scaling)
    if config.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = config.partial_rotary_factor
    if config.draft_sliding_window:
        out["layer_types"] = ["sliding_attention"]
        out["sliding_window"] = config.draft_sliding_window
    return out


def native_to_flat_config(config: Eagle3Config) -> dict[str, Any]:
    """Return a flat-layout ``config.json`` dict (as the EAGLE authors / SGLang publish) for ``config``.

    Written as the EAGLE authors' own checkpoints are: ``target_hidden_size`` only when it differs from
    ``hidden_size`` (the reference ``EaModel`` reads that key as "the draft has its own embedding"), the optional
    variants only when the draft uses them. Layer ids are written in SGLang's ``eagle_config`` convention (output of
    layer id, i.e. ours minus 1).

    Args:
        config (`Eagle3Config`): the draft's configuration.
    """
    out = _layer_fields(config, {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    })
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    for flag in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm"):
        if getattr(config, flag):
            out[flag] = True
    if config.feature_layer_ids is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": outputs_of_layers(config.feature_layer_ids)}
    return out


def native_to_speculators_config(config: Eagle3Config,
                                 num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH) -> dict[str, Any]:
    """Return a `speculators`-layout ``config.json`` dict (as vLLM and speculators load) for ``config``.

    Layer ids are written as top-level ``eagle_aux_hidden_state_layer_ids`` (our convention: input of layer i);
    ``norm_before_residual`` always (a missing value means true to vLLM), ``norm_output`` / ``norm_before_fc`` /
    ``fc_norm`` when set, a sliding window as ``transformer_layer_config.layer_types`` / ``sliding_window``.

    Args:
        config (`Eagle3Config`): the draft's configuration.
        num_speculative_tokens (`int`): ``speculative_tokens`` of the greedy proposal method (vLLM's default draft
            length).
    """
    layer = _layer_fields(config, {
        "model_type": "qwen3" if config.qk_norm else "llama",
        "architectures": ["Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    })
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
