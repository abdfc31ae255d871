"""hf-eagle3's side of the OpenVINO GenAI interop test (run in an environment with hf-eagle3, not OpenVINO's).

Decodes the built-in prompts with SmolLM2-135M-Instruct and the shipped draft (greedy, fp32, a constant draft length),
checks each output against the target alone, and writes one JSON object: the target's directory, and per prompt the
prompt token ids, the output token ids and the accepted draft tokens.

Usage: python tests/interop/openvino_reference.py OUT_JSON [--prompts N] [--max-new-tokens M] [--k K]
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_eagle3
from hf_eagle3.loading import encode_prompt, load_prompts, shipped_draft_path
from hf_eagle3.smollm2 import load_smollm2, smollm2_path


def main() -> None:
    """Write the reference JSON (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    target, tokenizer = load_smollm2(dtype=torch.float32)
    draft = hf_eagle3.Eagle3DraftModel.from_pretrained(shipped_draft_path())
    rows = []
    for text in load_prompts(None, args.prompts):
        input_ids = encode_prompt(tokenizer, text)
        out = target.generate(input_ids, assistant_model=draft, max_new_tokens=args.max_new_tokens, do_sample=False,
                              num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant")
        plain = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        if not torch.equal(out, plain):
            raise SystemExit("hf-eagle3's output differs from the target alone")
        rows.append({"prompt_ids": input_ids[0].tolist(), "output_ids": out[0, input_ids.shape[1]:].tolist(),
                     "accepted": draft.last_stats.num_accepted_tokens})
    with open(args.out, "w") as f:
        json.dump({"target": str(smollm2_path()), "k": args.k, "max_new_tokens": args.max_new_tokens, "rows": rows}, f)


if __name__ == "__main__":
    main()
