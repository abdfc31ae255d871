"""Training a draft on more than three target layers (``hf-eagle3 train --feature-layers N``): the feature pass
captures them, the new draft's ``fc`` fuses them (initialised to pass the highest through), features of other layers
are refused before anything is overwritten, and the command line refuses what cannot apply."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import tiny_target

FIVE = [0, 1, 1, 2, 3]


def _records():
    g = torch.Generator().manual_seed(0)
    return [{"id": str(i), "prompt_ids": torch.randint(4, 256, (6,), generator=g).tolist(),
             "response_ids": torch.randint(4, 256, (10,), generator=g).tolist()} for i in range(4)]


def test_a_draft_on_five_layers_trains(tmp_path):
    from hf_eagle3.training.features import cache_features
    from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, init_draft, train
    from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens

    target, records = tiny_target("llama"), _records()
    features = tmp_path / "features"
    cache_features(target, records, features, FIVE, per_shard=2, dtype=torch.float32, progress=False)
    shard = torch.load(next(features.glob("shard-*.pt")), weights_only=False)
    width = target.config.hidden_size
    assert all(item["features"].shape[-1] == 5 * width for item in shard)  # five hidden states a position
    head = torch.load(features / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)
    torch.manual_seed(0)
    draft = init_draft(draft_config_for_target(head["config"], 64, feature_layer_ids=FIVE, intermediate_size=96),
                       head, d2t, t2d)
    assert draft.fc.in_features == 5 * width
    assert torch.equal(draft.fc.weight[:, 4 * width:], torch.eye(width))  # the highest layer passed through
    before = draft.fc.weight.detach().clone()
    cfg = TrainConfig(ttt_length=2, batch_tokens=4096, mixed_precision="no", save_every=1000, warmup_steps=1,
                      epochs=4, log_every=1, select_by="last", max_steps=2)
    trained = train(draft, features, tmp_path / "run", cfg, log=lambda line: None)
    assert not torch.equal(trained.fc.weight.detach(), before)
    with pytest.raises(ValueError, match=r"holds features of target layers \[0, 1, 1, 2, 3\]"):
        cache_features(target, records, features, [1, 2, 3], per_shard=2, dtype=torch.float32, progress=False)


def test_the_command_line_refuses_what_cannot_apply():
    from hf_eagle3.training.cli import _check_train_options
    from hf_eagle3.training.parsers import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    base = ["train", "--data", "d", "--out", "o"]
    assert parser.parse_args(base + ["--feature-layers", "5"]).feature_layers == 5
    assert parser.parse_args(base).feature_layers is None
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--feature-layers", "2"])
    with pytest.raises(SystemExit, match="--feature-layers 5 sets the layers of a new draft"):
        _check_train_options(parser.parse_args(base + ["--feature-layers", "5", "--init-draft", "x"]))
