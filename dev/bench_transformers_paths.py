"""Time the ways Transformers' own loop can run an EAGLE-3 chain, against plain ``generate``, in one process.

Rows: plain ``generate``; the chain fed by forward hooks; the chain fed through Transformers' drafter protocol
(``requires_model_outputs``, transformers >= 5.25); the same chain on a static cache; and, with the target's decode
forward compiled on a static cache (``torch.compile`` through ``generation_config.compile_config``), plain
``generate`` and the chain. Each row is
timed over the same prompts, interleaved round-robin, and reported as a ratio to plain ``generate``; every row's
text is checked identical to plain ``generate``'s. Also prints the largest tensor bytes the target's outputs hand to
the drafter per forward (the protocol's cost in memory against the hooks').

    python dev/bench_transformers_paths.py --prompts 6 --new-tokens 96 --repeats 3 --json-out bench_out/paths.json

Uses SmolLM2-135M-Instruct (from the PyPI GGUF) and the draft shipped in ``examples/drafts``; fp32 by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_eagle3.core import transformers_compat as compat
from hf_eagle3.core.generate_hook import use_drafting
from hf_eagle3.environment import environment_record
from hf_eagle3.loading import encode_prompt, load_draft, load_prompts, load_target, shipped_draft_path


def feature_bytes(target, draft, ids) -> dict:
    """Bytes of hidden states one prefill keeps for the drafter, per prompt token: the hooks' three inputs, the
    protocol's selected states (``output_hidden_states=[...]``) and what releases without the selection would keep
    (``output_hidden_states=True``: every layer)."""
    from hf_eagle3.core.feature_capture import Eagle3FeatureCapture

    layer_ids = draft.config.resolve_feature_layer_ids(target.config.num_hidden_layers)
    with torch.no_grad(), Eagle3FeatureCapture(target, layer_ids) as capture:
        target(ids)
        hooks = capture.features().nbytes
    sizes = {"hooks": hooks}
    selections = {"all hidden states": True}
    if compat.SELECTS_HIDDEN_STATES:
        selections["protocol"] = sorted(layer_ids)
    for name, selection in selections.items():
        with torch.no_grad():
            states = target(ids, output_hidden_states=selection).hidden_states
        sizes[name] = sum(h.nbytes for h in states if h is not None)
    return {name: size // ids.shape[1] for name, size in sizes.items()}


def main() -> None:
    """Run the comparison and print a markdown table (and JSON with ``--json-out``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=None,
                        help="JSON-lines prompts (MT-bench question.jsonl or {\"prompt\": ...} rows); default: built-in")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=3, help="constant draft length of every EAGLE-3 row")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled row")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    target, tokenizer = load_target(None, dtype=torch.float32, device="cpu")
    draft, draft_name, _ = load_draft(str(shipped_draft_path()), target)
    texts = load_prompts(args.dataset, args.prompts)
    prompts = [encode_prompt(tokenizer, text) for text in texts]
    common = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    eagle = dict(assistant_model=draft, num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant")
    compile_config = None
    if not args.no_compile:
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=False, dynamic=None)
        # Transformers compiles the decode forward only on accelerators unless told otherwise; this private flag is
        # the switch for CPUs (used here, in a benchmark, never by the package).
        compile_config._compile_all_devices = True

    rows = {"plain generate": (None, dict(common))}
    rows["chain, hooks"] = ("hooks", dict(common, **eagle))
    if compat.SELECTS_HIDDEN_STATES:
        rows["chain, protocol"] = ("outputs", dict(common, **eagle))
    rows["chain, static cache"] = (None, dict(common, **eagle, cache_implementation="static"))
    if compile_config is not None:
        rows["plain generate, static + compiled"] = (None, dict(common, cache_implementation="static",
                                                                compile_config=compile_config))
        rows["chain, static + compiled"] = (None, dict(common, **eagle, cache_implementation="static",
                                                       compile_config=compile_config))

    def run(name, ids):
        features, kwargs = rows[name]
        with use_drafting(features=features):
            start = time.perf_counter()
            out = target.generate(ids, **kwargs)
            return time.perf_counter() - start, out

    reference = {}
    for name in rows:  # warm-up (and the compile), not timed; every row must equal plain generate
        for i, ids in enumerate(prompts[:2]):
            _, out = run(name, ids)
            if name == "plain generate":
                reference[i] = out
            elif not torch.equal(out, reference[i]):
                raise SystemExit(f"{name}: output differs from plain generate on prompt {i}")
    seconds = {name: [] for name in rows}
    accepted = {name: [] for name in rows}
    for _ in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name in rows:
                t, out = run(name, ids)
                seconds[name].append(t)
                if "assistant_model" in rows[name][1]:
                    accepted[name].append(draft.last_stats.mean_acceptance_length)
    totals = {name: sum(v) for name, v in seconds.items()}
    base = totals["plain generate"]
    result = {
        **environment_record(target, command="python " + " ".join(sys.argv), draft_path=draft_name),
        "draft": Path(draft_name).name, "k": args.k, "prompts": len(prompts),
        "new_tokens": args.new_tokens, "repeats": args.repeats,
        "rows": {name: {"speedup_vs_plain": base / totals[name],
                        "mean_acceptance_length": statistics.mean(accepted[name]) if accepted[name] else None}
                 for name in rows},
    }
    result["feature_bytes_per_prompt_token"] = feature_bytes(target, draft, prompts[0])
    print(f"CPU: {result['cpu']}\ntorch {torch.__version__}, transformers {result['transformers_version']}, fp32, "
          f"k = {args.k}, {len(prompts)} prompts x {args.new_tokens} tokens x {args.repeats}")
    print(f"hidden-state bytes kept per prompt token: {result['feature_bytes_per_prompt_token']}")
    print("| path | speed-up vs plain generate | mean acceptance length |\n| --- | ---: | ---: |")
    for name, row in result["rows"].items():
        acc = "" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}"
        print(f"| {name} | {row['speedup_vs_plain']:.2f}x | {acc} |")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
