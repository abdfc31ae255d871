"""The cost model at the call's context length: what ``"auto"`` believes a verification costs, and what it then does,
when the forwards are timed on a 128-entry cache against a cache as long as the call's prompt.

For each prompt length (a document built from the training prompts, then a question about it, in SmolLM2's chat
template; SmolLM2 with the shipped draft): the target's forward time for 1 to 64 new tokens over one token's, timed
on both caches; then, in the same process, plain ``generate`` and ``generate`` with the given EAGLE-3 settings (a
tree of ``"auto"`` size by default), once with the costs timed on 128 entries (``context_length`` held at 128, as a
fixed-context cost model does) and once at the prompt's own length. Each setting runs a warm-up call first (which
also measures its costs), so the timed calls measure decoding only. EOS is switched off so that every call runs
its tokens.

    python dev/context_costs.py --lengths 1024,4096 --out context_costs.json

Prints the CPU flags first. Not a test: a measurement for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_eagle3.environment import cpu_description


def main() -> None:
    """Run the measurement and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens (default 1024,4096)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per setting (the fastest is kept)")
    parser.add_argument("--out", default="context_costs.json")
    args = parser.parse_args()
    from long_context import long_prompt, smollm2_and_draft

    from hf_eagle3.core import cost_model
    from hf_eagle3.core.tree_policy import AUTO_SIZES

    target, tok, draft = smollm2_and_draft()
    settings = {"chain auto": dict(num_assistant_tokens_schedule="auto"),
                "tree auto": dict(tree_top_k=4, tree_depth=5, tree_total_tokens="auto")}
    context_length = cost_model.context_length
    report = {"cpu": cpu_description(), "torch_threads": torch.get_num_threads(), "dtype": str(target.dtype),
              "max_new_tokens": args.max_new_tokens, "rows": []}

    def best_time(ids, **kwargs) -> tuple[float, float]:
        """Fastest of ``--repeats`` calls after a warm-up, and the acceptance length of the last."""
        with torch.no_grad():
            target.generate(ids, do_sample=False, max_new_tokens=4, **kwargs)  # warm-up (costs measured here)
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens, **kwargs)
                best = min(best, time.perf_counter() - start)
        accepted = draft.last_stats.mean_acceptance_length if "assistant_model" in kwargs else 1.0
        return best, accepted

    for length in (int(x) for x in args.lengths.split(",")):
        ids = long_prompt(tok, length)
        row = {"prompt_tokens": ids.shape[1], "context_length": context_length(ids.shape[1])}
        for name, fixed in (("costs at 128", True), ("costs at the prompt's length", False)):
            cost_model.context_length = (lambda n: cost_model.CONTEXT_TOKENS) if fixed else context_length
            table = cost_model.target_costs(target, ids, sizes=AUTO_SIZES, masked=True)  # as the tree loop times
            row[f"target_ratio ({name})"] = {n: table[n] / table[1] for n in AUTO_SIZES}
        cost_model.context_length = context_length
        plain, _ = best_time(ids)
        row["plain_seconds"] = plain
        for strategy, kwargs in settings.items():
            for name, fixed in (("costs at 128", True), ("costs at the prompt's length", False)):
                cost_model.context_length = (lambda n: cost_model.CONTEXT_TOKENS) if fixed else context_length
                seconds, accepted = best_time(ids, assistant_model=draft, **kwargs)
                row[f"{strategy} ({name})"] = {"speedup": plain / seconds, "acceptance_length": accepted,
                                               "rounds": draft.last_stats.num_target_forwards}
            cost_model.context_length = context_length
        report["rows"].append(row)
        ratios = " / ".join(f"{row[f'target_ratio ({n})'][64]:.2f}" for n in ("costs at 128",
                                                                               "costs at the prompt's length"))
        print(f"prompt {row['prompt_tokens']} (timed on {row['context_length']}): a 64-token forward costs {ratios} "
              "one-token forwards (128 / the prompt's length)", flush=True)
        for strategy in settings:
            print("  " + strategy + ": " + ", ".join(
                f"{name} {row[f'{strategy} ({name})']['speedup']:.2f}x plain "
                f"(acceptance {row[f'{strategy} ({name})']['acceptance_length']:.2f}, "
                f"{row[f'{strategy} ({name})']['rounds']} rounds)"
                for name in ("costs at 128", "costs at the prompt's length")), flush=True)
    json.dump(report, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
