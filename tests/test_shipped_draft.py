"""The shipped SmolLM2-135M-Instruct draft: lossless, and an acceptance floor on a few MT-bench prompts."""

import json
from pathlib import Path

import pytest
import torch

import hf_eagle3

ROOT = Path(__file__).resolve().parents[1]
DRAFT = ROOT / "examples" / "drafts" / "smollm2-135m-eagle3"
MT_BENCH = ROOT.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"

# These 3 prompts x 48 tokens gave a mean acceptance length of 1.35 when the draft was shipped (1.41 on MT-bench turn 1,
# see the draft's README.md); a random draft gives 1.00. The floor guards that the shipped weights really draft.
ACCEPTANCE_FLOOR = 1.2


def _prompts(n):
    if MT_BENCH.exists():
        rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
        return [r["turns"][0] for r in rows[:n]]
    return [  # the same kind of prompts when the benchmark file is not beside the checkout
        "Compose an engaging travel blog post about a recent trip to Hawaii.",
        "Explain the difference between a list and a tuple in Python.",
        "Write a short story about a robot learning to paint.",
    ][:n]


@pytest.mark.slow
def test_shipped_draft_is_lossless_and_accepts(smollm2):
    target, tok = smollm2
    assert (DRAFT / "config.json").exists(), "the trained draft must be committed under examples/drafts/"
    draft = hf_eagle3.Eagle3DraftModel.from_pretrained(DRAFT, dtype=torch.float32)
    assert draft.config.vocab_size == target.config.vocab_size
    total = None
    for prompt in _prompts(3):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ref = target.generate(ids, max_new_tokens=48, do_sample=False)
        out = target.generate(ids, assistant_model=draft, max_new_tokens=48, do_sample=False, num_assistant_tokens=5)
        assert torch.equal(out, ref)
        total = draft.last_stats if total is None else total + draft.last_stats
    assert total.mean_acceptance_length >= ACCEPTANCE_FLOOR, total.report()
