"""``train --seed``: torch is seeded before the draft's new layers are built, so two runs with one seed give the same
draft, weight for weight, and two seeds give two drafts."""

from __future__ import annotations

import json

import torch
from conftest import tiny_records, tiny_target

import hf_eagle3
from hf_eagle3.training.cli import main
from hf_eagle3.training.features import cache_features


def test_one_seed_gives_one_draft_and_two_seeds_two(tmp_path):
    target = tiny_target("llama")
    records = tiny_records(target, n=8, new=10)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "responses-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cache_features(target, records, tmp_path / "features", [2, 3, 3], per_shard=2, dtype=torch.float32,
                   progress=False)

    def run(name: str, seed: int) -> dict:
        torch.manual_seed(1000 + len(name))  # whatever state torch was left in must not matter
        main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / name), "--features-dir",
              str(tmp_path / "features"), "--skip-features", "--draft-vocab-size", "64", "--max-steps", "2",
              "--batch-tokens", "128", "--holdout-shards", "0", "--mixed-precision", "no", "--save-dtype", "float32",
              "--seed", str(seed)])
        return hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / name / "draft").state_dict()

    first, second, other = run("a", 0), run("bb", 0), run("ccc", 1)
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), f"{name}: max difference {(tensor - second[name]).abs().max()}"
    assert any(not torch.equal(tensor, other[name]) for name, tensor in first.items())
