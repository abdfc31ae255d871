"""Write an EAGLE-3 draft as OpenVINO IR that OpenVINO GenAI runs at the draft's own acceptance.

OpenVINO GenAI (``openvino_genai.draft_model`` + ``LLMPipeline``) runs EAGLE-3 drafts converted by optimum-intel's
``optimum-cli export openvino``. Two facts decide whether the converted draft is served as trained (checked against
openvino.genai's ``eagle3_model_transforms.cpp`` and optimum-intel 2.2.0's ``model_patcher.py``):

* **The captured layers.** GenAI reads them only from the draft IR's ``rt_info`` entry ``hidden_layers_list`` (three
  ints, the OUTPUT of decoder layer ``i``, i.e. our input-of-layer id minus one). optimum-intel writes
  ``eagle3_mode`` there but not the layer list, and GenAI then falls back to ``{2, N // 2, N - 3}`` of the target's
  ``N`` layers in its own convention: for a draft trained on other layers the outputs stay exact and acceptance
  drops, with no warning. :func:`write_openvino_layers` writes the entry; :func:`convert_flat` runs optimum-cli and
  writes it (``hf_eagle3.checkpoints.export.export_openvino`` is the whole path from a draft).
* **The layout.** optimum-intel rebuilds the draft as the classic EAGLE-3 layer (residual taken before
  ``hidden_norm``, no feature norms, no output norm, full attention, full rotary, bias-free ``q/k/v``) and GenAI
  swaps the draft's embedding for the target's. A draft outside that layout would convert with some weights ignored,
  so :func:`check_openvino_layout` refuses it before any work, naming what GenAI cannot run.

This module reads configurations and files only (no model code), so ``export.py`` builds on it.

optimum-intel 2.2.0 pins ``transformers<5.6`` (below hf-eagle3's floor), so ``optimum-cli`` lives in an environment
of its own and :func:`convert_flat` calls it as a program (docs/layouts.md has the setup). optimum-intel builds
every EAGLE-3 draft from its own modelling file through Transformers' remote-code loader, hence its
``--trust-remote-code``; the flat checkpoint handed to it carries no code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from ..core.config_layouts import outputs_of_layers

IR_NAME = "openvino_model.xml"
# optimum-cli --weight-format for each --dtype; bf16 weights are not a storage format of the IR (OpenVINO's CPU
# plugin chooses bf16 execution itself where the hardware has it).
WEIGHT_FORMATS = {None: "fp32", "fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16"}
OPTIMUM_SETUP = (
    "python -m venv ov-env && ov-env/bin/pip install optimum-intel==2.2.0 openvino==2026.4.1 "
    "openvino-tokenizers==2026.4.1.0 openvino-genai==2026.4.1.0 diffusers einops 'huggingface-hub>=1.5,<1.22'"
)


def check_openvino_layout(config) -> None:
    """Raise `ValueError` when OpenVINO GenAI cannot run a draft of this configuration as it was trained.

    Args:
        config (`Eagle3Config`): the draft's configuration.
    """
    unsupported = [
        (config.norm_before_residual, "norm_before_residual (the residual taken after hidden_norm)"),
        (config.norm_output, "norm_output (EAGLE 3.1's normed feedback)"),
        (config.norm_before_fc, "norm_before_fc"),
        (config.fc_norm, "fc_norm"),
        (config.qk_norm, "qk_norm"),
        (config.draft_sliding_window, "a sliding-window draft layer"),
        (config.partial_rotary_factor != 1.0, "partial_rotary_factor"),
        (config.attention_bias, "attention_bias"),
        (config.has_embed_tokens, "an embedding of its own (GenAI always uses the target's)"),
    ]
    found = [name for flag, name in unsupported if flag]
    if found:
        raise ValueError(
            "OpenVINO GenAI runs only the classic EAGLE-3 draft layer (optimum-intel's conversion rebuilds it and "
            f"would ignore what this draft uses): {', '.join(found)}. Serve this draft with hf-eagle3, vLLM or SGLang "
            "(--format speculators / flat)."
        )


def openvino_layer_ids(config, num_target_layers: int | None = None) -> list[int]:
    """The draft's captured layers in GenAI's ``hidden_layers_list`` convention (output of decoder layer ``i``).

    Args:
        config (`Eagle3Config`): the draft's configuration.
        num_target_layers (`int`, *optional*): the target's decoder layer count, needed only when the draft does not
            pin ``feature_layer_ids`` (the reference default ``[2, N // 2, N - 3]`` is then resolved).

    Returns:
        `list[int]`: three ids, each our input-of-layer id minus one.
    """
    if config.feature_layer_ids is None and num_target_layers is None:
        raise ValueError(
            "The draft does not pin the target layers it reads (feature_layer_ids is unset); pass the target "
            "(--target, or num_target_layers=) so the reference default [2, N // 2, N - 3] can be written out."
        )
    ids = config.resolve_feature_layer_ids(num_target_layers) if num_target_layers else config.feature_layer_ids
    if len(ids) != 3 or min(ids) < 1:
        raise ValueError(
            f"OpenVINO GenAI captures the outputs of exactly three decoder layers; this draft reads hidden states "
            f"{list(ids)} (index 0, the embedding output, has no GenAI equivalent)."
        )
    return outputs_of_layers(ids)


def write_openvino_layers(ir_dir: str | os.PathLike, layer_ids: list[int]) -> Path:
    """Write ``eagle3_mode`` and ``hidden_layers_list`` into the ``rt_info`` of a converted draft's IR.

    For a draft converted with ``optimum-cli export openvino`` directly; :func:`convert_flat` calls it. Only
    ``openvino_model.xml`` is rewritten (the weights file is left as it is).

    Args:
        ir_dir (`str` or `os.PathLike`): the folder holding ``openvino_model.xml``.
        layer_ids (`list[int]`): GenAI's convention, see :func:`openvino_layer_ids`.

    Returns:
        `Path`: the rewritten ``openvino_model.xml``.
    """
    path = Path(ir_dir) / IR_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the folder optimum-cli export openvino wrote.")
    tree = ET.parse(path)
    root = tree.getroot()
    rt_info = root.find("rt_info")
    if rt_info is None:
        rt_info = ET.SubElement(root, "rt_info")
    for name in ("eagle3_mode", "hidden_layers_list"):
        for old in rt_info.findall(name):
            rt_info.remove(old)
    ET.SubElement(rt_info, "eagle3_mode", value="True")
    ET.SubElement(rt_info, "hidden_layers_list", value=" ".join(str(int(i)) for i in layer_ids))
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path


def find_optimum_cli(optimum_cli: str | os.PathLike | None = None) -> str:
    """Return the ``optimum-cli`` program to convert with: ``optimum_cli`` if given, else the one on ``PATH``.

    Args:
        optimum_cli (`str` or `os.PathLike`, *optional*): path of optimum-intel's ``optimum-cli``.
    """
    found = shutil.which(str(optimum_cli)) if optimum_cli is not None else shutil.which("optimum-cli")
    if found is None:
        where = f"{optimum_cli} is not an executable" if optimum_cli is not None else "optimum-cli is not on PATH"
        raise FileNotFoundError(
            f"{where}. The OpenVINO conversion runs optimum-intel's optimum-cli, which needs transformers<5.6, so it "
            f"lives in an environment of its own: {OPTIMUM_SETUP}; then pass --optimum-cli ov-env/bin/optimum-cli."
        )
    return found


def optimum_weight_format(dtype=None) -> str:
    """The ``optimum-cli --weight-format`` for an export ``dtype``: ``"fp32"`` (default) or ``"fp16"``.

    Args:
        dtype (`str` or `torch.dtype`, *optional*): ``"fp32"`` / ``"fp16"`` (or their torch dtypes); ``None`` = fp32.
    """
    name = str(dtype).replace("torch.", "") if dtype is not None else None
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"OpenVINO IR stores fp32 or fp16 weights; got dtype {dtype!r} (use fp32 or fp16).")
    return WEIGHT_FORMATS[name]


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """Return ``out_dir`` as a `Path`; raise `FileExistsError` unless it is new or an empty folder.

    Args:
        out_dir (`str` or `os.PathLike`): where the IR is to go.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; pass a new one.")
    return out


def convert_flat(flat_dir: str | os.PathLike, out_dir: str | os.PathLike, layer_ids: list[int],
                 weight_format: str = "fp32", optimum_cli: str | os.PathLike | None = None) -> Path:
    """Convert a flat-layout draft with optimum-cli and write the layer list GenAI reads; nothing is left on failure.

    Runs ``optimum-cli export openvino --task text-generation-with-past --trust-remote-code`` into a temporary folder
    beside ``out_dir``, then :func:`write_openvino_layers`, then moves the result to ``out_dir``.
    :func:`hf_eagle3.checkpoints.export.export_openvino` writes the flat checkpoint and calls this.

    Args:
        flat_dir (`str` or `os.PathLike`): a draft in the flat layout (``export_flat``).
        out_dir (`str` or `os.PathLike`): the folder to write (new, or empty).
        layer_ids (`list[int]`): GenAI's convention, see :func:`openvino_layer_ids`.
        weight_format (`str`): ``"fp32"`` or ``"fp16"``.
        optimum_cli (`str` or `os.PathLike`, *optional*): see :func:`find_optimum_cli`.

    Returns:
        `Path`: ``out_dir``, holding ``openvino_model.xml`` / ``.bin`` and the draft's ``config.json``.
    """
    program = find_optimum_cli(optimum_cli)
    out = check_output_dir(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".hf_eagle3_openvino_", dir=out.parent) as tmp:
        ir = Path(tmp) / "ir"
        command = [program, "export", "openvino", "-m", str(flat_dir), "--task", "text-generation-with-past",
                   "--weight-format", weight_format, "--trust-remote-code", str(ir)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not (ir / IR_NAME).is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"optimum-cli failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
        write_openvino_layers(ir, layer_ids)
        if out.exists():
            out.rmdir()
        shutil.move(str(ir), str(out))
    return out
