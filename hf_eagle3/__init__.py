"""hf-eagle3: EAGLE-3 speculative decoding inside Hugging Face Transformers' ``generate``.

Importing the package registers :class:`Eagle3Config` / :class:`Eagle3DraftModel` with ``AutoConfig`` /
``AutoModel`` and hooks ``generate`` so that ``target.generate(ids, assistant_model=draft)`` runs EAGLE-3 decoding
whenever ``draft`` is an EAGLE-3 draft (with dynamic draft trees when ``tree_top_k`` / ``tree_depth`` /
``tree_total_tokens`` are given, see :mod:`hf_eagle3.core.decoding_loop`). The hook itself lives in
:mod:`hf_eagle3.core.generate_hook`.

One exception: in the ``hf-eagle3`` command's own process (the console script, or ``python -m hf_eagle3.cli``) the
import defers all of this, so that ``--help`` and argument errors answer without loading torch and Transformers;
:func:`hf_eagle3.cli.main` calls :func:`install` once the arguments are parsed, and the first use of a name below
installs too.
"""

from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.2.0"

# The public names, by the module that defines them.
_EXPORTS = {
    "DraftTree": ".core.tree_candidates",
    "Eagle3Drafter": ".core.drafter",
    "Eagle3BatchTreeDrafter": ".core.drafter",  # the name before 0.2.0, kept for one release
    "Eagle3CandidateGenerator": ".core.candidate_generator",
    "Eagle3Config": ".core.configuration_eagle3",
    "Eagle3D2TLogitsProcessor": ".core.logits_process",
    "Eagle3DraftModel": ".core.modeling_eagle3",
    "Eagle3FeatureCapture": ".core.feature_capture",
    "Eagle3KVCache": ".core.draft_cache",
    "Eagle3RowCache": ".core.draft_cache",
    "Eagle3Stats": ".core.stats",
    "calibrate": ".core.cost_model",
    "cost_table": ".core.cost_model",
    "find_decoder_layers": ".core.feature_capture",
    "install_generate_hook": ".core.generate_hook",
    "is_eagle3_draft": ".core.generate_hook",
}

__all__ = sorted(_EXPORTS)

_installed = False


def install() -> None:
    """Register the draft with ``AutoConfig`` / ``AutoModel``, hook ``generate`` and bind the public names (once;
    a plain ``import hf_eagle3`` has done it already, except in the ``hf-eagle3`` command's own process)."""
    global _installed
    if _installed:
        return
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(module, __name__), name)
    from transformers import AutoConfig, AutoModel

    config, model = globals()["Eagle3Config"], globals()["Eagle3DraftModel"]
    AutoConfig.register(config.model_type, config, exist_ok=True)
    AutoModel.register(config, model, exist_ok=True)
    globals()["install_generate_hook"]()
    _installed = True


def __getattr__(name: str):
    """The public names, in a process that has not installed yet (the ``hf-eagle3`` command's)."""
    if name in _EXPORTS:
        install()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the public ones included before they are bound."""
    return sorted(set(globals()) | set(_EXPORTS))


def _is_command_process() -> bool:
    """Whether this process is the ``hf-eagle3`` command: its console script, or ``python -m hf_eagle3.cli`` (also
    under ``torchrun`` / ``accelerate launch``, which start their workers that way)."""
    if os.path.basename(sys.argv[0]).lower().removesuffix(".exe").removesuffix("-script.py") == "hf-eagle3":
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return any(a == "-m" and b == "hf_eagle3.cli" for a, b in zip(argv, argv[1:])) or "-mhf_eagle3.cli" in argv


if not _is_command_process():
    install()
