"""The layers of the EAGLE-3 draft: RMSNorm, the attention that reads ``cat(embedding, hidden)``, the gated MLP and
the single decoder layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .configuration_eagle3 import Eagle3Config
from .draft_cache import Eagle3KVCache, sliding_window_mask
from .rope import apply_rope


class Eagle3RMSNorm(nn.Module):
    """RMSNorm as in Llama: ``weight * x / sqrt(mean(x**2) + eps)``, computed in float32.

    Args:
        size (`int`): width of the normalised (last) dimension.
        eps (`float`): added to the mean square.
    """

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Normalise the last dimension of ``x``.

        Args:
            x (`torch.Tensor` [..., size]): the input, returned in its own dtype.
        """
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Eagle3Attention(nn.Module):
    """Self-attention of the draft layer; its q/k/v projections read ``cat(embedding, hidden)`` (width 2H).

    Args:
        config (`Eagle3Config`): sizes, biases, ``qk_norm`` and ``draft_sliding_window``.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_bias)
        self.sliding_window = config.draft_sliding_window
        if config.qk_norm:
            self.q_norm = Eagle3RMSNorm(d, config.rms_norm_eps)
            self.k_norm = Eagle3RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache: Eagle3KVCache | None = None, attention_mask=None, positions=None):
        """
        Attend the new positions over the cache plus themselves.

        Args:
            x (`torch.Tensor` [B, n, 2H]): ``cat(norm(embedding), norm(hidden))`` of the new positions.
            cos, sin (`torch.Tensor` [B, 1, n, rotary_dim]): RoPE of their positions.
            cache (`Eagle3KVCache`, *optional*): updated in place with the new keys and values.
            attention_mask (`torch.Tensor`, *optional*): bool [n, past + n] (True = attend) or an additive float
                mask; ``None`` means causal.
            positions (`torch.LongTensor` [n], *optional*): positions of the new tokens; needed by a sliding-window
                draft (default: continuing the cache).

        Returns:
            `torch.Tensor` [B, n, H].
        """
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None and hasattr(cache, "attend"):  # the cache owns the write and the mask (TTT, rows)
            out = cache.attend(q, k, v, self.sliding_window)
            return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))
        past = cache.get_seq_length() if cache is not None else 0
        window = self.sliding_window
        if window is not None and positions is None:
            positions = torch.arange(past, past + n, device=x.device)
        if cache is not None:
            k, v = cache.update(k, v) if window is None else cache.update(k, v, positions)
        causal = False
        if window is not None and past + n > window:  # some key may lie outside the window
            keys_at = cache.key_positions() if cache is not None else positions
            attention_mask = sliding_window_mask(attention_mask, positions, keys_at, window, past)
        elif attention_mask is None and n > 1 and past == 0:
            causal = True  # no [n, n] mask: the kernel applies it (a prompt's feed)
        elif attention_mask is None and n > 1:
            qpos = torch.arange(past, past + n, device=x.device)[:, None]
            attention_mask = torch.arange(past + n, device=x.device)[None, :] <= qpos
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=causal, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    """The gated MLP of Llama.

    Args:
        config (`Eagle3Config`): ``hidden_size``, ``intermediate_size``, ``hidden_act`` and ``mlp_bias``.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        """
        Apply ``down(act(gate(x)) * up(x))``.

        Args:
            x (`torch.Tensor` [..., H]): the input.
        """
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The single draft layer: attention over ``cat(input_layernorm(emb), hidden_norm(h))``, then an MLP.

    Args:
        config (`Eagle3Config`): the draft's configuration (``norm_before_residual`` picks the residual).
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h = config.hidden_size
        self.norm_before_residual = config.norm_before_residual
        self.hidden_norm = Eagle3RMSNorm(h, config.rms_norm_eps)
        self.input_layernorm = Eagle3RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = Eagle3RMSNorm(h, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, embeds, hidden, cos, sin, cache=None, attention_mask=None, positions=None):
        """
        Return the layer's PRE-norm output hidden state [B, n, H].

        Args:
            embeds (`torch.Tensor` [B, n, H]): embeddings of the next tokens.
            hidden (`torch.Tensor` [B, n, H]): fused target features or the previous step's output.
            cos, sin (`torch.Tensor` [B, 1, n, head_dim]): RoPE of the positions.
            cache (`Eagle3KVCache`, *optional*), attention_mask (`torch.Tensor`, *optional*), positions
                (`torch.LongTensor` [n], *optional*): see :meth:`Eagle3Attention.forward`.
        """
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = residual + self.self_attn(x, cos, sin, cache, attention_mask, positions)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
