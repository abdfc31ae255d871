"""Random-weight causal LMs of published shapes, for measuring decoding without downloading weights
(``hf-eagle3 bench --oracle PROFILE --synthetic SHAPE``)."""

from __future__ import annotations

import torch

# Published shapes (config.json of the released models) for random-weight targets.
SYNTHETIC = {
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                               max_position_embeddings=8192, tie_word_embeddings=False)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                                 max_position_embeddings=8192, tie_word_embeddings=True)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)),
}


def synthetic_target(name: str, dtype=torch.float32, device: str | None = None, seed: int = 0,
                     decisive: bool = False):
    """
    A random-weight causal LM of a published shape (:data:`SYNTHETIC`), built directly on ``device``.

    A random-weight model's next-token logits are nearly flat, so in bfloat16 the argmax of a several-token
    verification forward often differs from the one-token forwards' (rounding decides near-ties): the oracle's
    reference continuation then leaves the path that decoding takes, and acceptance collapses. ``decisive=True``
    keeps every weight shape and cost but makes the greedy continuation unmistakable: each layer's output projections
    are scaled by 1e-3, so that the residual stream stays close to the input token's embedding, and the output head is
    the embedding matrix, so that the next token is the current one by a wide margin (the continuation repeats the
    last prompt token).

    Args:
        name (`str`): a key of :data:`SYNTHETIC`.
        dtype (`torch.dtype`): weight dtype.
        device (`str`, *optional*): where to build it (default CPU).
        seed (`int`): seed of the random weights.
        decisive (`bool`): make the greedy continuation robust to rounding (see above).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if name not in SYNTHETIC:
        raise ValueError(f"--synthetic {name!r}: one of {', '.join(SYNTHETIC)}")
    arch, shape = SYNTHETIC[name]
    config = (LlamaConfig if arch == "llama" else Qwen3Config)(**shape, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if decisive:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(1e-3)
                layer.mlp.down_proj.weight.mul_(1e-3)
            if model.lm_head.weight is not model.model.embed_tokens.weight:
                model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()
