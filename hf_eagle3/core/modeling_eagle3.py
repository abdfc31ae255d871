"""The EAGLE-3 draft model and its loading from the published checkpoint layouts.

It imports no decoding module: the ``generate`` hook is installed by the package's
``__init__`` or, in a remote-code bundle, by ``auto_entry.py`` (see ``generate_hook.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import ModelOutput

from .checkpoint_files import convert_state_dict, read_state_dict, resolve_file
from .config_layouts import config_dict_to_native
from .configuration_eagle3 import Eagle3Config, read_config_file
from .draft_cache import Eagle3KVCache
from .draft_layers import Eagle3DecoderLayer, Eagle3RMSNorm
from .drafting_memory import DraftingMemory
from .rope import rope_attention_scaling, rope_inv_freq
from .settings import SAVED_DRAFT_SETTINGS
from .stats import StatsBoard

# torch.compile modes that capture CUDA graphs (they need the same shapes at every call).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_d2t(d2t: torch.Tensor, vocab_size: int, source: str = "This EAGLE-3 draft") -> None:
    """
    Raise ``ValueError`` unless ``d2t`` maps every draft token inside the target vocabulary: draft token ``j`` is
    target token ``j + d2t[j]``, which must lie in ``[0, vocab_size)``. Loading a checkpoint and binding a draft to a
    target (``generate``) both ask this, so a draft built in memory is held to what a loaded one is.

    Args:
        d2t (`torch.LongTensor` [draft_vocab_size]): the offsets from draft ids to target ids.
        vocab_size (`int`): the target's vocabulary size.
        source (`str`, *optional*): what to call the draft in the message (a checkpoint's path when loading).
    """
    targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()
    bad = (targets < 0) | (targets >= vocab_size)
    if bool(bad.any()):
        j = int(bad.long().argmax())
        raise ValueError(
            f"{source}: d2t maps draft tokens outside the target vocabulary [0, {vocab_size}) ({int(bad.sum())} of "
            f"{d2t.shape[0]}; draft token {j} -> target token {int(targets[j])}). Draft token j is target token "
            "j + d2t[j]: set `d2t` to the mapping the draft was trained with (hf-eagle3's trainer writes it), or use "
            "a draft made for this target's vocabulary."
        )


def wants_static_steps(config) -> bool:
    """
    Whether a compile config asks for drafting steps of static shapes: ``dynamic=False``, or a mode that captures CUDA
    graphs with ``dynamic`` unset (``CompileConfig()``'s own default, ``"reduce-overhead"``).

    Args:
        config (`CompileConfig`): the draft's ``generation_config.compile_config``.
    """
    return config.dynamic is False or (config.dynamic is None and config.mode in CUDA_GRAPH_MODES)


def check_step_compile(config, device) -> None:
    """
    Raise ``ValueError`` when the drafting steps cannot run under ``config`` on ``device``: ``dynamic=True`` with a
    mode that captures CUDA graphs on a CUDA device, which would record a graph for every KV length.

    Args:
        config (`CompileConfig`): the draft's ``generation_config.compile_config``.
        device (`torch.device`): the draft's device.
    """
    if torch.device(device).type == "cuda" and config.mode in CUDA_GRAPH_MODES and config.dynamic is True:
        raise ValueError(
            f"The draft's compile_config has mode={config.mode!r}, which captures CUDA graphs, and dynamic=True, "
            "which lets the steps' KV length grow (a new graph for every length). Leave dynamic unset (static "
            "steps over a preallocated cache), or use mode='default' for dynamic shapes."
        )


def _new_cuda_graph_step(compiled):
    """``compiled``, each call of which starts a new CUDA-graph step (the previous step's outputs may be
    overwritten)."""

    def step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return step


@dataclass
class Eagle3DraftOutput(ModelOutput):
    """Output of :class:`Eagle3DraftModel`.

    Args:
        logits: scores over the DRAFT vocabulary [B, n, draft_vocab_size] (``None`` when not asked for).
        hidden_states: what the next draft step is fed [B, n, H]: the layer's pre-norm output, or its normed output
            for a ``norm_output`` draft (EAGLE 3.1).
    """

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class Eagle3PreTrainedModel(PreTrainedModel):
    """Base class wiring :class:`Eagle3Config` into Transformers."""

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _no_split_modules = ["Eagle3DecoderLayer"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, Eagle3RMSNorm):
            module.weight.fill_(1.0)


class Eagle3DraftModel(Eagle3PreTrainedModel):
    r"""
    An EAGLE-3 draft model. Pass it as ``assistant_model`` to ``target.generate`` (after ``import hf_eagle3``) to
    decode with EAGLE-3 speculative decoding; the output is that of the target alone.

    Weights use the flat published names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and an
    optional ``embed_tokens``), so a native checkpoint is also a flat one. A draft without ``lm_head`` uses the
    target's output head restricted to its vocabulary; one without ``embed_tokens`` shares the target's embedding.

    After each ``generate`` call, :attr:`last_stats` holds that call's acceptance statistics (summed over the rows
    of a batch), :attr:`last_batch_stats` one per row, and :attr:`cumulative_stats` the sum over calls since
    :meth:`reset_stats` (threads sharing the draft each read their own latest call: see
    :class:`~hf_eagle3.core.stats.StatsBoard`); :attr:`drafting_memory`
    (:class:`~hf_eagle3.core.drafting_memory.DraftingMemory`) what the call's budget leaves to the next call.

    Args:
        config (`Eagle3Config`): the draft's configuration.
    """

    _is_eagle3_draft = True

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        h, t, f = config.hidden_size, config.target_hidden_size, config.num_feature_layers
        if config.has_embed_tokens:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        if config.norm_before_fc:
            self.input_norm = Eagle3RMSNorm(f * t, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([Eagle3RMSNorm(t, config.rms_norm_eps) for _ in range(f)])
        self.fc = nn.Linear(f * t, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = Eagle3RMSNorm(h, config.rms_norm_eps)
        if config.has_lm_head:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        vd = config.draft_vocab_size
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long), persistent=True)
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool), persistent=True)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.rope_attention_scaling = rope_attention_scaling(config)
        self._target_embedding = None
        self._target_head = None  # (weight rows of the draft vocabulary,) for a draft without lm_head
        self._compiled_steps = {}  # (step function, compile options) -> compiled step (see step_call)
        self._d2t_checked = None  # (the d2t tensor, its version, the vocabulary) that check_d2t last passed
        self.static_kv_buffers = {}  # the static draft caches' buffers by size and thread, reused by the thread's calls
        self._stats = StatsBoard()  # last_stats, last_batch_stats, cumulative_stats
        self.drafting_memory = DraftingMemory()  # what one call's budget leaves to the next
        self.post_init()
        self.generation_config = GenerationConfig(
            num_assistant_tokens=5, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
        )

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            vd = self.config.draft_vocab_size
            self.d2t.zero_()
            self.t2d.zero_()
            self.t2d[:vd] = True
            self.inv_freq.copy_(rope_inv_freq(self.config))

    # ----------------------------------------------------------------------------------------------- target binding
    def get_input_embeddings(self):
        """Return the embedding in use: the draft's own, or the target's it is bound to (``None`` before binding)."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens
        return self._target_embedding[0] if self._target_embedding else None

    def bind_target(self, target) -> None:
        """
        Check that this draft fits ``target`` and share the target's input embedding when the draft has none.

        ``generate`` calls it; the number of target layers is checked there (through
        :meth:`Eagle3Config.resolve_feature_layer_ids`).

        Args:
            target (`PreTrainedModel`): the target model.

        Raises:
            ValueError: (naming the fix) when the draft's weights are on the meta device (never loaded), when the
                target's hidden size or vocabulary does not fit, when ``d2t`` maps outside that vocabulary, or when
                the draft has no embedding and the target's has another width. A refused draft keeps what it
                was bound to before.
        """
        self.check_materialized()
        text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        t_hidden = getattr(text, "hidden_size", None)
        if t_hidden != self.config.target_hidden_size:
            raise ValueError(
                f"This EAGLE-3 draft expects a target of hidden size {self.config.target_hidden_size} "
                f"(fc takes 3 x {self.config.target_hidden_size} features), but {type(target).__name__} has hidden size "
                f"{t_hidden}. Use the draft made for this target (or set `target_hidden_size` if the checkpoint's "
                "config is wrong)."
            )
        if getattr(text, "vocab_size", None) != self.config.vocab_size:
            raise ValueError(
                f"This EAGLE-3 draft maps onto a target vocabulary of {self.config.vocab_size} tokens, but "
                f"{type(target).__name__} has vocab_size {getattr(text, 'vocab_size', None)}: the draft was made for "
                "another target (tokenizer). Use a draft trained for this target."
            )
        self._check_d2t()
        emb = None
        if not hasattr(self, "embed_tokens"):
            emb = target.get_input_embeddings()
            if emb is None or emb.weight.shape[-1] != self.config.hidden_size:
                raise ValueError(
                    f"This draft has no embed_tokens of its own and must share the target's, whose width "
                    f"{None if emb is None else emb.weight.shape[-1]} differs from the draft's hidden size "
                    f"{self.config.hidden_size}. Load a checkpoint that includes `embed_tokens.weight`."
                )
        if not hasattr(self, "lm_head"):
            self._bind_target_head(target)
        if emb is not None:
            self._target_embedding = (emb,)  # a tuple: shared, not registered as a submodule nor saved

    def check_materialized(self) -> None:
        """
        Raise ``ValueError`` naming the fix when a weight or buffer of the draft is on the meta device: a draft built
        under ``torch.device("meta")`` (or moved there) has shapes but no values, and cannot draft.
        """
        meta = [name for name, tensor in [*self.named_parameters(), *self.named_buffers()] if tensor.is_meta]
        if meta:
            raise ValueError(
                f"This EAGLE-3 draft's weights are on the meta device (shapes without values: {', '.join(meta[:3])}"
                f"{', ...' if len(meta) > 3 else ''}), so it cannot draft. Load them: "
                "`Eagle3DraftModel.from_pretrained(path, device_map=...)`, or `draft.to_empty(device=...)` followed "
                "by `draft.load_checkpoint_state_dict(state_dict)`."
            )

    def _check_d2t(self) -> None:
        """:func:`check_d2t` on the draft's ``d2t``, once per value (a changed or replaced ``d2t`` is checked again)."""
        d2t, checked = self.d2t, self._d2t_checked
        if checked is None or checked[0] is not d2t or checked[1:] != (d2t._version, self.config.vocab_size):
            check_d2t(d2t, self.config.vocab_size)
            self._d2t_checked = (d2t, d2t._version, self.config.vocab_size)

    def _bind_target_head(self, target) -> None:
        """For a draft without ``lm_head``: take the target's output head, restricted to the draft vocabulary."""
        head = target.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is None or weight.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"This draft has no lm_head of its own and must use the target's output head, whose input width "
                f"{None if weight is None else weight.shape[-1]} differs from the draft's hidden size "
                f"{self.config.hidden_size}. Load a checkpoint that includes `lm_head.weight`."
            )
        if self._target_head is not None and self._target_head[0] is weight:
            return  # bound to this head already
        rows = weight
        if self.config.draft_vocab_size != weight.shape[0] or bool(self.d2t.any()):
            rows = weight.detach()[(torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
                                    + self.d2t).to(weight.device)]
        rows = rows.detach().to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        self._target_head = (weight, rows)  # a tuple: shared, not registered nor saved

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """
        Embed tokens on the draft's device and in its dtype.

        Args:
            input_ids (`torch.LongTensor` [B, n]): target-vocabulary ids.
        """
        emb = self.get_input_embeddings()
        if emb is None:
            raise ValueError(
                "This draft shares its target's embedding and is not bound to a target yet: call "
                "`draft.bind_target(target)` (generate does it for you)."
            )
        out = emb(input_ids.to(emb.weight.device))
        return out.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    # ------------------------------------------------------------------------------------------------ compilation
    def _step_compile_config(self):
        """The compile config the drafting steps run under, or ``None`` (eager)."""
        config = getattr(self.generation_config, "compile_config", None)
        if config is None or getattr(self.generation_config, "disable_compile", False):
            return None
        return config

    def static_steps(self) -> bool:
        """
        Whether the drafting steps run with static shapes: compiled under a config that asks for them (see
        :func:`wants_static_steps`). Their caches are then :class:`~hf_eagle3.core.draft_cache.Eagle3RowCache` s of a
        fixed capacity whose buffers are kept in :attr:`static_kv_buffers` and reused by every call of that size in
        the same thread (the same addresses, as CUDA graphs need).
        """
        config = self._step_compile_config()
        return config is not None and wants_static_steps(config)

    def step_call(self, step):
        """
        ``step`` as the drafting rounds run it: ``step`` itself, or ``torch.compile(step)`` when
        ``generation_config.compile_config`` is a `CompileConfig` (Transformers' own switch; ``disable_compile=True``
        turns it off). A step is a chain's next token or a tree's next level, for one sequence or a batch; the feed of
        the verified positions, whose length changes every round, stays eager.

        Each drafter passes its own module-level ``step(draft, **kwargs)`` function, so each keeps its own compiled
        graphs (dynamo's recompile limit counts per function). Two kinds of compiled steps:

        - **static** (:meth:`static_steps`: ``dynamic=False``, or ``dynamic`` unset with a mode that captures CUDA
          graphs, such as ``CompileConfig()``'s default ``"reduce-overhead"``): the steps write at device positions of a
          preallocated cache and attend over its full capacity, so every step of a call has the same shapes: one graph
          per capacity bucket and batch size, which CUDA-graph modes capture once and replay;
        - **dynamic** (any other config; ``dynamic=None`` is compiled as ``dynamic=True``): the steps attend over the
          cache's used length, a longer call reuses the graphs of a shorter one.

        The compiled functions are kept on the draft, per config. Under a mode that captures CUDA graphs on a CUDA
        draft, each step starts a new CUDA-graph step (``torch.compiler.cudagraph_mark_step_begin``): the previous
        step's outputs are read before the next one runs.

        Args:
            step (`Callable`): ``step(draft, **forward_kwargs) -> Eagle3DraftOutput``.

        Raises:
            ValueError: for ``dynamic=True`` with a mode that captures CUDA graphs on a CUDA draft (see
                :func:`check_step_compile`).
        """
        config = self._step_compile_config()
        if config is None:
            return step
        device = self.fc.weight.device
        check_step_compile(config, device)
        options = config.to_dict()
        options["dynamic"] = not wants_static_steps(config) if options.get("dynamic") is None else options["dynamic"]
        key = (step, repr(sorted(options.items(), key=lambda item: item[0])))
        compiled = self._compiled_steps.get(key)
        if compiled is None:
            compiled = torch.compile(step, **options)
            if device.type == "cuda" and config.mode in CUDA_GRAPH_MODES:
                compiled = _new_cuda_graph_step(compiled)
            self._compiled_steps[key] = compiled
        return compiled

    # ----------------------------------------------------------------------------------------------------- compute
    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """
        Fuse target features into draft hidden states (optional norms, then ``fc``).

        Args:
            features (`torch.Tensor` [B, n, F*T]): captured target hidden states, lowest layer first
                (F = ``config.num_feature_layers``, 3 in EAGLE-3).

        Returns:
            `torch.Tensor` [B, n, H].
        """
        features = features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        if hasattr(self, "fc_norm"):
            features = torch.cat([n(f) for n, f in zip(self.fc_norm, features.chunk(len(self.fc_norm), dim=-1))],
                                 dim=-1)
        if hasattr(self, "input_norm"):
            features = self.input_norm(features)
        return self.fc(features)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """
        Return ``(cos, sin)`` [B, 1, n, head_dim] for the given positions.

        The angles are computed in float32 whatever the model's dtype: ``inv_freq`` is recomputed when a dtype cast
        (``model.to(torch.bfloat16)``) has rounded it.

        Args:
            position_ids (`torch.LongTensor` [B, n]): positions.
            dtype (`torch.dtype`): dtype of the returned tensors.
        """
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        if self.rope_attention_scaling != 1.0:  # e.g. yarn; a Python float, no device round trip
            cos, sin = cos * self.rope_attention_scaling, sin * self.rope_attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """
        Return draft-vocabulary scores ``lm_head(norm(h))`` (``lm_head(h)`` for a ``norm_output`` draft, whose
        hidden states are normed already).

        Without an ``lm_head`` of its own the draft uses the target's output head restricted to the draft vocabulary
        (bound by :meth:`bind_target`).

        Args:
            hidden_states (`torch.Tensor` [B, n, H]): the ``hidden_states`` of :class:`Eagle3DraftOutput`.
        """
        h = hidden_states if self.config.norm_output else self.norm(hidden_states)
        if hasattr(self, "lm_head"):
            return self.lm_head(h)
        if self._target_head is None:
            raise ValueError(
                "This draft has no lm_head and uses its target's output head: call `draft.bind_target(target)` "
                "first (generate does it for you)."
            )
        return F.linear(h, self._target_head[1])

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        hidden_states: torch.Tensor | None = None,
        target_features: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Eagle3KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> Eagle3DraftOutput:
        r"""
        Run the draft layer on pairs (hidden state at position t, token t + 1).

        Args:
            input_ids (`torch.LongTensor` [B, n]): the NEXT tokens, in the target vocabulary.
            hidden_states (`torch.Tensor` [B, n, H]): the previous draft step's ``hidden_states`` output; or
            target_features (`torch.Tensor` [B, n, 3T]): captured target features (fused by ``fc``).
            inputs_embeds (`torch.Tensor` [B, n, H], *optional*): instead of ``input_ids``.
            position_ids (`torch.LongTensor` [B, n], *optional*): defaults to continuing the cache.
            cache (`Eagle3KVCache`, *optional*): the draft's KV cache, updated in place.
            attention_mask (`torch.Tensor`, *optional*): bool [n, past + n] (True = attend) or float additive mask;
                ``None`` means causal.
            logits_to_keep (`int`): compute logits of the last ``logits_to_keep`` positions only (0 = all,
                -1 = none).

        Returns:
            `Eagle3DraftOutput` with draft-vocabulary ``logits`` and the ``hidden_states`` to feed the next step
            (pre-norm; normed for a ``norm_output`` draft).
        """
        if target_features is not None:
            hidden_states = self.project_features(target_features)
        if hidden_states is None:
            raise ValueError("Pass `target_features` [B, n, 3T] or `hidden_states` [B, n, H].")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        b, n, _ = hidden_states.shape
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + n, device=hidden_states.device).expand(b, n)
        cos, sin = self.rope(position_ids, hidden_states.dtype)
        out = self.midlayer(inputs_embeds, hidden_states, cos, sin, cache, attention_mask, position_ids[0])
        if self.config.norm_output:  # EAGLE 3.1: the next step is fed the normed state, which lm_head reads
            out = self.norm(out)
        logits = None
        if logits_to_keep >= 0:
            logits = self.compute_logits(out if logits_to_keep == 0 else out[:, -logits_to_keep:])
        return Eagle3DraftOutput(logits=logits, hidden_states=out)

    # ------------------------------------------------------------------------------------------------------- stats
    @property
    def last_stats(self):
        """The `Eagle3Stats` of the latest ``generate`` call (summed over its rows) that the calling thread made with
        this draft (of any thread when it made none); ``None`` before any call."""
        return self._stats.view()[0]

    @last_stats.setter
    def last_stats(self, value) -> None:
        self._stats.assign(last=value)

    @property
    def last_batch_stats(self):
        """One `Eagle3Stats` per row of the call :attr:`last_stats` describes; ``None`` before any call."""
        return self._stats.view()[1]

    @last_batch_stats.setter
    def last_batch_stats(self, value) -> None:
        self._stats.assign(rows=value)

    @property
    def cumulative_stats(self):
        """The `Eagle3Stats` summed over every call (of every thread) since :meth:`reset_stats`."""
        return self._stats.cumulative

    @cumulative_stats.setter
    def cumulative_stats(self, value) -> None:
        self._stats.cumulative = value

    def reset_stats(self) -> None:
        """Forget the statistics accumulated over previous ``generate`` calls."""
        self._stats.reset()

    def _record_stats(self, stats, rows: list | None = None) -> None:
        self._stats.record(stats, list(rows) if rows is not None else [stats])

    # ----------------------------------------------------------------------------------------------------- saving
    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        r"""
        Save the draft (``config.json``, weights) and its ``generation_config.json``.

        ``PreTrainedModel.save_pretrained`` writes the generation config only for models that can generate on their
        own; a draft cannot, but its generation config carries the draft-length settings (``num_assistant_tokens``,
        ``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``) and the tree settings (``tree_top_k``,
        ``tree_depth``, ``tree_total_tokens``) that :meth:`from_pretrained` reads back.

        Args:
            save_directory (`str` or `os.PathLike`): directory to write to (created if needed).
            push_to_hub (`bool`, *optional*, defaults to `False`): also upload to the Hub (through ``push_to_hub``,
                which saves into a temporary directory with this method, so both files are uploaded).
            kwargs: passed to ``PreTrainedModel.save_pretrained`` (and to ``push_to_hub``: ``repo_id``,
                ``commit_message``, ``private``, ``token``, ``create_pr``).
        """
        hub_keys = ("repo_id", "commit_message", "private", "token", "create_pr", "revision")
        hub = {k: kwargs.pop(k) for k in hub_keys if k in kwargs}
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and self.generation_config is not None:
            self.generation_config.save_pretrained(save_directory)
        if push_to_hub:
            repo_id = hub.pop("repo_id", os.path.basename(os.path.normpath(str(save_directory))))
            self.push_to_hub(repo_id, **hub)

    # ----------------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        r"""
        Load an EAGLE-3 draft from a local directory or a Hub id, in any published layout.

        Supported layouts: our native ``save_pretrained`` output; the flat layout of the EAGLE authors, SGLang,
        SpecForge and AngelSlim (``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM``, ``midlayer.*``); and the
        `speculators` layout of vLLM (``layers.0.*``, nested ``transformer_layer_config``). Layer-id conventions are
        converted to ours. Missing or unexpected weights, or weights of the wrong shape, raise ``ValueError`` naming
        them.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): directory or Hub id.
            dtype / torch_dtype (`torch.dtype` or `str`, *optional*): dtype of the floating weights (default: as
                stored, or float32 for float64 checkpoints).
            device / device_map (`str` or `torch.device`, *optional*): where to put the model (``"auto"``: CUDA when
                available; a dict ``device_map`` is ignored).
            config (`Eagle3Config`, *optional*): use this config instead of the checkpoint's.
            revision, cache_dir, token, local_files_only, subfolder: passed to the Hub resolution.
        """
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        device = kwargs.pop("device", None) or kwargs.pop("device_map", None)
        config = kwargs.pop("config", None)
        hub = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder",
                                          "force_download", "proxies") if k in kwargs}
        for k in ("trust_remote_code", "code_revision", "_from_auto", "_commit_hash", "adapter_kwargs",
                  "attn_implementation", "low_cpu_mem_usage"):
            kwargs.pop(k, None)
        if kwargs:
            raise TypeError(f"Eagle3DraftModel.from_pretrained got unexpected arguments: {sorted(kwargs)}")
        path = str(pretrained_model_name_or_path)
        config_file = resolve_file(path, "config.json", hub)
        raw_cfg = read_config_file(config_file)  # a malformed file names itself and the field
        native_kwargs, layout = config_dict_to_native(raw_cfg, source=config_file)
        k_default = native_kwargs.pop("_num_assistant_tokens", None)
        state = read_state_dict(path, hub)
        state = convert_state_dict(state, layout)
        if config is None:
            native_kwargs["has_embed_tokens"] = "embed_tokens.weight" in state
            native_kwargs["has_lm_head"] = "lm_head.weight" in state  # none: the target's head is used
            native_kwargs.setdefault("target_name_or_path", raw_cfg.get("target_name_or_path"))
            config = Eagle3Config(**native_kwargs)
        if config.draft_vocab_size != config.vocab_size and "d2t" not in state:
            raise ValueError(
                f"{path}: the draft vocabulary ({config.draft_vocab_size}) differs from the target's "
                f"({config.vocab_size}) but the checkpoint has no `d2t` mapping. Add the `d2t` tensor the draft was "
                "trained with (hf-eagle3's trainer writes it)."
            )
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        if dtype is None:
            floats = [v.dtype for v in state.values() if v.is_floating_point()]
            dtype = floats[0] if floats and floats[0] != torch.float64 else torch.float32
        with torch.device("meta"):
            model = cls(config, *model_args)
        model.load_checkpoint_state_dict(state, source=path)
        model = model.to(dtype=dtype)
        if device is not None and not isinstance(device, dict):
            model = model.to(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        if k_default:
            model.generation_config.num_assistant_tokens = k_default
        gen_file = resolve_file(path, "generation_config.json", hub, optional=True)
        if gen_file is not None:
            gen = json.loads(open(gen_file).read())
            for key in SAVED_DRAFT_SETTINGS:
                if gen.get(key) is not None:
                    setattr(model.generation_config, key, gen[key])
        model.name_or_path = path
        model.config._name_or_path = path
        return model.eval()

    def load_checkpoint_state_dict(self, state: dict, source: str = "checkpoint") -> None:
        """
        Load a native-named state dict strictly: missing, unexpected or mis-shaped tensors raise ``ValueError``.

        ``d2t`` may be absent when the draft and target vocabularies are equal, ``t2d`` is rebuilt from ``d2t`` when
        absent, and floating tensors are loaded as float32 (:meth:`from_pretrained` casts them afterwards).

        Args:
            state (`dict[str, torch.Tensor]`): tensors under our names (see :func:`convert_state_dict`).
            source (`str`): what to call the checkpoint in error messages.
        """
        own = {k: v for k, v in self.state_dict().items()}
        missing = sorted(set(own) - set(state) - {"t2d"})
        unexpected = sorted(set(state) - set(own))
        if "d2t" in missing and self.config.draft_vocab_size == self.config.vocab_size:
            missing.remove("d2t")
        if missing or unexpected:
            raise ValueError(
                f"{source}: checkpoint does not match the EAGLE-3 draft layout. Missing: {missing or 'none'}. "
                f"Unexpected: {unexpected or 'none'}. Expected the published names (fc, midlayer.* or layers.0.*, "
                "norm, lm_head, d2t, t2d and optionally embed_tokens): rename the unexpected tensors accordingly, "
                "or check that config.json is the one that came with these weights."
            )
        bad = [f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(own[k].shape)}"
               for k in state if tuple(state[k].shape) != tuple(own[k].shape)]
        if bad:
            raise ValueError(
                f"{source}: weights of the wrong shape for its config: " + "; ".join(bad) + ". Fix config.json "
                "(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, "
                "target_hidden_size, vocab_size, draft_vocab_size) to match the weights."
            )
        full = dict(state)
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if "d2t" not in full:
            full["d2t"] = torch.zeros(vd, dtype=torch.long)
        d2t = full["d2t"].long()
        check_d2t(d2t, v, source)
        targets = torch.arange(vd) + d2t
        if "t2d" not in full:
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[targets] = True
            full["t2d"] = t2d
        full["d2t"], full["t2d"] = d2t, full["t2d"].bool()
        for k, val in full.items():
            if val.is_floating_point():
                full[k] = val.float()
        self.load_state_dict(full, strict=True, assign=True)
        self.inv_freq = rope_inv_freq(self.config)
        self.rope_attention_scaling = rope_attention_scaling(self.config)
