"""Held-out sets from another features directory (``--holdout-features``) and early stopping on held-out acceptance
(``--stop-gain`` / ``--stop-window``): checkpoints scored on answers the draft never trained on, a run that ends when
a window of training adds too little, a rerun that trains nothing after it, and refusals before any work."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_records, tiny_target

from hf_eagle3.training.features import cache_features
from hf_eagle3.training.trainer import (
    TrainConfig,
    draft_config_for_target,
    evaluate,
    init_draft,
    train,
)
from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Training features (16 records, 4 a shard) and a held-out features directory of 8 other records, both of the
    tiny llama target (its head sharpened, so that a trained draft accepts something)."""
    root = tmp_path_factory.mktemp("early")
    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    records = tiny_records(target, n=16)
    unseen = tiny_records(target, n=8, seed=1)
    cache_features(target, records, root / "train", [2, 3, 3], per_shard=4, dtype=torch.float32, progress=False)
    cache_features(target, unseen, root / "unseen", [2, 3, 3], per_shard=4, dtype=torch.float32, progress=False)
    head = torch.load(root / "train" / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 128, 256)
    return root, head, d2t, t2d


def new_draft(data):
    """The same fresh draft each call."""
    _, head, d2t, t2d = data
    torch.manual_seed(0)
    return init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)


def cfg(**kw):
    """Small, fast settings, checkpoints every 2 steps."""
    return TrainConfig(**{**dict(lr=3e-3, epochs=3, batch_tokens=128, warmup_steps=2, ttt_length=2, log_every=1,
                                 save_every=2, mixed_precision="no", holdout_shards=1, select_chain_length=3), **kw})


def logged_scores(run) -> dict:
    """step -> held-out score, from a run's log."""
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "holdout_acceptance_length" in r}


def test_checkpoints_are_scored_on_the_holdout_features(data, tmp_path):
    """With holdout_features, every checkpoint is scored on that directory's shards (all of them), and the draft
    returned is the best of those scores, which `evaluate` on that directory reproduces; the training features'
    own held-out shard would give other scores."""
    root = data[0]
    run = tmp_path / "run"
    lines = []
    draft = train(new_draft(data), root / "train", run, cfg(holdout_shards=0, holdout_features=str(root / "unseen")),
                  log=lines.append)
    scores = logged_scores(run)
    assert len(scores) >= 3 and all("training_minutes" in r for r in scores.values())
    selection = json.loads((run / "selection.json").read_text())
    assert selection["selected_score"] == pytest.approx(max(r["holdout_acceptance_length"] for r in scores.values()),
                                                        abs=1e-4)
    on_unseen = evaluate(draft, root / "unseen", shards="all", ttt_length=1, chain_length=3, batch_tokens=128)
    assert on_unseen["chain"]["mean_acceptance_length"] == pytest.approx(selection["selected_score"], abs=1e-4)
    on_shard0 = evaluate(draft, root / "train", ttt_length=1, holdout_shards=1, chain_length=3, batch_tokens=128)
    assert on_shard0["chain"]["mean_acceptance_length"] != pytest.approx(selection["selected_score"], abs=1e-4)


def test_holdout_features_of_another_target_are_refused_before_any_work(data, tmp_path):
    """A held-out directory written by another target of the same shapes is refused, naming the fix, before the run
    directory exists."""
    other = tiny_target("llama", seed=5)
    cache_features(other, tiny_records(other, n=4), tmp_path / "other", [2, 3, 3], per_shard=4, dtype=torch.float32,
                   progress=False)
    with pytest.raises(ValueError, match="another target"):
        train(new_draft(data), data[0] / "train", tmp_path / "run", cfg(holdout_features=str(tmp_path / "other")),
              log=lambda s: None)
    assert not (tmp_path / "run").exists()


def scripted_scores(monkeypatch, scores):
    """Replace the held-out scorer by one that returns ``scores`` in turn (then the last one), and the training clock
    by one minute a step, so that early stopping's decisions are known in advance."""
    from hf_eagle3.training import trainer as trainer_module

    calls = []

    class Scripted:
        def __init__(self, *args):
            calls.append(args)
            self.mean_acceptance_length = scores[min(len(calls), len(scores)) - 1]

    monkeypatch.setattr(trainer_module, "replay_chain_acceptance", Scripted)
    monkeypatch.setattr(trainer_module._TrainingRun, "elapsed", lambda self: 60.0 * (self.step + 1))
    return calls


def test_early_stopping_ends_the_run_when_a_window_adds_too_little(data, tmp_path, monkeypatch):
    """Scores 1.0 (the start), 1.5 (step 2), 1.6 (4), 1.61 (6), 1.62 (8), one minute a step, --stop-gain 0.05 over
    3 minutes: step 4 gains 0.6 over the start, step 6 0.11 over step 2, step 8 only 0.02 over step 4, so the run
    ends at step 8 and returns the best checkpoint. Without early stopping the same run trains on (the control). A
    rerun trains nothing and says why; with --stop-gain 0 it trains further."""
    root = data[0]
    early = cfg(epochs=20, batch_tokens=40, stop_gain=0.05, stop_window=3.0)  # a record a batch: 12 steps an epoch
    scripted_scores(monkeypatch, [1.0, 1.5, 1.6, 1.61, 1.62] + [1.62 + 0.001 * i for i in range(1, 200)])
    lines = []
    train(new_draft(data), root / "train", tmp_path / "early", early, log=lines.append)
    scores = logged_scores(tmp_path / "early")
    assert sorted(scores) == [0, 2, 4, 6, 8]
    assert scores[0]["training_minutes"] == 0 and scores[8]["training_minutes"] == 8
    ended = [line for line in lines if line.startswith("training ended: ")]
    assert ended == [("training ended: early stop: the last 3 minutes of training added +0.020 held-out acceptance "
                      "length (best 1.620), less than --stop-gain 0.05")]
    assert json.loads((tmp_path / "early" / "selection.json").read_text())["selected_step"] == 8
    state = torch.load(tmp_path / "early" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 8  # the verdict is the logged scores': a rerun reaches it again (below)

    lines = []
    train(new_draft(data), root / "train", tmp_path / "early", early, log=lines.append)
    assert any("holds a finished run (early stop" in line and "--stop-gain 0" in line for line in lines)
    assert max(logged_scores(tmp_path / "early")) == 8

    scripted_scores(monkeypatch, [1.0, 1.5, 1.6, 1.61, 1.62] + [1.62 + 0.001 * i for i in range(1, 200)])
    control = cfg(epochs=20, batch_tokens=40, max_steps=16)
    train(new_draft(data), root / "train", tmp_path / "control", control, log=lambda s: None)
    assert max(logged_scores(tmp_path / "control")) == 16  # no early stop: it reaches --max-steps

    train(new_draft(data), root / "train", tmp_path / "early", cfg(epochs=20, batch_tokens=40, max_steps=12),
          log=lambda s: None)
    assert max(logged_scores(tmp_path / "early")) == 12  # early stopping off: the stopped run continues


def test_early_stopping_reads_scores_of_a_resumed_run(data, tmp_path, monkeypatch):
    """A run stopped by --max-steps and resumed keeps its earlier scores with their minutes: the window reaches back
    into the first part (the stop comes at the step it comes at without the interruption)."""
    root = data[0]
    scores = [1.0, 1.5, 1.6, 1.61, 1.62] + [1.62 + 0.001 * i for i in range(1, 200)]
    scripted_scores(monkeypatch, scores)
    train(new_draft(data), root / "train", tmp_path / "run", cfg(epochs=20, batch_tokens=40, max_steps=6,
                                                                  stop_gain=0.05, stop_window=3.0), log=lambda s: None)
    assert sorted(logged_scores(tmp_path / "run")) == [0, 2, 4, 6]
    scripted_scores(monkeypatch, scores[4:])  # the scorer goes on where it was
    lines = []
    train(new_draft(data), root / "train", tmp_path / "run", cfg(epochs=20, batch_tokens=40, max_steps=40,
                                                                  stop_gain=0.05, stop_window=3.0), log=lines.append)
    assert sorted(logged_scores(tmp_path / "run")) == [0, 2, 4, 6, 8]
    assert any(line.startswith("training ended: early stop") for line in lines)


@pytest.mark.parametrize("settings, message", [
    (dict(stop_gain=0.03), "needs both > 0"),
    (dict(stop_window=60.0), "needs both > 0"),
    (dict(stop_gain=-0.1, stop_window=-1.0), "needs both > 0"),
    (dict(stop_gain=0.03, stop_window=60.0, select_by="last"), "select_by='last' does not compute"),
    (dict(holdout_shards=0), "holdout_shards >= 1"),
])
def test_early_stopping_settings_it_cannot_honour_are_refused(data, tmp_path, settings, message):
    """Half an early-stopping setting, a negative one, one without held-out scores, or a selection without a held-out
    set: refused before the run directory exists."""
    with pytest.raises(ValueError, match=message):
        train(new_draft(data), data[0] / "train", tmp_path / "run", cfg(**settings), log=lambda s: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("options, message", [
    (["--stop-gain", "0.03"], "needs both > 0"),
    (["--stop-gain", "0.03", "--stop-window", "60", "--select-by", "last"], "--select-by last does not compute"),
    (["--holdout-features", "nowhere"], "holds no features"),
    (["--holdout-shards", "0", "--select-by", "holdout"], "--holdout-features DIR"),
])
def test_train_cli_refuses_early_stopping_it_cannot_honour_before_any_work(tmp_path, options, message):
    """The CLI says what to change before it reads a record."""
    from hf_eagle3.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["train", "--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "out"), *options])
    assert not (tmp_path / "out").exists()


def test_train_cli_continues_a_draft_scored_on_holdout_features(data, tmp_path):
    """`hf-eagle3 train --init-draft D --holdout-shards 0 --holdout-features DIR --stop-gain G --stop-window M`: every
    training shard is trained on, the start and each checkpoint are scored on DIR, and the summary's held-out figures
    are the saved draft's on DIR (what `evaluate` there gives)."""
    import hf_eagle3
    from hf_eagle3.training.cli import main

    root = data[0]
    start = new_draft(data)
    start.save_pretrained(tmp_path / "start")
    (tmp_path / "responses").mkdir()
    (tmp_path / "responses" / "responses-00000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in tiny_records(tiny_target("llama"), n=2, new=4)))  # read, not trained on
    out = tmp_path / "out"
    main(["train", "--data", str(tmp_path / "responses"), "--out", str(out), "--skip-features", "--features-dir",
          str(root / "train"), "--init-draft", str(tmp_path / "start"), "--holdout-shards", "0", "--holdout-features",
          str(root / "unseen"), "--stop-gain", "0.001", "--stop-window", "1000", "--max-steps", "4", "--save-every",
          "2", "--batch-tokens", "128", "--mixed-precision", "no", "--save-dtype", "float32"])
    scores = logged_scores(out / "run")
    assert sorted(scores) == [0, 2, 4]  # the start, then every checkpoint
    summary = json.loads((out / "draft" / "training_summary.json").read_text())
    saved = hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft")
    on_unseen = evaluate(saved, root / "unseen", shards="all", ttt_length=7, chain_length=5)
    assert summary["holdout"]["chain"]["mean_acceptance_length"] == pytest.approx(
        on_unseen["chain"]["mean_acceptance_length"], abs=1e-6)
    assert summary["holdout"]["chain"]["num_drafts"] == on_unseen["chain"]["num_drafts"]
    on_train = evaluate(saved, root / "train", shards="all", ttt_length=7, chain_length=5)
    assert on_train["chain"]["num_drafts"] != on_unseen["chain"]["num_drafts"]  # not the training features' figures
