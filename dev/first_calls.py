"""The first ``generate`` calls a user makes, in a fresh process: the first call after loading, then the first call at
a new context length (a long prompt), each timed against plain ``generate`` on the same prompt, with the draft's
saved settings. ``HF_EAGLE3_CACHE`` decides whether a cost table exists (point it at an empty directory for a machine
that never ran hf-eagle3). One process times one call of each; ``--repeats N`` runs N fresh processes (plain first
in odd ones, the saved default first in even ones, so that drift favours neither) and reports each call's median
ratio and range.

    HF_EAGLE3_CACHE=$(mktemp -d) python dev/first_calls.py --dtype float32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def main() -> None:
    """Time the first calls and print one JSON line per call and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes to run (each times every call once)")
    parser.add_argument("--saved-first", action="store_true", help="time the saved default before plain")
    args = parser.parse_args()
    if args.repeats > 1:
        repeat(args)
        return

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
        for strategy in ("saved default", "plain") if args.saved_first else ("plain", "saved default"):
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


def repeat(args) -> None:
    """Run ``args.repeats`` fresh processes of this script (each with the same ``HF_EAGLE3_CACHE``, copied afresh when
    it names a table, so every process starts from the same table) and report the median ratio of each call."""
    import shutil
    import tempfile

    from hf_eagle3.environment import environment_record

    source = os.environ.get("HF_EAGLE3_CACHE")
    runs = []
    for i in range(args.repeats):
        cache = tempfile.mkdtemp()
        if source and os.path.exists(os.path.join(source, "costs.json")):
            shutil.copy(os.path.join(source, "costs.json"), cache)
        command = [sys.executable, __file__, "--dtype", args.dtype, "--max-new-tokens", str(args.max_new_tokens)]
        if i % 2:
            command.append("--saved-first")
        out = subprocess.run(command, env={**os.environ, "HF_EAGLE3_CACHE": cache}, capture_output=True, text=True,
                             check=True).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        runs.append(rows)
        print(json.dumps({"process": i, "saved_first": bool(i % 2), "ratios": [r["ratio"] for r in rows]}), flush=True)
        shutil.rmtree(cache)
    summary = []
    for j, row in enumerate(runs[0]):
        ratios = [run[j]["ratio"] for run in runs]
        summary.append({"call": row["call"], "median": statistics.median(ratios), "min": min(ratios),
                        "max": max(ratios), "ratios": ratios, "rounds": [run[j]["rounds"] for run in runs]})
        print(f"{row['call']}: median {summary[-1]['median']:.3f}x plain (range {min(ratios):.3f}-{max(ratios):.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": environment_record(None, "python " + " ".join(sys.argv)),
                       "table": "given" if source and os.path.exists(os.path.join(source, "costs.json")) else "none",
                       "calls": summary}, f, indent=1)


if __name__ == "__main__":
    main()
