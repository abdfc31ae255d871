"""The decoding strategies ``hf-eagle3 bench`` compares, as a registry of factories (:func:`register_strategy`):
plain ``generate``, prompt lookup, EAGLE-3 chains over a sweep of k, ``"auto"`` chains and dynamic trees.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Callable


@dataclass
class Strategy:
    """One decoding strategy of the benchmark.

    Args:
        name: unique label used in the table, the JSON and the plot (e.g. ``"eagle3-chain k=5"``).
        family: the registry entry it comes from (``"plain"``, ``"prompt_lookup"``, ``"eagle3_chain"``, ...).
        k: draft length (tokens proposed per round), ``None`` when it does not apply.
        uses_draft: whether the EAGLE-3 draft is passed as ``assistant_model``.
        generate_kwargs: extra keyword arguments for ``target.generate``.
        compile_mode: the ``torch.compile`` mode the draft's steps run under (see :meth:`applied_to`); ``None``: eager.
    """

    name: str
    family: str
    k: int | None = None
    uses_draft: bool = False
    generate_kwargs: dict = field(default_factory=dict)
    compile_mode: str | None = None

    @contextlib.contextmanager
    def applied_to(self, draft):
        """
        Within the block, ``draft`` drafts as this strategy says: for a compiled strategy its generation config gets
        ``compile_config = CompileConfig(mode=compile_mode)`` (``"default"``: dynamic steps; ``"reduce-overhead"``:
        static steps, captured as CUDA graphs on a CUDA device), restored after.

        Args:
            draft (`Eagle3DraftModel`): the draft.
        """
        if self.compile_mode is None:
            yield draft
            return
        from transformers import CompileConfig

        saved = draft.generation_config.compile_config
        draft.generation_config.compile_config = CompileConfig(**{**COMPILE_OPTIONS, "mode": self.compile_mode})
        try:
            yield draft
        finally:
            draft.generation_config.compile_config = saved


STRATEGIES: dict[str, Callable[..., list[Strategy]]] = {}
# The CompileConfig options of the compiled strategies besides their mode (Transformers' defaults: inductor).
COMPILE_OPTIONS = {}


def register_strategy(family: str):
    """Decorator adding a strategy factory to the benchmark under ``family``.

    A factory is called as ``factory(ks, **options)`` (``ks``: the draft lengths of the sweep; ``options``: e.g.
    ``prompt_lookup_num_tokens``; ignore what you do not use) and returns a list of :class:`Strategy`. Strategies
    with ``uses_draft=True`` get ``assistant_model=draft`` added to their ``generate`` call and report acceptance.

    Args:
        family: name of the strategy family (also accepted by ``--strategies``).
    """

    def add(factory):
        STRATEGIES[family] = factory
        return factory

    return add


@register_strategy("plain")
def plain_strategies(ks, **options) -> list[Strategy]:
    """The baseline: ``target.generate`` alone.

    Args:
        ks: unused.
        options: unused.
    """
    return [Strategy(name="plain", family="plain")]


@register_strategy("prompt_lookup")
def prompt_lookup_strategies(ks, prompt_lookup_num_tokens: int = 5, **options) -> list[Strategy]:
    """Transformers' prompt-lookup decoding (n-gram matches in the prompt as drafts).

    Args:
        ks: unused (prompt lookup runs once, with ``prompt_lookup_num_tokens``).
        prompt_lookup_num_tokens: tokens copied per match.
        options: unused.
    """
    kwargs = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    return [Strategy(name="prompt-lookup", family="prompt_lookup", k=prompt_lookup_num_tokens, generate_kwargs=kwargs)]


@register_strategy("eagle3_chain")
def eagle3_chain_strategies(ks, **options) -> list[Strategy]:
    """EAGLE-3 chain drafting with a constant draft length, one strategy per k.

    Args:
        ks: the draft lengths to sweep.
        options: unused.
    """
    out = []
    for k in ks:
        kwargs = {"num_assistant_tokens": int(k), "num_assistant_tokens_schedule": "constant"}
        out.append(Strategy(name=f"eagle3-chain k={k}", family="eagle3_chain", k=int(k), uses_draft=True,
                            generate_kwargs=kwargs))
    return out


@register_strategy("eagle3_auto")
def eagle3_auto_strategies(ks, **options) -> list[Strategy]:
    """EAGLE-3 chain drafting with ``num_assistant_tokens_schedule="auto"``: each round the length in 0..max(ks) with
    the most expected tokens per second under the costs measured on this machine (see docs/cost_model.md).

    Args:
        ks: the draft lengths of the sweep; their maximum caps the chosen length.
        options: unused.
    """
    cap = max(int(k) for k in ks)
    kwargs = {"num_assistant_tokens": cap, "num_assistant_tokens_schedule": "auto"}
    return [Strategy(name=f"eagle3-chain auto k<={cap}", family="eagle3_auto", k=None, uses_draft=True,
                     generate_kwargs=kwargs)]


TREE_SHAPES = ((4, 4, 8), (4, 5, 16), (8, 6, 32))  # (top_k, depth, total_tokens) of the eagle3_tree family


@register_strategy("eagle3_tree")
def eagle3_tree_strategies(ks, tree_shapes=TREE_SHAPES, **options) -> list[Strategy]:
    """EAGLE-3 with EAGLE-2-style dynamic draft trees (see docs/trees.md), one strategy per tree shape.

    The strategy's ``k`` is the number of drafted tree nodes verified per round (``total_tokens``).

    Args:
        ks: unused (the tree shapes are fixed by ``tree_shapes``).
        tree_shapes: ``(top_k, depth, total_tokens)`` triples.
        options: unused.
    """
    out = []
    for top_k, depth, total in tree_shapes:
        kwargs = {"tree_top_k": top_k, "tree_depth": depth, "tree_total_tokens": total}
        out.append(Strategy(name=f"eagle3-tree k={top_k} d={depth} n={total}", family="eagle3_tree", k=total,
                            uses_draft=True, generate_kwargs=kwargs))
    return out


def parse_tree_shapes(text: str) -> tuple:
    """Parse ``--tree-shapes``: comma-separated ``TOPKxDEPTHxTOTAL`` triples, ``TOTAL`` may be ``auto``.

    Args:
        text: e.g. ``"4x4x8,8x6x32,4x5xauto"``.

    Returns:
        A tuple of ``(top_k, depth, total_tokens)`` triples for :func:`eagle3_tree_strategies`.
    """
    shapes = []
    for part in text.split(","):
        if not part.strip():
            continue
        fields = part.strip().lower().split("x")
        try:
            if len(fields) != 3:
                raise ValueError
            top_k, depth = int(fields[0]), int(fields[1])
            total = "auto" if fields[2] == "auto" else int(fields[2])
        except ValueError:
            raise ValueError(f"bad tree shape {part!r}: expected TOPKxDEPTHxTOTAL, e.g. 4x4x8 or 4x5xauto") from None
        if top_k < 1 or depth < 1 or (total != "auto" and total < 1):
            raise ValueError(f"bad tree shape {part!r}: top_k, depth and total_tokens must be >= 1")
        shapes.append((top_k, depth, total))
    if not shapes:
        raise ValueError("--tree-shapes is empty")
    return tuple(shapes)


def compile_modes(compile_draft) -> tuple:
    """
    The compile modes of ``--compile-draft``: ``False`` / ``None`` / ``""``: none; ``True``: ``("default",)``; a
    comma-separated string or a sequence: those modes.

    Args:
        compile_draft: the option's value.
    """
    if compile_draft is True:
        return ("default",)
    if not compile_draft:
        return ()
    modes = compile_draft.split(",") if isinstance(compile_draft, str) else list(compile_draft)
    modes = tuple(m.strip() for m in modes if m.strip())
    allowed = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    unknown = [m for m in modes if m not in allowed]
    if unknown:
        raise ValueError(f"--compile-draft: unknown torch.compile mode(s) {unknown}; use {', '.join(allowed)}.")
    return modes


def compiled_name(name: str, mode: str) -> str:
    """The name of ``name``'s compiled twin: ``"<name> compiled"`` (mode ``"default"``), else ``"<name> compiled
    <mode>"``.

    Args:
        name (`str`): the eager strategy's name.
        mode (`str`): the compile mode.
    """
    return f"{name} compiled" if mode == "default" else f"{name} compiled {mode}"


def build_strategies(ks, families: list[str] | None = None, compile_draft=False, **options) -> list[Strategy]:
    """Instantiate the strategies of the registered families (all of them by default); ``plain`` always comes first.

    Args:
        ks: draft lengths of the sweep.
        families: registry names to run; ``plain`` is added when missing (it is the reference).
        compile_draft: also run every strategy that uses the draft with compiled drafting steps, once per compile
            mode (see :func:`compile_modes`; named as :func:`compiled_name` says, right after its eager twin).
        options: passed to every factory.
    """
    modes = compile_modes(compile_draft)
    families = list(families or STRATEGIES)
    unknown = [f for f in families if f not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; registered: {sorted(STRATEGIES)}")
    if "plain" in families:
        families.remove("plain")
    strategies = []
    for family in ["plain"] + families:
        for strategy in STRATEGIES[family](list(ks), **options):
            strategies.append(strategy)
            if strategy.uses_draft:
                strategies += [replace(strategy, name=compiled_name(strategy.name, mode), compile_mode=mode)
                               for mode in modes]
    return strategies
