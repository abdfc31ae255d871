"""``hf-eagle3 bench --batch-sizes 1,2,4,8``: plain batched ``generate`` against EAGLE-3 chains, ``"auto"`` and trees on
the same left-padded batches, with the ratios to plain batched ``generate`` of the same batch size (greedy).

For every batch size the prompts are cut into consecutive batches; for every batch each strategy runs in turn
(interleaved, so that a change of machine load hits all alike), after a warm-up call per strategy and batch size (lazy
initialisation and compilation are not timed); ``repeats`` times over, for a machine whose
speed varies from call to call. Besides the ratio of the summed times, each strategy's median over its calls of the
ratio to the plain call just before it (paired: robust to drift and to one slow call).
Every row of every strategy's output is compared with plain batched ``generate``'s.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_eagle3.bench.strategies import TREE_SHAPES, build_strategies
from hf_eagle3.core.cost_model import synchronize
from hf_eagle3.loading import encode_prompt

# Families that run on batches (prompt-lookup decoding is Transformers' assisted loop, batch 1 only).
BATCHED_FAMILIES = ("plain", "eagle3_chain", "eagle3_auto", "eagle3_tree")


def left_padded(encoded: list, pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """
    Stack prompts ``[1, L_i]`` into a left-padded batch and its attention mask.

    Args:
        encoded (`list[torch.LongTensor]`): the prompts' ids.
        pad_token_id (`int`): the padding id.
    """
    width = max(ids.shape[1] for ids in encoded)
    ids = torch.full((len(encoded), width), pad_token_id, dtype=torch.long, device=encoded[0].device)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(encoded):
        ids[b, width - row.shape[1] :] = row[0]
        mask[b, width - row.shape[1] :] = 1
    return ids, mask


def new_tokens(out: torch.LongTensor, prompt_width: int, eos: set) -> list[list[int]]:
    """Each row's new tokens, up to and including its first EOS (the padding after it is not output)."""
    rows = []
    for row in out[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def run_batched_bench(target, draft, tokenizer, prompts: list[str], batch_sizes=(1, 2, 4, 8), max_new_tokens: int = 64,
                      ks=(1, 3, 5), families=None, tree_shapes=TREE_SHAPES, progress: bool = True,
                      compile_draft=None, repeats: int = 1) -> dict:
    """
    Time plain batched ``generate`` and the EAGLE-3 strategies on the same batches, greedy.

    Args:
        target: the target model.
        draft: the EAGLE-3 draft.
        tokenizer: the target's tokenizer (chat template when it has one); ``None`` when ``prompts`` are ids.
        prompts (`list[str]` or `list[torch.LongTensor]`): the user messages, or prompt ids ``[1, L_i]`` (padded
            with id 0 when no tokenizer is given); batches are consecutive slices.
        batch_sizes (`tuple[int]`): rows per ``generate`` call.
        max_new_tokens (`int`): new tokens per row (a row may end earlier at EOS).
        ks (`tuple[int]`): draft lengths of the chain family.
        families (`list[str]`, *optional*): strategy families (default: :data:`BATCHED_FAMILIES`).
        tree_shapes: ``(top_k, depth, total_tokens)`` triples of the tree family.
        progress (`bool`): print one line per batch size on stderr.
        compile_draft (`str` or `bool`): also run every EAGLE-3 strategy with compiled drafting steps, side by side,
            once per mode (:func:`~hf_eagle3.bench.strategies.compile_modes`).
        repeats (`int`): times every batch is timed per strategy (in turn with the others).

    Returns:
        ``{"results": [...], "greedy_identical": bool, "mismatches": [...]}``; each result has ``batch_size``,
        ``strategy``, ``new_tokens``, ``seconds``, ``tokens_per_s``, ``speedup`` (to plain batched ``generate`` of
        that batch size), ``paired_speedup`` (the median over the calls of the ratio to the plain call of the same
        batch and repeat), ``speedup_vs_batch1_plain`` and ``mean_acceptance_length``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time every batch at least once")
    families = [f for f in (families or BATCHED_FAMILIES) if f in BATCHED_FAMILIES]
    if "plain" not in families:
        families = ["plain"] + families
    strategies = build_strategies(ks, families, compile_draft=compile_draft, tree_shapes=tuple(tree_shapes))
    encoded = [(p if isinstance(p, torch.Tensor) else encode_prompt(tokenizer, p)).to(target.device) for p in prompts]
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    results, mismatches = [], []
    for size in batch_sizes:
        batches = [left_padded(encoded[i : i + size], pad) for i in range(0, len(encoded) - size + 1, size)]
        if not batches:
            raise ValueError(f"--batch-sizes {size}: only {len(encoded)} prompts; raise --num-prompts.")
        totals = {s.name: {"seconds": 0.0, "new_tokens": 0, "stats": None, "calls": []} for s in strategies}
        for s in strategies:  # warm-up: lazy initialisation (and compilation) is not timed
            kwargs = dict(s.generate_kwargs, assistant_model=draft) if s.uses_draft else dict(s.generate_kwargs)
            ids, mask = batches[0]
            with s.applied_to(draft):
                target.generate(ids, attention_mask=mask, max_new_tokens=min(8, max_new_tokens), do_sample=False,
                                **kwargs)
        for b, (ids, mask) in [pair for _ in range(repeats) for pair in enumerate(batches)]:
            reference = None
            for s in strategies:
                kwargs = dict(s.generate_kwargs, assistant_model=draft) if s.uses_draft else dict(s.generate_kwargs)
                with s.applied_to(draft):
                    synchronize(target)
                    start = time.perf_counter()
                    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                          **kwargs)
                    synchronize(target)
                    seconds = time.perf_counter() - start
                total = totals[s.name]
                total["seconds"] += seconds
                rows = new_tokens(out, ids.shape[1], eos)
                made = sum(len(r) for r in rows)
                total["new_tokens"] += made
                total["calls"].append(made / seconds)
                if s.uses_draft:
                    total["stats"] = draft.last_stats if total["stats"] is None else total["stats"] + draft.last_stats
                if reference is None:
                    reference = rows
                elif rows != reference:
                    mismatches.append({"batch_size": size, "batch": b, "strategy": s.name})
        plain_tps = totals["plain"]["new_tokens"] / totals["plain"]["seconds"]
        for s in strategies:
            total = totals[s.name]
            tps = total["new_tokens"] / total["seconds"]
            results.append({
                "batch_size": size, "strategy": s.name, "family": s.family, "num_batches": len(batches),
                "new_tokens": total["new_tokens"], "seconds": total["seconds"], "tokens_per_s": tps,
                "speedup": tps / plain_tps,
                "paired_speedup": statistics.median(
                    mine / plain for mine, plain in zip(total["calls"], totals["plain"]["calls"])),
                "mean_acceptance_length": total["stats"].mean_acceptance_length if total["stats"] else None,
                "rounds_without_draft": total["stats"].num_rounds_without_draft if total["stats"] else None,
            })
        if progress:
            print(f"batch {size}: " + ", ".join(f"{r['strategy']} {r['speedup']:.2f}x" for r in results
                                                 if r["batch_size"] == size), file=sys.stderr)
    one = {r["strategy"]: r["tokens_per_s"] for r in results if r["batch_size"] == batch_sizes[0]}
    plain_one = one.get("plain")
    for r in results:
        r["speedup_vs_first_plain"] = r["tokens_per_s"] / plain_one if plain_one else None
    return {"results": results, "greedy_identical": not mismatches, "mismatches": mismatches,
            "batch_sizes": list(batch_sizes), "max_new_tokens": max_new_tokens, "num_prompts": len(encoded),
            "repeats": repeats}


def format_batched_markdown(report: dict) -> str:
    """The report as a Markdown table: one row per batch size and strategy."""
    first = report["batch_sizes"][0]
    lines = [f"| batch | strategy | tokens/s | vs plain batched | median paired | vs plain batch {first} | "
             "acceptance length |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        acc = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        lines.append(f"| {r['batch_size']} | {r['strategy']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['paired_speedup']:.2f}x | {r['speedup_vs_first_plain']:.2f}x | {acc} |")
    lines.append("")
    lines.append("greedy outputs identical to plain batched generate: "
                 + ("yes" if report["greedy_identical"] else f"NO ({len(report['mismatches'])} batches differ)"))
    return "\n".join(lines) + "\n"


def write_batched_outputs(report: dict, out_dir: str | os.PathLike) -> dict:
    """Write ``bench_batched.json`` and ``bench_batched.md`` into ``out_dir`` (created when missing).

    Args:
        report (`dict`): what :func:`run_batched_bench` returned.
        out_dir (`str` or `os.PathLike`): destination directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_batched.json", "markdown": out / "bench_batched.md"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(format_batched_markdown(report))
    return {k: str(v) for k, v in paths.items()}
