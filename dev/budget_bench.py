"""The saved default against fixed shapes, as a user meets it: every strategy interleaved prompt by prompt, no warm-up
of the speculative path (plain ``generate`` is warmed up once, so that lazy initialisation is not charged to the
first strategy), first calls included, and the first call after loading reported on its own.

    python dev/budget_bench.py --dtype bfloat16 --out docs/bench_results/budget_bf16.json

Prompts: ``--prompts`` (a JSONL file with ``prompt`` fields) read at ``--offset + i * --stride``, so that a slice
never used for tuning can be chosen. The draft is the shipped one unless ``--draft`` names another; the saved
default is the draft's own ``generation_config`` (nothing passed but ``assistant_model``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

STRATEGIES = {
    "plain": None,
    "saved default": {},
    "chain k=3": {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant"},
    "chain k=5": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant"},
    "tree 4x4x8": {"tree_top_k": 4, "tree_depth": 4, "tree_total_tokens": 8},
    "tree 4x5x16": {"tree_top_k": 4, "tree_depth": 5, "tree_total_tokens": 16},
    "tree auto 4x5": {"tree_top_k": 4, "tree_depth": 5, "tree_total_tokens": "auto"},
    "chain auto k<=5": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "auto"},
}


def read_prompts(path: str, offset: int, stride: int, count: int) -> list:
    """``count`` prompts of a JSONL file, at ``offset + i * stride``."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    return [rows[offset + i * stride] for i in range(count)]


def shapes(stats) -> dict:
    """How many rounds drafted how many tokens (chains: by length; trees: by depth), and rounds without a draft."""
    drafted = list(stats.drafted_per_position) + [0]
    out = {str(i + 1): drafted[i] - drafted[i + 1] for i in range(len(drafted) - 1) if drafted[i] - drafted[i + 1]}
    out["0"] = stats.num_rounds_without_draft
    return out


def main() -> None:
    """Run the comparison and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default="../shared/data/chat_prompts.jsonl")
    parser.add_argument("--offset", type=int, default=101)
    parser.add_argument("--stride", type=int, default=769)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated names of STRATEGIES")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import hf_eagle3
    from hf_eagle3.environment import environment_record
    from hf_eagle3.loading import encode_prompt, shipped_draft_path
    from hf_eagle3.smollm2 import load_smollm2

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_smollm2()
    target = target.to(dtype)
    draft = hf_eagle3.Eagle3DraftModel.from_pretrained(args.draft or shipped_draft_path()).to(dtype)
    prompts = read_prompts(args.prompts, args.offset, args.stride, args.num_prompts)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    names = [s.strip() for s in args.strategies.split(",")]
    target.generate(encoded[0], attention_mask=torch.ones_like(encoded[0]), max_new_tokens=4, do_sample=False)

    calls = []
    totals = {name: {"seconds": 0.0, "tokens": 0, "rounds": {}, "drafts": 0, "accepted": 0} for name in names}
    plain_out = {}
    for i, ids in enumerate(encoded):
        for name in names:
            kwargs = {} if STRATEGIES[name] is None else dict(STRATEGIES[name], assistant_model=draft)
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, **kwargs)
            seconds = time.perf_counter() - start
            new = out[0, ids.shape[1]:].tolist()
            call = {"prompt": i, "prompt_tokens": ids.shape[1], "strategy": name, "seconds": seconds,
                    "tokens": len(new)}
            total = totals[name]
            total["seconds"] += seconds
            total["tokens"] += len(new)
            if name == "plain":
                plain_out[i] = new
            else:
                call["identical"] = new == plain_out.get(i, new)
                stats = draft.last_stats
                call["rounds"] = shapes(stats)
                for k, v in call["rounds"].items():
                    total["rounds"][k] = total["rounds"].get(k, 0) + v
                total["drafts"] += stats.num_drafts
                total["accepted"] += stats.num_accepted_tokens
            calls.append(call)
            print(json.dumps(call), flush=True)

    plain = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    table = {}
    for name, total in totals.items():
        tps = total["tokens"] / total["seconds"]
        table[name] = {"tokens_per_s": tps, "ratio": tps / plain, "rounds": total["rounds"],
                       "tokens_per_drafting_round": 1 + total["accepted"] / total["drafts"] if total["drafts"] else None}
    first = {c["strategy"]: c["seconds"] for c in calls if c["prompt"] == 0}
    report = {"settings": {**environment_record(target, "python dev/budget_bench.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                  draft_path=getattr(draft, "name_or_path", None)), "args": vars(args)},
              "table": table,
              "first_call_ratio": {name: first["plain"] / s for name, s in first.items()} if "plain" in first else {},
              "all_identical": all(c.get("identical", True) for c in calls),
              "calls": calls}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for name, row in table.items():
        print(f"{name:14s} {row['ratio']:.3f}x  {row['tokens_per_s']:.1f} tok/s  rounds {row['rounds']}")
    print("first call ratios:", {k: round(v, 3) for k, v in report["first_call_ratio"].items()})
    print("identical:", report["all_identical"])


if __name__ == "__main__":
    main()
