"""``hf-eagle3 check DRAFT --target TARGET``: what a draft is, whether it fits a target, and which layer ids it
was trained with.

A draft's ``config.json`` cannot always say which target layers it reads: the ``eagle_config`` field means
"output of layer id" to SGLang, SpecForge, AngelSlim and ModelOpt's HF path, but vLLM and speculators conversions
read the same field as "input of layer id". :func:`check_draft` therefore measures the acceptance of the draft on a
few built-in prompts twice, with the ids as read and shifted by one, and names the better one with how to set it.

Python API: :func:`check_draft` (returns a JSON-friendly dict) and :func:`format_report` (the ten-second text).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..core.configuration_eagle3 import detect_layout, read_config_file
from ..core.settings import DEFAULT_DRAFT_LENGTH
from ..loading import BUILTIN_PROMPTS, encode_prompt, load_target
from .parsers import DEFAULT_MAX_NEW_TOKENS, DEFAULT_NUM_PROMPTS
from .parsers import add_check_parser as register  # noqa: F401  (the parser, kept importable from here)

# Acceptance lengths closer than this are a tie: the ids as read are kept.
TIE_MARGIN = 0.05


def _raw_config(draft, draft_path):
    """The draft's ``config.json`` dict and layout (``None``s for a draft built in memory)."""
    if draft_path is None:
        return None, "native"
    cfg_file = os.path.join(str(draft_path), "config.json")
    if not os.path.isfile(cfg_file):
        return None, "native"
    raw = read_config_file(cfg_file)
    return raw, detect_layout(raw)


def _id_source(raw: dict | None, layout: str) -> tuple[str, int]:
    """Where the layer ids came from, and the direction of the other convention (+1 or -1)."""
    if raw is None or layout == "native":
        if raw is not None and raw.get("feature_layer_ids") is None:
            return "none given: the reference default [2, N//2, N-3]", -1
        return "feature_layer_ids (hf-eagle3: input of layer i)", +1
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if layout == "flat" and eagle.get("eagle_aux_hidden_state_layer_ids"):
        return "eagle_config.eagle_aux_hidden_state_layer_ids, read as output of layer id (+1, as SGLang)", -1
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        return "eagle_aux_hidden_state_layer_ids, read as input of layer i (as vLLM)", +1
    return "none given: the reference default [2, N//2, N-3]", -1


def _how_to_set(layout: str, ids: list[int]) -> str:
    """The config change (and the Python line) that makes the draft read ``ids`` (our convention)."""
    minus = [i - 1 for i in ids]
    if layout == "flat":
        where = (f"in config.json set eagle_config.eagle_aux_hidden_state_layer_ids = {minus} (SGLang convention) "
                 f"and eagle_aux_hidden_state_layer_ids = {ids} (vLLM)")
    elif layout == "speculators":
        where = f"in config.json set eagle_aux_hidden_state_layer_ids = {ids}"
    else:
        where = f"in config.json set feature_layer_ids = {ids}"
    return f"{where}; in Python: draft.config.feature_layer_ids = {ids}"


def _text_config(target):
    return target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config


def _fit_problems(draft, target, tokenizer, n_layers: int) -> list[str]:
    """What keeps ``draft`` from running on ``target``, each with its fix (empty when it fits)."""
    c, text = draft.config, _text_config(target)
    problems = []
    t_hidden, t_vocab = getattr(text, "hidden_size", None), getattr(text, "vocab_size", None)
    if t_hidden != c.target_hidden_size:
        problems.append(f"hidden size: the target has {t_hidden}, the draft reads features of width "
                        f"{c.target_hidden_size} (target_hidden_size). Fix: use the draft made for this target.")
    if t_vocab != c.vocab_size:
        problems.append(f"vocabulary: the target has {t_vocab} tokens, the draft maps onto {c.vocab_size}. Fix: use a "
                        "draft trained for this target's tokenizer.")
    if tokenizer is not None and t_vocab is not None and len(tokenizer) > t_vocab:
        problems.append(f"tokenizer: {len(tokenizer)} tokens for a vocabulary of {t_vocab}. Fix: pass the target's "
                        "own tokenizer.")
    ids = c.feature_layer_ids
    if ids is not None and any(not 0 <= i < n_layers for i in ids):
        problems.append(f"layers: the draft reads layers {ids}, the target has {n_layers} (valid 0..{n_layers - 1}). "
                        "Fix: use the draft made for this target, or set draft.config.feature_layer_ids.")
    if not c.has_embed_tokens and not problems:
        emb = target.get_input_embeddings()
        if emb is None or emb.weight.shape[-1] != c.hidden_size:
            problems.append("embedding: the draft shares the target's input embedding, whose width differs from the "
                            f"draft's hidden size {c.hidden_size}. Fix: a checkpoint with embed_tokens.weight.")
    if not c.has_lm_head and not problems:
        head = target.get_output_embeddings()
        if head is None or head.weight.shape[-1] != c.hidden_size:
            problems.append("head: the draft has no lm_head and uses the target's, whose input width differs from "
                            f"the draft's hidden size {c.hidden_size}. Fix: a checkpoint with lm_head.weight.")
    return problems


def _notes(config, target) -> list[str]:
    """Remarks that are not misfits: the draft names another target than the one given."""
    made_for = config.target_name_or_path
    name = getattr(target, "name_or_path", None) or ""
    if made_for and os.path.basename(str(made_for).rstrip("/")) != os.path.basename(str(name).rstrip("/")):
        return [f"the draft was made for {made_for}; the target is {name or type(target).__name__} (fine if it is "
                "the same model)"]
    return []


def _prompt_ids(tokenizer, num_prompts: int, vocab_size: int) -> list[torch.LongTensor]:
    """The built-in prompts as ids (through the chat template), or fixed random ids without a tokenizer."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(4, vocab_size, (1, 12), generator=gen) for _ in range(num_prompts)]
    return [encode_prompt(tokenizer, BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]) for i in range(num_prompts)]


def measure_acceptance(target, draft, prompts, layer_ids: list[int], max_new_tokens: int, k: int) -> dict:
    """Mean acceptance length of ``draft`` reading ``layer_ids``, greedy, a constant draft length ``k``.

    The draft's own ``feature_layer_ids`` and statistics are restored afterwards.

    Args:
        target: the target model.
        draft (`Eagle3DraftModel`): the draft.
        prompts (`list[torch.LongTensor]`): prompt ids, each ``[1, L]``.
        layer_ids (`list[int]`): the three capture indices to try (input of layer i).
        max_new_tokens (`int`): new tokens per prompt.
        k (`int`): tokens drafted per round.

    Returns:
        ``{"layer_ids", "mean_acceptance_length", "acceptance_per_position"}``.
    """
    saved = draft.config.feature_layer_ids, draft.last_stats, draft.cumulative_stats
    draft.config.feature_layer_ids = list(layer_ids)
    draft.reset_stats()
    device = next(target.parameters()).device
    try:
        with torch.no_grad():
            for ids in prompts:
                target.generate(ids.to(device), assistant_model=draft, do_sample=False, max_new_tokens=max_new_tokens,
                                num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                pad_token_id=getattr(target.generation_config, "pad_token_id", None) or 0)
        stats = draft.cumulative_stats
    finally:
        draft.config.feature_layer_ids, draft.last_stats, draft.cumulative_stats = saved
    return {"layer_ids": list(layer_ids), "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
            "acceptance_per_position": [round(x, 3) for x in stats.acceptance_rate_per_position]}


def check_draft(draft, target, tokenizer=None, draft_path: str | os.PathLike | None = None,
                num_prompts: int = DEFAULT_NUM_PROMPTS, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                k: int = DEFAULT_DRAFT_LENGTH, measure: bool = True, progress=None) -> dict:
    """Describe a draft, check that it fits a target, and measure which layer-id convention it was trained with.

    Args:
        draft (`Eagle3DraftModel`, `str` or `os.PathLike`): the draft, or its directory / Hub id (any layout).
        target (`PreTrainedModel`): the target model.
        tokenizer (*optional*): the target's tokenizer (prompts then go through its chat template); without one,
            fixed random prompts are used.
        draft_path (`str`, *optional*): the draft's directory when ``draft`` is a model (to read its raw config).
        num_prompts (`int`): built-in prompts to measure on.
        max_new_tokens (`int`): new tokens per prompt.
        k (`int`): tokens drafted per round while measuring.
        measure (`bool`): measure acceptance (``False``: describe and check only).
        progress (`Callable[[str], None]`, *optional*): called with a line before each measurement.

    Returns:
        A JSON-friendly dict: ``layout``, ``variant`` (norms, RoPE, sliding window, vocabulary mapping, embedding and
        head sharing), ``layers`` (as read, in each convention, and the shifted candidate), ``target``, ``problems``
        (each with its fix; empty when the pair fits), ``candidates`` (measured acceptance of each layer-id choice),
        ``best``, ``advice`` and ``notes`` (remarks that are not misfits).
    """
    from ..core.modeling_eagle3 import Eagle3DraftModel

    if not isinstance(draft, torch.nn.Module):
        draft_path = str(draft)
        draft = Eagle3DraftModel.from_pretrained(draft_path)
    raw, layout = _raw_config(draft, draft_path)
    c = draft.config
    text = _text_config(target)
    n_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    source, shift = _id_source(raw, layout)
    report = {
        "draft": str(draft_path) if draft_path is not None else type(draft).__name__,
        "layout": layout,
        "variant": {
            "norm_before_residual": c.norm_before_residual, "norm_output": c.norm_output,
            "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm, "qk_norm": c.qk_norm,
            "sliding_window": c.draft_sliding_window,
            "rope": {"theta": c.rope_theta, "scaling": (c.draft_rope_scaling or {}).get("rope_type"),
                     "partial_rotary_factor": c.partial_rotary_factor},
            "vocab": {"draft": c.draft_vocab_size, "target": c.vocab_size,
                      "mapping": "d2t" if c.draft_vocab_size != c.vocab_size or bool(draft.d2t.any()) else "identity"},
            "embedding": "own" if c.has_embed_tokens else "shared with the target",
            "lm_head": "own" if c.has_lm_head else "the target's, restricted to the draft vocabulary",
        },
        "target": {"name": getattr(target, "name_or_path", None) or type(target).__name__, "layers": n_layers,
                   "hidden_size": getattr(text, "hidden_size", None), "vocab_size": getattr(text, "vocab_size", None)},
        "problems": _fit_problems(draft, target, tokenizer, n_layers),
        "notes": _notes(c, target),
        "candidates": [],
        "best": None,
        "advice": None,
    }
    ids = c.resolve_feature_layer_ids(n_layers) if not report["problems"] and n_layers else c.feature_layer_ids
    layers = {"source": source, "as_read": ids}
    if ids is not None:
        layers["input_of_layer"] = list(ids)  # hf-eagle3, vLLM, speculators
        layers["output_of_layer"] = [i - 1 for i in ids]  # SGLang / SpecForge / ModelOpt eagle_config
        shifted = None
        for step in (shift, -shift):
            cand = [i + step for i in ids]
            if all(0 <= i < n_layers for i in cand):
                shifted = cand
                break
        layers["shifted"] = shifted
    report["layers"] = layers
    if report["problems"] or not measure or ids is None:
        return report
    prompts = _prompt_ids(tokenizer, num_prompts, int(c.vocab_size))
    report["measured_on"] = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": k}
    _measure_candidates(report, target, draft, prompts, max_new_tokens, k, progress)
    return report


def _measure_candidates(report: dict, target, draft, prompts: list, max_new_tokens: int, k: int, progress) -> None:
    """Measure the layer ids as read and shifted, and fill the report's ``candidates``, ``best`` and ``advice``."""
    layers = report["layers"]
    for name, cand in (("as read", layers["as_read"]), ("shifted", layers.get("shifted"))):
        if cand is not None:
            if progress is not None:
                progress(f"measuring acceptance with the layer ids {name} ({list(cand)}) on {len(prompts)} prompts, "
                         f"{max_new_tokens} new tokens each ...")
            report["candidates"].append(dict(name=name, **measure_acceptance(target, draft, prompts, cand,
                                                                              max_new_tokens, k)))
    best = report["candidates"][0]
    for cand in report["candidates"][1:]:
        if cand["mean_acceptance_length"] > best["mean_acceptance_length"] + TIE_MARGIN:
            best = cand
    report["best"] = best["name"]
    if best["name"] == "as read":
        report["advice"] = f"the layer ids as read ({best['layer_ids']}) are the better ones: nothing to change."
    else:
        report["advice"] = (f"the shifted layer ids {best['layer_ids']} accept more: "
                            + _how_to_set(report["layout"], best["layer_ids"]) + ".")


def format_report(report: dict) -> str:
    """The report of :func:`check_draft` as a few lines a person reads in ten seconds.

    Args:
        report (`dict`): what :func:`check_draft` returned.
    """
    v, t, lay = report["variant"], report["target"], report["layers"]
    rope = v["rope"]
    norms = [n for n in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm", "qk_norm") if v[n]]
    lines = [
        f"draft   {report['draft']} ({report['layout']} layout)",
        f"  norms: {', '.join(norms) or 'standard EAGLE-3'}; attention: "
        + (f"sliding window {v['sliding_window']}" if v["sliding_window"] else "full")
        + f"; RoPE theta {rope['theta']:g}, scaling {rope['scaling'] or 'none'}"
        + (f", partial {rope['partial_rotary_factor']:g}" if rope["partial_rotary_factor"] != 1.0 else ""),
        f"  vocab: {v['vocab']['draft']} draft tokens -> {v['vocab']['target']} ({v['vocab']['mapping']}); "
        f"embedding {v['embedding']}; lm_head {v['lm_head']}",
        f"  layers: {lay['as_read']} from {lay['source']}",
    ]
    if lay.get("input_of_layer") is not None:
        lines.append(f"          = inputs of layers {lay['input_of_layer']} (vLLM, speculators) = outputs of layers "
                     f"{lay['output_of_layer']} (SGLang eagle_config)")
    lines.append(f"target  {t['name']}: {t['layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}")
    lines.extend(f"note    {n}" for n in report.get("notes", []))
    if report["problems"]:
        lines.append("PROBLEMS (the draft does not fit this target):")
        lines.extend(f"  - {p}" for p in report["problems"])
        return "\n".join(lines)
    lines.append("fit     OK (hidden size, vocabulary, tokenizer, layer count)")
    if report["candidates"]:
        m = report["measured_on"]
        lines.append(f"acceptance ({m['prompts']} prompts, {m['max_new_tokens']} new tokens, k={m['k']}, greedy):")
        for cand in report["candidates"]:
            mark = "  <- better" if cand["name"] == report["best"] and len(report["candidates"]) > 1 else ""
            lines.append(f"  {cand['name']:<9} {str(cand['layer_ids']):<16} mean acceptance length "
                         f"{cand['mean_acceptance_length']:.2f}{mark}")
        lines.append(f"=> {report['advice']}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    """Run ``hf-eagle3 check``: 0 when the pair fits, 1 when it does not (or cannot be loaded)."""
    from ..core.modeling_eagle3 import Eagle3DraftModel

    def say(line: str) -> None:
        print(f"hf-eagle3 check: {line}", file=sys.stderr, flush=True)

    try:
        draft = Eagle3DraftModel.from_pretrained(args.draft)  # a draft that cannot be read: refused before the target
        say(f"loading the target {args.target or 'SmolLM2-135M-Instruct'} ...")
        target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device, tokenizer="optional")
        report = check_draft(draft, target, tokenizer, draft_path=args.draft, num_prompts=args.num_prompts,
                             max_new_tokens=args.max_new_tokens, k=args.k, measure=not args.no_measure, progress=say)
    except (ValueError, OSError) as err:
        print(f"hf-eagle3 check: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0
