"""The target's hidden states that feed an EAGLE-3 draft, one capture per ``generate`` call: taken from the outputs of
the forwards the call runs (:class:`Eagle3OutputFeatures`), or with forward pre-hooks that keep only the forwards of the
thread that installed them (:class:`Eagle3FeatureCapture`). Either way nothing of a call is kept on the target, so
calls running at the same time on one target (two threads) each read their own forwards' features.

Feature i is the INPUT of decoder layer i (``output_hidden_states[i]``),
so any decoder whose layer list can be found works without changing its code.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

# Where Transformers decoders keep their layer list, most common first.
LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.text_model.layers",
    "language_model.model.layers",
    "model.decoder.layers",
    "transformer.h",
    "transformer.layers",
    "gpt_neox.layers",
    "layers",
)


def _get_path(module: nn.Module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(target: nn.Module, layers_path: str | None = None) -> nn.ModuleList:
    """Return the decoder-layer list of ``target``.

    Args:
        target (`nn.Module`): the target model.
        layers_path (`str`, *optional*): dotted attribute path (e.g. ``"model.layers"``); when ``None``, the common
            paths of :data:`LAYER_PATHS` are tried, then the only ``nn.ModuleList`` of ``num_hidden_layers`` modules.

    Raises:
        ValueError: when no layer list is found, saying how to point at it.
    """
    if layers_path is not None:
        layers = _get_path(target, layers_path)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(f"`{layers_path}` is not a non-empty nn.ModuleList on {type(target).__name__}.")
        return layers
    for path in LAYER_PATHS:
        layers = _get_path(target, path)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    config = getattr(target, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    found = [m for m in target.modules() if isinstance(m, nn.ModuleList) and n and len(m) == n]
    if len(found) == 1:
        return found[0]
    raise ValueError(
        f"Could not find the decoder layers of {type(target).__name__} (tried {', '.join(LAYER_PATHS)}). Point at "
        "them with `draft.config.target_layers_path = \"<dotted.path.to.layers>\"` (e.g. \"model.layers\")."
    )


def checked_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """
    The feature layer ids in ascending order (engines concatenate the captured layers so, as vLLM and SGLang do).

    Args:
        layer_ids (`list[int]`): the draft's feature layers (input of layer i).
        num_layers (`int`): the target's decoder layers.

    Raises:
        ValueError: when an id is outside ``0 .. num_layers - 1``.
    """
    n = num_layers
    if any(not 0 <= i < n for i in layer_ids):
        raise ValueError(f"feature layer ids {layer_ids} out of range for a target with {n} layers (0..{n - 1}).")
    return sorted(layer_ids)


class Eagle3FeatureCapture:
    """Forward pre-hooks on three decoder layers of a target that keep their inputs from the latest forward run by the
    thread that installed them (forwards of other threads, e.g. another ``generate`` call on the same target, are not
    seen).

    Use as a context manager, or call :meth:`install` / :meth:`remove`. Hooks are removed by :meth:`remove` even
    when only some were installed.

    Args:
        target (`nn.Module`): the target model.
        layer_ids (`list[int]`): three layer indices (input of layer i); features are concatenated in ascending
            order of layer, whatever order they are listed in (as vLLM and SGLang do).
        layers_path (`str`, *optional*): dotted path of the layer list, when it cannot be found automatically.
    """

    def __init__(self, target: nn.Module, layer_ids: list[int], layers_path: str | None = None):
        self.layers = find_decoder_layers(target, layers_path)
        self.layer_ids = checked_layer_ids(layer_ids, len(self.layers))
        self._captured: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles = []
        self._thread = None  # the thread whose forwards are captured (the one that installed the hooks)

    def _hook(self, slot: int):
        def hook(module, args, kwargs):
            if threading.get_ident() != self._thread:
                return  # a forward of another thread: another call on the same target
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, (tuple, list)):
                hidden = hidden[0]
            self._captured[slot] = hidden.detach()

        return hook

    def install(self) -> "Eagle3FeatureCapture":
        """Register the hooks (idempotent); they capture the forwards of the calling thread."""
        if not self._handles:
            self._thread = threading.get_ident()
            try:
                for slot, i in enumerate(self.layer_ids):
                    self._handles.append(self.layers[i].register_forward_pre_hook(self._hook(slot), with_kwargs=True))
            except BaseException:
                self.remove()
                raise
        return self

    def remove(self) -> None:
        """Remove every hook and drop the captured tensors."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._captured = [None] * len(self.layer_ids)

    @property
    def installed(self) -> bool:
        """Whether the hooks are in place."""
        return bool(self._handles)

    def features(self, device=None, dtype=None) -> torch.Tensor | None:
        """
        Return the latest forward's features concatenated low -> mid -> high.

        Args:
            device (`torch.device`, *optional*): where to put them (default: where they were captured).
            dtype (`torch.dtype`, *optional*): their dtype (default: the target's).

        Returns:
            `torch.Tensor` [B, n, 3T], or ``None`` when some layer has not run since the last :meth:`clear`.
        """
        if any(c is None for c in self._captured):
            return None
        return torch.cat([c.to(device=device, dtype=dtype) for c in self._captured], dim=-1)

    def clear(self) -> None:
        """Forget the captured tensors (keeps the hooks)."""
        self._captured = [None] * len(self.layer_ids)

    def forward(self, model, **inputs):
        """
        Run a target forward whose features this capture keeps (the hooks see it: nothing to add).

        Args:
            model (`PreTrainedModel`): the target the hooks are on.
            **inputs: the forward's arguments.

        Returns:
            The target's outputs.
        """
        return model(**inputs)

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()
        return False


class Eagle3OutputFeatures:
    """The same features as :class:`Eagle3FeatureCapture`, taken from the target's outputs that Transformers' assisted
    decoding hands to a candidate generator with ``requires_model_outputs`` (no hooks on the target).

    Hidden state ``i`` of ``output_hidden_states`` is the input of decoder layer ``i`` (state 0: the embeddings), the
    feature the hooks take; :attr:`model_kwargs_overrides` asks the target for just those states (a list of indices,
    Transformers >= 5.25), or for all of them when the user's ``generate`` call asks for hidden states too. The
    package's loop (trees, batches) runs its target forwards through :meth:`forward`, which asks for them and keeps
    them. The states travel with the outputs, so concurrent calls on one target never see each other's.

    Args:
        layer_ids (`list[int]`): three layer indices; concatenated in ascending order, as by the hooks.
        num_layers (`int`): the target's decoder layers.
    """

    def __init__(self, layer_ids: list[int], num_layers: int):
        self.layer_ids = checked_layer_ids(layer_ids, num_layers)
        self._hidden_states = None

    def model_kwargs_overrides(self, generation_config) -> dict:
        """
        What the target's forwards must be called with so that their outputs hold the features.

        Args:
            generation_config (`GenerationConfig`): the call's config (``output_hidden_states`` asked by the user).
        """
        if generation_config.output_hidden_states:
            return {"output_hidden_states": True}
        return {"output_hidden_states": list(self.layer_ids)}

    def forward(self, model, **inputs):
        """
        Run a target forward that returns the selected hidden states (whatever ``output_hidden_states`` ``inputs``
        hold: the package's loop returns none to the user) and keep them (:meth:`receive`).

        Args:
            model (`PreTrainedModel`): the target.
            **inputs: the forward's arguments.

        Returns:
            The target's outputs.
        """
        outputs = model(**{**inputs, "output_hidden_states": list(self.layer_ids)})
        self.receive(outputs)
        return outputs

    def receive(self, model_outputs) -> None:
        """
        Keep the hidden states of the target's latest forward.

        Args:
            model_outputs (`ModelOutput` or `None`): the target's outputs, as Transformers hands them over.

        Raises:
            ValueError: when the outputs lack a selected hidden state (a target whose ``output_hidden_states`` does not
                index its decoder layers: point at them with ``target_layers_path``, which uses hooks).
        """
        hidden = getattr(model_outputs, "hidden_states", None) if model_outputs is not None else None
        if model_outputs is not None and (hidden is None or any(
                i >= len(hidden) or hidden[i] is None for i in self.layer_ids)):
            raise ValueError(
                f"The target's outputs lack the hidden states {self.layer_ids} the draft reads. Set "
                "`draft.config.target_layers_path` to the dotted path of its decoder layers (e.g. \"model.layers\") "
                "to take them with forward hooks instead."
            )
        self._hidden_states = hidden

    def features(self, device=None, dtype=None) -> torch.Tensor | None:
        """
        Return the latest forward's features concatenated low -> mid -> high.

        Args:
            device (`torch.device`, *optional*): where to put them.
            dtype (`torch.dtype`, *optional*): their dtype.

        Returns:
            `torch.Tensor` [B, n, 3T], or ``None`` before the first forward or after :meth:`clear`.
        """
        if self._hidden_states is None:
            return None
        return torch.cat([self._hidden_states[i].to(device=device, dtype=dtype) for i in self.layer_ids], dim=-1)

    def clear(self) -> None:
        """Forget the latest forward's hidden states."""
        self._hidden_states = None

    def install(self) -> "Eagle3OutputFeatures":
        """Nothing to install: Transformers hands the outputs over."""
        return self

    def remove(self) -> None:
        """Drop the kept hidden states."""
        self.clear()

    @property
    def installed(self) -> bool:
        """No hooks are ever installed."""
        return False
