"""Write EAGLE-3 drafts in the layouts other tools load: a ``trust_remote_code`` bundle, the flat layout of the EAGLE
authors / SGLang, the `speculators` layout of vLLM, and OpenVINO IR for OpenVINO GenAI (:mod:`.openvino`).

Python API: :func:`export_remote_code`, :func:`export_native`, :func:`export_flat`, :func:`export_speculators`,
:func:`export_openvino` and the dispatcher :func:`export_draft`. Command line:
``hf-eagle3 export SRC DIR [--remote-code] [--format native|flat|speculators|openvino] [--dtype bf16|fp16|fp32]
[--num-spec-tokens K] [--target T] [--optimum-cli PATH]`` (the ``hf-eagle3`` entry point calls :func:`register`).

What each engine reads (checked against vLLM's ``llama_eagle3.py`` / speculators config adapter and SGLang's
``llama_eagle3.py``):

* **SGLang** (flat layout, ``architectures: ["LlamaForCausalLMEagle3"]``): a Llama config (``hidden_size``,
  ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
  ``rope_theta`` / ``rope_scaling``, ``vocab_size`` = target vocabulary, ``num_hidden_layers`` = 1) plus
  ``draft_vocab_size``, ``target_hidden_size`` and ``tie_word_embeddings`` (must be ``false``: when true SGLang uses
  ``embed_tokens`` as the lm_head). Feature layers come from ``eagle_config.eagle_aux_hidden_state_layer_ids`` in the
  OUTPUT-of-layer convention (SGLang captures the output of layer ``id``, i.e. our index ``id + 1``). Weights:
  ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, optional ``embed_tokens.weight``; ``d2t``
  (offsets, turned into hot token ids) is read, ``t2d`` is skipped. SGLang ignores ``norm_before_residual``.
* **vLLM** (flat or `speculators` layout): the same Llama fields, ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual`` (for the `speculators` layout a missing value means ``true``) and
  ``eagle_aux_hidden_state_layer_ids`` at the TOP level of the draft config, in the INPUT-of-layer convention (ours).
  For the `speculators` layout the decoder fields live in ``transformer_layer_config``, and
  ``speculators_config.proposal_methods[0].speculative_tokens`` and ``speculators_config.verifier.name_or_path`` must
  be present. Weights: ``fc.weight``, ``midlayer.*`` or ``layers.0.*`` (both accepted), ``norm.weight``,
  ``lm_head.weight``, optional ``embed_tokens.weight``; ``d2t`` is loaded as ``draft_id_to_target_id``, ``t2d`` is
  skipped.

The 2026 variants (``norm_output``, ``norm_before_fc``, ``fc_norm``, a sliding window as ``layer_types`` /
``sliding_window``, ``partial_rotary_factor``) are written only when the draft uses them, and ``target_hidden_size``
in the flat layout only when it differs from ``hidden_size`` (the EAGLE reference reads that key as "the draft has
its own embedding"). docs/layouts.md has the table of what each engine reads from each key.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ..core.config_layouts import native_to_flat_config, native_to_speculators_config
from ..core.configuration_eagle3 import FEATURE_LAYERS
from ..core.modeling_eagle3 import Eagle3DraftModel
from ..core.settings import SAVED_DRAFT_SETTINGS, SCHEDULES
from ..loading import load_target, parse_dtype
from .openvino import (
    check_openvino_layout,
    check_output_dir,
    convert_flat,
    find_optimum_cli,
    openvino_layer_ids,
    optimum_weight_format,
)
from .parsers import DEFAULT_SCHEDULE, DTYPES, FORMATS  # noqa: F401  (DTYPES: importable from here)
from .parsers import add_export_parser as register  # noqa: F401  (the parser, kept importable from here)

CORE_DIR = Path(__file__).resolve().parents[1] / "core"
# The files a remote-code bundle carries: every module of the core folder (its ``__init__`` is the folder's map).
# ``auto_entry.py`` is what ``AutoModel`` loads: the draft class, plus the hook.
CORE_FILES = tuple(sorted(p.name for p in CORE_DIR.glob("*.py") if p.name != "__init__.py"))
AUTO_MAP = {"AutoConfig": "configuration_eagle3.Eagle3Config", "AutoModel": "auto_entry.Eagle3DraftModel"}
WEIGHTS_NAME = "model.safetensors"


def as_draft(draft_or_path) -> Eagle3DraftModel:
    """Return ``draft_or_path`` itself when it is a draft, else load it with :meth:`Eagle3DraftModel.from_pretrained`.

    Args:
        draft_or_path (`Eagle3DraftModel`, `str` or `os.PathLike`): a draft, or a directory / Hub id holding one in
            any supported layout (native, flat, `speculators`).
    """
    if isinstance(draft_or_path, torch.nn.Module):
        if not getattr(type(draft_or_path), "_is_eagle3_draft", False):
            raise TypeError(f"{type(draft_or_path).__name__} is not an EAGLE-3 draft.")
        return draft_or_path
    return Eagle3DraftModel.from_pretrained(str(draft_or_path))


def _state_dict(draft, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The draft's tensors (native names) as contiguous CPU copies, floats cast to ``dtype``."""
    out = {}
    for name, tensor in draft.state_dict().items():
        tensor = tensor.detach().to("cpu")
        if name == "d2t":
            tensor = tensor.long()
        elif name == "t2d":
            tensor = tensor.bool()
        elif tensor.is_floating_point() and dtype is not None:
            tensor = tensor.to(dtype)
        out[name] = tensor.clone().contiguous()
    return out


def _dtype_name(state: dict[str, torch.Tensor]) -> str:
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    return str(floats[0] if floats else torch.float32).split(".")[-1]


def _write_generation_config(draft, out_dir: Path, num_assistant_tokens: int | None = None) -> None:
    """Write the draft-length settings that ``Eagle3DraftModel.from_pretrained`` reads back."""
    gen = {}
    for key in SAVED_DRAFT_SETTINGS:
        value = getattr(draft.generation_config, key, None)
        if value is not None:
            gen[key] = value
    if num_assistant_tokens is not None:
        gen["num_assistant_tokens"] = int(num_assistant_tokens)
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _save_safetensors(state: dict[str, torch.Tensor], out_dir: Path) -> None:
    from safetensors.torch import save_file

    save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})


def export_native(draft_or_path, out_dir: str | os.PathLike, dtype=None) -> Path:
    """Write a draft in our native layout with ``save_pretrained`` (``config.json`` of ``model_type: eagle3_draft``).

    Args:
        draft_or_path (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or a checkpoint in any supported
            layout (see :func:`load_draft`).
        out_dir (`str` or `os.PathLike`): the directory to write (created if needed).
        dtype (`torch.dtype` or `str`, *optional*): dtype of the floating weights (``"bf16"``, ``"fp16"``,
            ``"fp32"`` or a torch dtype); default: as the draft is. ``d2t`` stays int64 and ``t2d`` bool.

    Returns:
        `Path`: ``out_dir``.
    """
    draft = as_draft(draft_or_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = _state_dict(draft, parse_dtype(dtype))
    dtype_name = _dtype_name(state)
    draft.save_pretrained(str(out), state_dict=state)  # consumes `state`
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = dtype_name  # save_pretrained records the in-memory dtype, not the written one
    config["architectures"] = ["Eagle3DraftModel"]
    config.pop("auto_map", None)  # a remote-code draft re-saved natively carries no code
    _write_json(out / "config.json", config)
    _write_generation_config(draft, out)
    return out


def export_remote_code(draft_or_path, out_dir: str | os.PathLike, dtype=None) -> Path:
    """Write a ``trust_remote_code`` bundle: the native checkpoint plus the core files and an ``auto_map``.

    In an environment where ``hf_eagle3`` is not installed,
    ``AutoModel.from_pretrained(out_dir, trust_remote_code=True)`` returns the draft, and importing the bundled
    ``auto_entry.py`` (the module ``auto_map`` names) installs the ``generate`` hook, so ``target.generate(ids, assistant_model=draft)`` runs
    EAGLE-3 decoding. Without ``trust_remote_code=True``, Transformers refuses with its usual ``ValueError`` (unless
    ``hf_eagle3`` is imported, which registers the model type locally).

    The bundle holds all the core files (:data:`CORE_FILES`): Transformers copies a module's relative imports
    recursively (also those inside functions).

    Args:
        draft_or_path (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or a checkpoint in any supported
            layout (native, flat, `speculators`): published checkpoints are converted on the way.
        out_dir (`str` or `os.PathLike`): the directory to write (created if needed).
        dtype (`torch.dtype` or `str`, *optional*): dtype of the floating weights; default: as the draft is.

    Returns:
        `Path`: ``out_dir``.
    """
    out = export_native(draft_or_path, out_dir, dtype=dtype)
    source = CORE_DIR
    for name in CORE_FILES:
        shutil.copyfile(source / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = dict(AUTO_MAP)
    _write_json(out / "config.json", config)
    return out


def check_three_layers(draft, layout: str) -> None:
    """
    Refuse, before anything is written, a draft that reads other than three target layers for a layout whose
    engines fuse exactly three (SGLang's, vLLM's and the EAGLE reference's ``fc`` takes ``3 x target_hidden_size``).

    Args:
        draft (`Eagle3DraftModel`): the draft.
        layout (`str`): the layout asked for (named in the error).

    Raises:
        ValueError: naming the layouts that keep more layers.
    """
    config = draft.config
    if config.num_feature_layers != FEATURE_LAYERS:
        raise ValueError(
            f"The {layout} layout is read by engines whose EAGLE-3 drafts fuse exactly {FEATURE_LAYERS} target layers "
            f"(fc of width {FEATURE_LAYERS} x target_hidden_size: SGLang, vLLM, the EAGLE reference); this draft reads "
            f"{config.num_feature_layers} ({config.feature_layer_ids}). Export it with --format native or "
            "--remote-code (Transformers and hf-eagle3 read any number), or train a draft on three layers."
        )


def flat_config(draft, dtype_name: str | None = None) -> dict:
    """Return the flat-layout ``config.json`` dict of ``draft`` (what SGLang and vLLM read, see the module doc).

    Args:
        draft (`Eagle3DraftModel`): the draft.
        dtype_name (`str`, *optional*): value of ``torch_dtype`` (e.g. ``"bfloat16"``).
    """
    check_three_layers(draft, "flat")
    config = draft.config
    out = native_to_flat_config(config)
    if config.feature_layer_ids is not None:
        # vLLM reads the top-level key (input-of-layer ids); SGLang the eagle_config one (output-of-layer ids).
        out["eagle_aux_hidden_state_layer_ids"] = list(config.feature_layer_ids)
    if config.qk_norm:
        out["model_type"] = "qwen3"
    if config.target_name_or_path:
        out["target_name_or_path"] = config.target_name_or_path
    if dtype_name:
        out["torch_dtype"] = dtype_name
    return out


def export_flat(draft, out_dir: str | os.PathLike, dtype=None) -> Path:
    """Write a draft in the flat EAGLE-3 layout of the EAGLE authors and SGLang (also loaded by vLLM).

    ``config.json`` comes from :func:`native_to_flat_config` (a Llama config with ``architectures:
    ["LlamaForCausalLMEagle3"]``); layer ids are written twice when the draft pins them: in
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's output-of-layer convention (ours minus one), and at
    the top level in vLLM's input-of-layer convention. Weights go to ``model.safetensors`` under the flat names
    (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``).

    Args:
        draft (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or a checkpoint in any supported layout.
        out_dir (`str` or `os.PathLike`): the directory to write (created if needed).
        dtype (`torch.dtype` or `str`, *optional*): dtype of the floating weights; default: as the draft is.

    Returns:
        `Path`: ``out_dir``.
    """
    draft = as_draft(draft)
    state = _state_dict(draft, parse_dtype(dtype))
    config = flat_config(draft, _dtype_name(state))  # refuses what the layout cannot hold, before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(state, out)
    _write_json(out / "config.json", config)
    _write_generation_config(draft, out)
    return out


def speculators_config(draft, num_speculative_tokens: int | None = None, dtype_name: str | None = None) -> dict:
    """Return the `speculators`-layout ``config.json`` dict of ``draft`` (what vLLM reads, see the module doc).

    Args:
        draft (`Eagle3DraftModel`): the draft.
        num_speculative_tokens (`int`, *optional*): ``speculative_tokens`` of the greedy proposal method; defaults to
            the draft's ``generation_config.num_assistant_tokens`` (5 unless set).
        dtype_name (`str`, *optional*): value of ``torch_dtype`` in ``transformer_layer_config``.

    """
    check_three_layers(draft, "speculators")
    config = draft.config
    if num_speculative_tokens is None:
        num_speculative_tokens = int(getattr(draft.generation_config, "num_assistant_tokens", None) or 5)
    out = native_to_speculators_config(config, num_speculative_tokens=int(num_speculative_tokens))
    if dtype_name:
        out["transformer_layer_config"]["torch_dtype"] = dtype_name
    return out


def export_speculators(
    draft, out_dir: str | os.PathLike, num_speculative_tokens: int | None = None, dtype=None, target=None
) -> Path:
    """Write a draft in the `speculators` layout that vLLM loads natively.

    ``config.json`` comes from :func:`native_to_speculators_config` (``speculators_model_type: "eagle3"``, the draft
    layer's decoder config under ``transformer_layer_config``, layer ids at the top level in the input-of-layer
    convention). Weights go to ``model.safetensors`` with ``midlayer.`` renamed ``layers.0.``; ``d2t`` and ``t2d`` are
    kept.

    Args:
        draft (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or a checkpoint in any supported layout.
        out_dir (`str` or `os.PathLike`): the directory to write (created if needed).
        num_speculative_tokens (`int`, *optional*): tokens per drafting round recorded in the config (vLLM's default
            ``num_speculative_tokens``); defaults to the draft's ``num_assistant_tokens`` (5 unless set).
        dtype (`torch.dtype` or `str`, *optional*): dtype of the floating weights; default: as the draft is.
        target (`PreTrainedModel`, *optional*): the target, for a draft that shares the target's embedding (or such
            a draft already bound to its target): the embedding is written as ``embed_tokens.weight``, as
            speculators' own checkpoints carry it (speculators' loader does not take the verifier's embedding when
            it is missing, vLLM does). Without it such a draft is written without one, with a warning.

    Returns:
        `Path`: ``out_dir``.
    """
    draft = as_draft(draft)
    state = _state_dict(draft, parse_dtype(dtype))
    # refuses what the layout cannot hold, before anything is written (embed_tokens, added below, has this dtype)
    config = speculators_config(draft, num_speculative_tokens, _dtype_name(state))
    if "embed_tokens.weight" not in state:
        if target is not None:
            draft.bind_target(target)  # checks that the draft fits the target before anything is written
        embedding = draft.get_input_embeddings()
        if embedding is not None:
            floats = [v.dtype for v in state.values() if v.is_floating_point()]
            state["embed_tokens.weight"] = embedding.weight.detach().to("cpu", floats[0] if floats else None).contiguous()
        else:
            warnings.warn(
                "This draft shares its target's embedding and no target was given: the speculators checkpoint has no "
                "embed_tokens.weight. vLLM reads the target's embedding, but speculators' own from_pretrained does "
                "not; pass the target (`hf-eagle3 export --target TARGET`, or target= / a bound draft) to include it.",
                stacklevel=2,
            )
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(state, out)
    _write_json(out / "config.json", config)
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    _write_generation_config(draft, out, num_assistant_tokens=k)
    return out


def export_openvino(
    draft,
    out_dir: str | os.PathLike,
    dtype=None,
    optimum_cli: str | os.PathLike | None = None,
    num_target_layers: int | None = None,
) -> Path:
    """Convert a draft to OpenVINO IR for OpenVINO GenAI, its captured layers written where GenAI reads them.

    The checks come first (weights format, output folder, optimum-cli, a layout GenAI can run, the layer list), then
    the flat layout goes to a temporary folder and :func:`~hf_eagle3.checkpoints.openvino.convert_flat` converts it.
    A failure leaves nothing behind (:mod:`hf_eagle3.checkpoints.openvino` has what GenAI reads and why).

    Args:
        draft (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or a checkpoint in any supported layout.
        out_dir (`str` or `os.PathLike`): the folder to write (new, or empty).
        dtype (`str` or `torch.dtype`, *optional*): ``"fp32"`` (default) or ``"fp16"`` weights in the IR.
        optimum_cli (`str` or `os.PathLike`, *optional*): optimum-intel's ``optimum-cli`` (default: on ``PATH``).
        num_target_layers (`int`, *optional*): the target's layer count, for a draft that does not pin its layers.

    Returns:
        `Path`: ``out_dir``, holding ``openvino_model.xml`` / ``.bin`` and the draft's ``config.json``.
    """
    fmt = optimum_weight_format(dtype)
    check_output_dir(out_dir)
    program = find_optimum_cli(optimum_cli)
    draft = as_draft(draft)
    check_openvino_layout(draft.config)
    layers = openvino_layer_ids(draft.config, num_target_layers)
    with tempfile.TemporaryDirectory(prefix="hf_eagle3_flat_") as tmp:
        export_flat(draft, tmp, dtype=fmt)
        return convert_flat(tmp, out_dir, layers, weight_format=fmt, optimum_cli=program)


def export_draft(
    src,
    out_dir: str | os.PathLike,
    format: str = "native",
    remote_code: bool = False,
    dtype=None,
    num_speculative_tokens: int | None = None,
    schedule: str | None = DEFAULT_SCHEDULE,
    target=None,
    optimum_cli: str | os.PathLike | None = None,
) -> Path:
    """Convert a draft to the layout asked for (the ``hf-eagle3 export`` command).

    Args:
        src (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or a checkpoint in any supported layout.
        out_dir (`str` or `os.PathLike`): the directory to write.
        format (`str`): ``"native"``, ``"flat"``, ``"speculators"`` or ``"openvino"`` (OpenVINO IR for OpenVINO
            GenAI, see :mod:`hf_eagle3.checkpoints.openvino`).
        remote_code (`bool`): write a ``trust_remote_code`` bundle (native layout plus the core files).
        dtype (`torch.dtype` or `str`, *optional*): dtype of the floating weights (``"bf16"``, ``"fp16"``,
            ``"fp32"``); default: as stored.
        num_speculative_tokens (`int`, *optional*): for ``format="speculators"``, see :func:`export_speculators`.
        schedule (`str`, *optional*): the ``num_assistant_tokens_schedule`` written to ``generation_config.json``
            (default ``"auto"``: the length, drafting nothing included, chosen each round from costs measured where
            the draft runs); ``None`` keeps the draft's.
        target (`PreTrainedModel`, *optional*): for ``format="speculators"``, see :func:`export_speculators`; for
            ``format="openvino"``, the target (or its config) whose layer count resolves a draft's default layers.
        optimum_cli (`str` or `os.PathLike`, *optional*): for ``format="openvino"``, optimum-intel's ``optimum-cli``
            (default: the one on ``PATH``).

    Returns:
        `Path`: ``out_dir``.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if remote_code and format != "native":
        raise ValueError(
            "--remote-code writes the native layout (Transformers builds the config class from config.json, so the "
            "bundle cannot also be a flat or speculators checkpoint). Convert published checkpoints by passing them "
            "as SRC with --remote-code."
        )
    if num_speculative_tokens is not None and format != "speculators":
        raise ValueError("--num-spec-tokens only applies to --format speculators.")
    if optimum_cli is not None and format != "openvino":
        raise ValueError("--optimum-cli only applies to --format openvino.")
    if target is not None and format not in ("speculators", "openvino"):
        raise ValueError("--target only applies to --format speculators or openvino.")
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {schedule!r}")
    draft = as_draft(src)
    saved = draft.generation_config.num_assistant_tokens_schedule
    if schedule is not None:
        draft.generation_config.num_assistant_tokens_schedule = schedule
    try:
        if remote_code:
            return export_remote_code(draft, out_dir, dtype=dtype)
        if format == "native":
            return export_native(draft, out_dir, dtype=dtype)
        if format == "flat":
            return export_flat(draft, out_dir, dtype=dtype)
        if format == "openvino":
            config = getattr(target, "config", target)
            layers = config.get_text_config().num_hidden_layers if config is not None else None
            return export_openvino(draft, out_dir, dtype=dtype, optimum_cli=optimum_cli, num_target_layers=layers)
        return export_speculators(draft, out_dir, num_speculative_tokens=num_speculative_tokens, dtype=dtype,
                                  target=target)
    finally:
        draft.generation_config.num_assistant_tokens_schedule = saved  # a draft passed in is left as it was


def _run(args: argparse.Namespace) -> int:
    """Run ``hf-eagle3 export``: 0 on success, 2 for conflicting options, 1 when the draft cannot be converted."""
    if args.remote_code and args.format != "native":
        print("hf-eagle3 export: error: --remote-code writes the native layout; drop --format "
              f"{args.format} (pass a flat or speculators checkpoint as SRC to convert it).", file=sys.stderr)
        return 2
    if args.target is not None and args.format not in ("speculators", "openvino"):
        print("hf-eagle3 export: error: --target only applies to --format speculators or openvino.", file=sys.stderr)
        return 2
    if args.optimum_cli is not None and args.format != "openvino":
        print("hf-eagle3 export: error: --optimum-cli only applies to --format openvino.", file=sys.stderr)
        return 2
    if args.num_spec_tokens is not None and args.format != "speculators":
        print("hf-eagle3 export: error: --num-spec-tokens only applies to --format speculators.", file=sys.stderr)
        return 2
    try:
        out = export_draft(
            args.src,
            args.out_dir,
            format=args.format,
            remote_code=args.remote_code,
            dtype=args.dtype,
            num_speculative_tokens=args.num_spec_tokens,
            schedule=None if args.schedule == "keep" else args.schedule,
            target=_target_for(args),
            optimum_cli=args.optimum_cli,
        )
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        print(f"hf-eagle3 export: error: {err}", file=sys.stderr)
        return 1
    kind = "remote-code bundle" if args.remote_code else f"{args.format} checkpoint"
    print(f"wrote {kind} to {out}")
    return 0


def _target_for(args: argparse.Namespace):
    """The ``--target`` an export needs: the model (speculators: its embedding) or only its config (openvino)."""
    if not args.target:
        return None
    if args.format == "openvino":
        from transformers import AutoConfig

        from ..smollm2 import smollm2_path

        return AutoConfig.from_pretrained(str(smollm2_path()) if args.target == "smollm2" else args.target)
    return load_target(args.target, tokenizer="none")[0]
