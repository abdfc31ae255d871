"""The trainer (:mod:`hf_eagle3.training.trainer`) and ``hf-eagle3 train``: batches that count response tokens in the
draft vocabulary, a few steps that reduce the loss and resume, drafts that do not fit the features refused before any
work, the vocabulary counted over all the data, seeds, and the checkpoint chosen on held-out shards."""

from __future__ import annotations


import pytest
import torch
from conftest import tiny_draft, tiny_records, tiny_target

import hf_eagle3
from hf_eagle3.training.features import cache_features, collate
from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, evaluate, init_draft, train
from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens


def test_train_cli_refuses_a_non_positive_target_temperature_before_any_work(tmp_path):
    from hf_eagle3.training.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="--target-temperature -1.0: give a temperature > 0"):
        main(["train", "--data", str(tmp_path / "missing"), "--out", str(out), "--target-temperature", "-1"])
    assert not out.exists()  # refused before the data is read or anything is written


def test_collate_mask_counts_response_tokens_in_draft_vocab():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 3]] = True
    item = {
        "input_ids": torch.tensor([5, 6, 1, 2, 9]),
        "features": torch.zeros(5, 6),
        "last_hidden": torch.zeros(5, 2),
        "target_argmax": torch.tensor([1, 1, 2, 9, 3]),
        "prompt_len": 2,
    }
    batch = collate([item], t2d, torch.zeros(3, 2))
    # position i counts if token i+1 is a response token (i+1 >= 2), i+1 exists, and the target argmax at i is drafted
    assert batch["loss_mask"][0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    # prompt positions (predicting token 1 here) count with prompt_loss_weight when asked for
    weighted = collate([item], t2d, torch.zeros(3, 2), prompt_loss_weight=0.5)
    assert weighted["loss_mask"][0].tolist() == [0.5, 1.0, 1.0, 0.0, 0.0]


def _responses_dir(path, records):
    """Write ``records`` where ``train --data`` reads them (``path/responses-00000.jsonl``) and return ``path``."""
    import json

    path.mkdir()
    with open(path / "responses-00000.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def test_a_few_training_steps_reduce_the_loss_and_checkpoint_resumes(tmp_path):
    target = tiny_target("llama")
    with torch.no_grad():  # a peaked target distribution, so that a draft can learn something within a few steps
        target.lm_head.weight.mul_(8)
    records = tiny_records(target)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [2, 3, 3], per_shard=8, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 128, 256)
    draft = init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)
    shards = sorted(feats.glob("shard-*.pt"))
    before = evaluate(draft, feats, shards=shards[:2], ttt_length=3)
    # vocabulary coverage, against the target's own argmax, for a small vocabulary built from a few answers
    small_d2t, small_t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records[:3]), 32, 256)
    small = init_draft(draft_config_for_target(head["config"], 32, intermediate_size=96), head, small_d2t, small_t2d)
    with torch.no_grad():
        argmax = [target(torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0].argmax(-1)
                  [len(r["prompt_ids"]) - 1 : -1] for r in records]
    expected = float(torch.cat([small_t2d.bool()[a] for a in argmax]).float().mean())
    coverage = evaluate(small, feats, shards=shards, ttt_length=1, chain_length=0)["vocab_coverage"]
    assert 0.0 < expected < 1.0 and coverage == pytest.approx(expected)
    assert evaluate(draft, feats, shards=shards, ttt_length=1, chain_length=0)["vocab_coverage"] == 1.0  # greedy answers
    cfg = TrainConfig(lr=3e-3, epochs=4, batch_tokens=256, warmup_steps=2, ttt_length=3, log_every=1,
                      save_every=1000, mixed_precision="no", holdout_shards=1)
    draft = train(draft, feats, tmp_path / "run", cfg, log=lambda s: None)
    after = evaluate(draft, feats, shards=shards[:2], ttt_length=3)
    assert sum(after["loss"]) < 0.9 * sum(before["loss"])
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert state["epoch"] == 4 and state["step"] > 0
    # a rerun resumes at the end instead of starting over: nothing more is trained
    again = init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)
    again = train(again, feats, tmp_path / "run", cfg, log=lambda s: None)
    for a, b in zip(draft.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(a, b)
    # the trained draft decodes losslessly
    ids = torch.tensor([records[0]["prompt_ids"]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, assistant_model=again.float(), max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)


def test_a_draft_that_does_not_match_the_features_is_refused_before_any_work(tmp_path):
    """Other layer ids (would train silently, then read the wrong layers at inference), another target's sizes,
    and a missing features directory: a clear error, and no output directory left behind."""
    from hf_eagle3.training.cli import main
    from hf_eagle3.training.trainer import check_draft_matches_features

    target = tiny_target("llama")
    records = tiny_records(target, n=4, new=8)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [1, 2, 4], per_shard=2, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)
    cfg = TrainConfig(max_steps=1, batch_tokens=256, mixed_precision="no")

    default_ids = init_draft(draft_config_for_target(head["config"], 64), head, d2t, t2d)  # reads [2, 3, 3]
    with pytest.raises(ValueError, match=r"captured at target layers \[1, 2, 4\] but the draft reads layers \[2, 3, 3\]") as err:
        train(default_ids, feats, tmp_path / "run", cfg, log=lambda s: None)
    assert "feature_layer_ids" in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="captured at target layers"):
        evaluate(default_ids, feats)

    wide = tiny_target("llama", hidden_size=32, num_attention_heads=4)
    other = tiny_draft(wide, hidden_size=32, feature_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match="target hidden size 64 != draft target_hidden_size 32"):
        check_draft_matches_features(other, feats)
    matching = init_draft(draft_config_for_target(head["config"], 64, feature_layer_ids=[1, 2, 4]), head, d2t, t2d)
    check_draft_matches_features(matching, feats)  # no error
    with pytest.raises(FileNotFoundError, match="no target_head.pt"):
        check_draft_matches_features(matching, tmp_path / "nothing")

    # the CLI: --init-draft with a draft for other layers is refused before vocab.pt or a run directory is written
    data = _responses_dir(tmp_path / "data", records)
    default_ids.save_pretrained(tmp_path / "init")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="captured at target layers"):
        main(["train", "--data", str(data), "--out", str(out), "--skip-features", "--features-dir", str(feats),
              "--init-draft", str(tmp_path / "init"), "--max-steps", "1", "--mixed-precision", "no"])
    assert not (out / "vocab.pt").exists() and not (out / "run").exists()
    # without --init-draft the new draft reads the layers the features were captured at
    main(["train", "--data", str(data), "--out", str(out), "--skip-features", "--features-dir", str(feats),
          "--draft-vocab-size", "64", "--max-steps", "1", "--batch-tokens", "256", "--mixed-precision", "no",
          "--holdout-shards", "1"])
    assert hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft").config.feature_layer_ids == [1, 2, 4]


def test_train_cli_end_to_end_and_exports_reload(tmp_path):
    """`hf-eagle3 train`: vocab -> features -> TTT -> save; flat and speculators exports reload identically."""
    import json

    from hf_eagle3.training.cli import main

    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = _responses_dir(tmp_path / "data", tiny_records(target, n=12, new=16))
    out = tmp_path / "out"
    main(["train", "--target", str(tmp_path / "target"), "--data", str(data), "--out", str(out),
          "--draft-vocab-size", "64", "--per-shard", "4", "--max-steps", "3", "--batch-tokens", "256",
          "--mixed-precision", "no", "--save-dtype", "float32", "--export-flat", "--export-speculators",
          "--feature-dtype", "float32"])
    native = hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft")
    assert native.config.draft_vocab_size == 64 and native.config.feature_layer_ids == [2, 3, 3]
    summary = json.loads((out / "draft" / "training_summary.json").read_text())
    assert summary["records"] == 12 and len(summary["holdout"]["acc"]) == 7
    chain = summary["holdout"]["chain"]  # the held-out greedy answers replayed as chain decoding (5 tokens a round)
    assert chain["k"] == 5 and chain["num_drafts"] > 0 and len(chain["drafted_per_position"]) == 5
    assert chain["mean_acceptance_length"] == 1 + sum(chain["accepted_per_position"]) / chain["num_drafts"]
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    ref = target.generate(ids, assistant_model=native, max_new_tokens=12, do_sample=False)
    feats = torch.randn(1, 6, 3 * 64)
    native.bind_target(target)
    expected = native(input_ids=ids, target_features=feats).logits
    for layout in ("export-flat", "export-speculators"):
        other = hf_eagle3.Eagle3DraftModel.from_pretrained(out / layout)
        assert other.config.feature_layer_ids == [2, 3, 3]
        other.bind_target(target)
        torch.testing.assert_close(other(input_ids=ids, target_features=feats).logits, expected)
        assert torch.equal(target.generate(ids, assistant_model=other, max_new_tokens=12, do_sample=False), ref)
    # Continue from it with a vocabulary rebuilt (and grown) from the data: the CLI path of --rebuild-vocab.
    main(["train", "--target", str(tmp_path / "target"), "--data", str(data), "--out", str(tmp_path / "again"),
          "--features-dir", str(out / "features"), "--skip-features", "--init-draft", str(out / "draft"),
          "--rebuild-vocab", "--vocab-data", str(data), "--draft-vocab-size", "80", "--max-steps", "2",
          "--batch-tokens", "256", "--mixed-precision", "no", "--save-dtype", "float32"])
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "again" / "draft")
    assert again.config.draft_vocab_size == 80 and again.lm_head.out_features == 80
    assert torch.equal(target.generate(ids, assistant_model=again, max_new_tokens=12, do_sample=False), ref)


def test_train_vocabulary_counts_all_of_data_when_max_records_cuts_the_feature_pass(tmp_path):
    """``train --max-records N`` caches features for the first N records only; the draft vocabulary (new, or rebuilt
    with ``--rebuild-vocab``) still counts the answers of every record of ``--data``, so a token that only the later
    records use is in it."""
    from hf_eagle3.training.cli import main

    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt_ids": torch.randint(4, 256, (6,), generator=g).tolist(),
                "response_ids": (torch.randint(4, 40, (12,), generator=g).tolist() if i < 2 else [200, 201] * 6)}
               for i in range(8)]
    data = _responses_dir(tmp_path / "data", records)
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--max-records", "2", "--per-shard", "1",
              "--max-steps", "1", "--batch-tokens", "64", "--mixed-precision", "no", "--save-dtype", "float32",
              "--feature-dtype", "float32"]
    main(["train", *common, "--out", str(tmp_path / "new"), "--draft-vocab-size", "16"])
    d2t, _ = torch.load(tmp_path / "new" / "vocab.pt")
    used = (torch.arange(16) + d2t).tolist()
    assert 200 in used and 201 in used  # only records 3..8 hold them: counted although they have no features
    assert len(list((tmp_path / "new" / "features").glob("shard-*.pt"))) == 2  # the feature pass took 2 records
    first = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "new" / "draft")
    with torch.no_grad():  # a draft whose vocabulary lacks them, rebuilt from --data alone (no --vocab-data)
        first.d2t.zero_()
    first.save_pretrained(tmp_path / "narrow")
    assert 200 not in (torch.arange(16) + hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "narrow").d2t).tolist()
    main(["train", *common, "--out", str(tmp_path / "again"), "--features-dir", str(tmp_path / "new" / "features"),
          "--skip-features", "--init-draft", str(tmp_path / "narrow"), "--rebuild-vocab", "--draft-vocab-size", "16"])
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "again" / "draft")
    assert {200, 201} <= set((torch.arange(16) + again.d2t).tolist())


def test_train_seed_orders_the_shards_and_reaches_the_trainer(tmp_path, monkeypatch):
    """``train --seed`` changes the order in which shards are read (so that a run continuing a draft for part of a
    pass can start with other shards than the last run), the same seed gives the same order, and the CLI hands the
    seed to the trainer."""
    from hf_eagle3.training import trainer as trainer_module
    from hf_eagle3.training.cli import main
    from hf_eagle3.training.features import FeatureShards

    target = tiny_target("llama")
    records = tiny_records(target, n=6, new=8)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [1, 2, 4], per_shard=1, dtype=torch.float32, progress=False)

    def order(seed):
        return [path.name for path, _, _ in FeatureShards(feats, 256, seed=seed).batches(0)]

    assert len(order(0)) == 6 and order(0) == order(0)
    assert any(order(seed) != order(0) for seed in range(1, 6))

    data = _responses_dir(tmp_path / "data", records)
    seen = []

    class Stop(Exception):
        pass

    def fake_train(draft, features_dir, run_dir, cfg, **kw):
        seen.append(cfg.seed)
        raise Stop

    monkeypatch.setattr(trainer_module, "train", fake_train)
    with pytest.raises(Stop):
        main(["train", "--data", str(data), "--out", str(tmp_path / "out"), "--skip-features", "--features-dir",
              str(feats), "--draft-vocab-size", "64", "--seed", "7", "--mixed-precision", "no"])
    assert seen == [7]


def test_train_returns_the_checkpoint_best_on_the_held_out_shards(tmp_path, monkeypatch):
    """select_by="holdout": every checkpoint is scored by the replayed chain acceptance on the held-out shards, the
    log says each score, and the weights returned are the best checkpoint's (here an early one, forced by a scorer
    that prefers early steps), equal to a run stopped at that step; "last" returns the last weights."""
    import json

    from hf_eagle3.training import trainer as trainer_module

    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    records = tiny_records(target, n=16)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [2, 3, 3], per_shard=4, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 128, 256)

    def new_draft():
        torch.manual_seed(0)
        return init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)

    def cfg(**kw):
        return TrainConfig(**{**dict(lr=3e-3, epochs=3, batch_tokens=128, warmup_steps=2, ttt_length=2, log_every=1,
                                     save_every=2, mixed_precision="no", holdout_shards=1, select_chain_length=3),
                              **kw})

    lines = []
    honest = train(new_draft(), feats, tmp_path / "honest", cfg(), log=lines.append)
    scores = [json.loads(line) for line in (tmp_path / "honest" / "log.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["holdout_acceptance_length"] for r in scores if "holdout_acceptance_length" in r}
    assert len(scores) >= 3 and 2 in scores and 4 in scores
    selection = json.loads((tmp_path / "honest" / "selection.json").read_text())
    assert selection["selected_score"] == pytest.approx(max(scores.values()), abs=1e-4)
    assert lines[-1].startswith(f"selected the checkpoint of step {selection['selected_step']}")
    replayed = evaluate(honest, feats, ttt_length=1, holdout_shards=1, chain_length=3, batch_tokens=128)
    assert replayed["chain"]["mean_acceptance_length"] == pytest.approx(selection["selected_score"], abs=1e-4)

    calls = []

    class Early:  # a scorer that prefers early checkpoints: the first one scored (step 2) wins
        def __init__(self, *args):
            calls.append(args)
            self.mean_acceptance_length = 10.0 - len(calls)

    monkeypatch.setattr(trainer_module, "replay_chain_acceptance", Early)
    early = train(new_draft(), feats, tmp_path / "early", cfg(), log=lambda s: None)
    monkeypatch.undo()
    assert json.loads((tmp_path / "early" / "selection.json").read_text())["selected_step"] == 2
    stopped = train(new_draft(), feats, tmp_path / "stopped", cfg(max_steps=2, select_by="last"), log=lambda s: None)
    last = train(new_draft(), feats, tmp_path / "last", cfg(select_by="last"), log=lambda s: None)
    assert not (tmp_path / "last" / "best.pt").exists()
    for a, b, c in zip(early.state_dict().values(), stopped.state_dict().values(), last.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(early.state_dict().values(), last.state_dict().values()))
    with pytest.raises(ValueError, match="holdout_shards >= 1"):
        train(new_draft(), feats, tmp_path / "none", cfg(holdout_shards=0), log=lambda s: None)
    assert not (tmp_path / "none").exists()
