"""The first ``generate`` calls a user makes, in a fresh process: the first call after loading, then the first call at
a new context length (a long prompt), each timed against plain ``generate`` on the same prompt, with the draft's
saved settings. ``HF_EAGLE3_CACHE`` decides whether a cost table exists (point it at an empty directory for a machine
that never ran hf-eagle3).

    HF_EAGLE3_CACHE=$(mktemp -d) python dev/first_calls.py --dtype float32
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> None:
    """Time the first calls and print one JSON line per call and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import hf_eagle3
    from hf_eagle3.environment import environment_record
    from hf_eagle3.loading import encode_prompt, shipped_draft_path
    from hf_eagle3.smollm2 import load_smollm2

    target, tokenizer = load_smollm2()
    target = target.to(getattr(torch, args.dtype))
    draft = hf_eagle3.Eagle3DraftModel.from_pretrained(shipped_draft_path()).to(target.dtype)
    short = encode_prompt(tokenizer, "Explain in a few sentences why the sky is blue.")
    text = " ".join(["The history of the printing press spans centuries and continents."] * 60)
    long = encode_prompt(tokenizer, "Summarise this text in three sentences: " + text)
    rows = []
    for name, ids in (("first call after loading", short), ("first call at a new context length", long)):
        times = {}
        for strategy in ("plain", "saved default"):
            kwargs = {"assistant_model": draft} if strategy != "plain" else {}
            start = time.perf_counter()
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                            do_sample=False, **kwargs)
            times[strategy] = time.perf_counter() - start
        row = {"call": name, "prompt_tokens": ids.shape[1], "ratio": times["plain"] / times["saved default"],
               "rounds": draft.last_stats.rounds_summary()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"settings": environment_record(target, "python " + " ".join(sys.argv)), "calls": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
