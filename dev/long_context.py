"""Per-round cost of EAGLE-3 rounds at long prompts, and the memory of the draft's prompt feed.

For each prompt length (a document built from the training prompts, then a question about it, in SmolLM2's chat
template), times ``generate`` with the shipped draft at two ``max_new_tokens`` and reports the marginal time per round
(the difference of the two calls over the difference of their target forwards), so that the prefill and the prompt's
feed cancel; plain ``generate`` the same way, per token. The tree rounds run twice: on the preallocated target cache
the loop uses, and with its full-attention layers left as Transformers' ``DynamicLayer`` (which concatenates, copying
the whole cache every forward), for comparison. Then, in a fresh process per length, the peak resident
memory (sampled every half millisecond) that the draft's feed of the prompt's positions adds (random features; the
draft alone), with the causal mask left to the attention kernel and, for comparison, with a dense [L, L] mask built.
EOS is switched off so that every call runs its tokens.

    python dev/long_context.py --lengths 1024,8000 --out long_context.json

Prints the CPU flags first. Not a test: a measurement for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from hf_eagle3.environment import cpu_description

FEED_PROBE = """
import sys, threading, torch
import hf_eagle3
from hf_eagle3.core.draft_cache import Eagle3KVCache
from hf_eagle3.loading import load_draft
from hf_eagle3.smollm2 import load_smollm2
target, _ = load_smollm2()
draft, _, _ = load_draft(None, target)
draft.bind_target(target)
n, dense = int(sys.argv[1]), sys.argv[2] == "dense"
ids = torch.randint(0, draft.config.vocab_size, (1, n))
feats = torch.randn(1, n, draft.fc.weight.shape[1])
mask = torch.ones(n, n, dtype=torch.bool).tril() if dense else None
page = 4096
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
peak, done = [0], threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        done.wait(0.0005)
before = rss()
thread = threading.Thread(target=watch)
thread.start()
with torch.no_grad():
    draft(input_ids=ids, target_features=feats, cache=Eagle3KVCache(), logits_to_keep=1, attention_mask=mask)
done.set()
thread.join()
print((max(peak[0], rss()) - before) / 2**20)
"""


def long_prompt(tok, tokens: int) -> torch.LongTensor:
    """A chat prompt of about ``tokens`` tokens: a document of training prompts, then a question about it."""
    lines = [json.loads(x)["prompt"] for x in open("../shared/data/train_prompts.jsonl")]
    document, i = [], 0
    while len(tok("\n\n".join(document)).input_ids) < tokens - 64:
        document.append(lines[i % len(lines)])
        i += 1
    text = "\n\n".join(document) + "\n\nSummarise the requests above in a few sentences."
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    return ids[:, -tokens:] if ids.shape[1] > tokens else ids


def smollm2_and_draft():
    """SmolLM2 (EOS off, so that every call runs its tokens), its tokenizer and the shipped draft, the CPU printed."""
    import hf_eagle3  # noqa: F401  (installs the generate hook)
    from hf_eagle3.loading import load_draft
    from hf_eagle3.smollm2 import load_smollm2

    print(cpu_description(), flush=True)
    target, tok = load_smollm2()
    draft, _, _ = load_draft(None, target)
    target.generation_config.eos_token_id = None
    return target, tok, draft


def timed(target, ids, **kwargs) -> tuple[float, int]:
    """Seconds of one ``generate`` call and its target forwards (rounds)."""
    draft = kwargs.get("assistant_model")
    start = time.perf_counter()
    with torch.no_grad():
        target.generate(ids, do_sample=False, **kwargs)
    seconds = time.perf_counter() - start
    rounds = draft.last_stats.num_target_forwards if draft is not None else kwargs["max_new_tokens"]
    return seconds, rounds  # EOS is off: plain generate runs max_new_tokens forwards


def main() -> None:
    """Run the measurement and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,8000", help="prompt lengths in tokens (default 1024,8000)")
    parser.add_argument("--new-tokens", default="16,48", help="the two max_new_tokens (default 16,48)")
    parser.add_argument("--out", default="long_context.json")
    args = parser.parse_args()
    target, tok, draft = smollm2_and_draft()
    short, long = (int(x) for x in args.new_tokens.split(","))
    from hf_eagle3.core import target_cache

    tree = dict(tree_top_k=4, tree_depth=4, tree_total_tokens=8)
    strategies = {"plain": {}, "chain k=3": dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant"),
                  "tree 4x4x8": tree, "tree 4x4x8 on DynamicLayer": tree}
    preallocate = target_cache.preallocate
    report = {"cpu": cpu_description(), "torch_threads": torch.get_num_threads(), "new_tokens": [short, long],
              "rows": []}
    for length in (int(x) for x in args.lengths.split(",")):
        ids = long_prompt(tok, length)
        row = {"prompt_tokens": ids.shape[1]}
        for name, settings in strategies.items():
            kwargs = dict(settings, assistant_model=draft) if settings else {}
            target_cache.preallocate = (lambda cache, capacity: None) if "DynamicLayer" in name else preallocate
            timed(target, ids, max_new_tokens=4, **kwargs)  # warm-up
            s1, r1 = timed(target, ids, max_new_tokens=short, **kwargs)
            s2, r2 = timed(target, ids, max_new_tokens=long, **kwargs)
            target_cache.preallocate = preallocate
            row[name] = {"seconds_per_round": (s2 - s1) / max(r2 - r1, 1), "rounds": [r1, r2]}
            if settings:
                row[name]["acceptance_length"] = draft.last_stats.mean_acceptance_length
        for mode in ("kernel", "dense"):
            feed = subprocess.run([sys.executable, "-c", FEED_PROBE, str(ids.shape[1]), mode], capture_output=True,
                                  text=True)
            if feed.returncode != 0:
                raise RuntimeError(feed.stderr[-2000:])
            row[f"draft_feed_peak_mib_{mode}_mask"] = float(feed.stdout.strip().splitlines()[-1])
        report["rows"].append(row)
        plain = row["plain"]["seconds_per_round"]
        print(f"prompt {row['prompt_tokens']}: " + ", ".join(
            f"{n} {row[n]['seconds_per_round'] / plain:.2f}x a plain step" for n in strategies)
            + f"; draft feed peak +{row['draft_feed_peak_mib_kernel_mask']:.0f} MiB "
            f"(+{row['draft_feed_peak_mib_dense_mask']:.0f} MiB with a dense mask)", flush=True)
    first, last = report["rows"][0], report["rows"][-1]
    for name in strategies:
        growth = last[name]["seconds_per_round"] / first[name]["seconds_per_round"]
        print(f"{name}: a round at {last['prompt_tokens']} tokens costs {growth:.2f}x one at {first['prompt_tokens']}")
    json.dump(report, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
