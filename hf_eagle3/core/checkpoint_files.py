"""Reading a draft checkpoint's files: local directory or Hub, single file or shards, safetensors or torch, and the
renaming of published tensor names to ours.
"""

from __future__ import annotations

import json
import os
import pickle

import torch

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def convert_state_dict(state: dict, layout: str) -> dict:
    """
    Rename a published checkpoint's tensors to our names (``layers.0.`` -> ``midlayer.``, prefixes dropped).

    The renaming is the same for every layout; RoPE buffers stored by some checkpoints are dropped.

    Args:
        state (`dict[str, torch.Tensor]`): the checkpoint's tensors.
        layout (`str`): what :func:`~hf_eagle3.core.configuration_eagle3.detect_layout` returned (informative).
    """
    out = {}
    for k, v in state.items():
        for prefix in ("model.", "eagle3.", "draft_model."):
            if k.startswith(prefix) and not k.startswith("midlayer"):
                k = k[len(prefix):]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        if k.startswith("midlayer.self_attn.rotary_emb") or k == "inv_freq":
            continue
        out[k] = v
    return out


def resolve_file(path: str, filename: str, hub: dict, optional: bool = False):
    """
    The local path of ``filename`` of a checkpoint (downloaded from the Hub when ``path`` is not a directory).

    Args:
        path (`str`): local directory or Hub id.
        filename (`str`): the file inside it.
        hub (`dict`): Hub resolution options (``revision``, ``subfolder``, ...).
        optional (`bool`): return ``None`` instead of raising when the file is missing.
    """
    sub = hub.get("subfolder") or ""
    local = os.path.join(path, sub, filename)
    if os.path.isdir(path):
        if os.path.isfile(local):
            return local
        if optional:
            return None
        raise FileNotFoundError(f"{path} has no {os.path.join(sub, filename)}")
    from transformers.utils import cached_file

    return cached_file(
        path,
        filename,
        _raise_exceptions_for_missing_entries=not optional,
        _raise_exceptions_for_connection_errors=not optional,
        **hub,
    )


class CheckpointFileError(OSError):
    """A weight file that cannot be read; the message names the file and the fix."""


def _load_file(file: str) -> dict:
    """The tensors of one weight file; raises :class:`CheckpointFileError` naming the file and the fix when they
    cannot be read. A torch file is read as tensors only: pickled objects in it are refused, never run."""
    if file.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(file)
        except SafetensorError as err:
            raise CheckpointFileError(
                f"{file} cannot be read ({err}): the file is truncated or damaged. Fix: download it again (delete it, "
                "or pass force_download=True, for a Hub draft) or re-save the draft with save_pretrained.") from None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError):  # torch's text is not shown: it suggests
        raise CheckpointFileError(  # loading the file with its code run
            f"{file} cannot be read as tensors alone: it holds pickled Python objects besides its tensors (they are "
            "never loaded, since unpickling can run code), or it is truncated or damaged. Fix: save the draft as "
            "model.safetensors (save_pretrained) where it was made, or download it again.") from None


def read_state_dict(path: str, hub: dict) -> dict:
    """
    Read all the weights of a checkpoint (one file, or the shards an index names).

    Args:
        path (`str`): local directory or Hub id.
        hub (`dict`): Hub resolution options (``revision``, ``subfolder``, ...).
    """
    for name in WEIGHT_FILES:
        file = resolve_file(path, name, hub, optional=True)
        if file is not None:
            return _load_file(file)
    for name in INDEX_FILES:
        index = resolve_file(path, name, hub, optional=True)
        if index is not None:
            shards = sorted(set(json.loads(open(index).read())["weight_map"].values()))
            state = {}
            for shard in shards:
                state.update(_load_file(resolve_file(path, shard, hub)))
            return state
    raise FileNotFoundError(f"{path}: no weights found (looked for {WEIGHT_FILES + INDEX_FILES})")
