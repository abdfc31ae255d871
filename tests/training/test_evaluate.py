"""`hf-eagle3 evaluate`: a draft scored on cached features (per-step accuracy, replayed chain acceptance), on
held-out shards or on every shard of a directory that holds nothing else (answers to one's own prompts)."""

import json

import pytest
import torch
from conftest import tiny_records, tiny_target

from hf_eagle3.training.cli import main
from hf_eagle3.training.features import cache_features
from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, evaluate, init_draft, train
from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens


def _features_and_draft(tmp_path, layer_ids=(2, 3, 3)):
    """Two feature shards of a tiny target's greedy answers, and a (new) draft for them saved to disk."""
    target = tiny_target("llama")
    records = tiny_records(target, n=8, prompt=6, new=16)
    feats = tmp_path / "features"
    cache_features(target, records, feats, list(layer_ids), per_shard=4, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)
    draft = init_draft(draft_config_for_target(head["config"], 64, intermediate_size=96, feature_layer_ids=list(layer_ids)),
                       head, d2t, t2d)
    torch.manual_seed(3)  # a draft that is not the identity start, so that accuracy and acceptance vary by shard
    with torch.no_grad():
        for p in draft.midlayer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    draft.save_pretrained(tmp_path / "draft")
    return feats, draft


def test_evaluate_cli_reports_what_evaluate_measures_on_held_out_or_all_shards(tmp_path, capsys):
    feats, draft = _features_and_draft(tmp_path)
    shards = sorted(feats.glob("shard-*.pt"))
    assert len(shards) == 2
    out = tmp_path / "all.json"
    main(["evaluate", "--draft", str(tmp_path / "draft"), "--features-dir", str(feats), "--shards", "all",
          "--k", "3", "--ttt-length", "2", "--json-out", str(out)])
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())
    want = evaluate(draft, feats, shards=shards, ttt_length=2, chain_length=3)
    assert got["acc"] == pytest.approx(want["acc"]) and len(got["acc"]) == 2
    assert got["chain"]["k"] == 3 and got["chain"]["num_drafts"] == want["chain"]["num_drafts"] > 0
    assert got["chain"]["mean_acceptance_length"] == pytest.approx(want["chain"]["mean_acceptance_length"])
    assert f"mean acceptance length {want['chain']['mean_acceptance_length']:.3f}" in printed
    assert "all per-step accuracy" in printed
    # the default scores the first (held-out) shard only: another count of rounds than all of them
    first = tmp_path / "first.json"
    main(["evaluate", "--draft", str(tmp_path / "draft"), "--features-dir", str(feats), "--k", "3", "--json-out",
          str(first)])
    one = json.loads(first.read_text())
    assert one["chain"]["num_drafts"] == evaluate(draft, feats, shards=shards[:1], chain_length=3)["chain"]["num_drafts"]
    assert one["chain"]["num_drafts"] < got["chain"]["num_drafts"]
    # every shard held out (a directory of evaluation answers only) is evaluated, not refused as "no shards"
    every = evaluate(draft, feats, holdout_shards=2, ttt_length=2, chain_length=3)
    assert every["chain"]["num_drafts"] == got["chain"]["num_drafts"]


def test_evaluate_refuses_what_it_cannot_score_with_the_fix_named(tmp_path):
    feats, draft = _features_and_draft(tmp_path, layer_ids=(1, 2, 4))
    missing_dir = tmp_path / "nowhere" / "out.json"
    with pytest.raises(SystemExit, match="--shards holdout needs --holdout-shards >= 1"):
        main(["evaluate", "--draft", str(tmp_path / "draft"), "--features-dir", str(feats), "--holdout-shards", "0"])
    with pytest.raises(SystemExit, match="its directory does not exist"):
        main(["evaluate", "--draft", str(tmp_path / "draft"), "--features-dir", str(feats), "--json-out",
              str(missing_dir)])
    assert not missing_dir.parent.exists()
    with pytest.raises(SystemExit, match="no target_head.pt"):
        main(["evaluate", "--draft", str(tmp_path / "draft"), "--features-dir", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="must be at least 1"):
        main(["evaluate", "--draft", str(tmp_path / "draft"), "--features-dir", str(feats), "--k", "0"])
    # a draft for other target layers: refused by name, not scored on the wrong features
    other = tmp_path / "other"
    head = torch.load(feats / "target_head.pt", weights_only=False)
    wrong = init_draft(draft_config_for_target(head["config"], 64, feature_layer_ids=[2, 3, 3]), head, draft.d2t,
                       draft.t2d)
    wrong.save_pretrained(other)
    with pytest.raises(SystemExit, match=r"captured at target layers \[1, 2, 4\] but the draft reads layers \[2, 3, 3\]"):
        main(["evaluate", "--draft", str(other), "--features-dir", str(feats)])
    # the API: nothing to score is an error, and the draft is left as it was (no embedding bound to it)
    with pytest.raises(ValueError, match="holdout_shards is 0 and no shards were given"):
        evaluate(draft, feats, holdout_shards=0)
    assert getattr(draft, "_target_embedding", None) is None


def test_training_refuses_features_that_are_all_held_out_before_writing(tmp_path):
    feats, draft = _features_and_draft(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"all 2 feature shard\(s\) .* are held out .* Lower --holdout-shards"):
        train(draft, feats, run, TrainConfig(max_steps=1, batch_tokens=256, mixed_precision="no", holdout_shards=2),
              log=lambda s: None)
    assert not run.exists()
