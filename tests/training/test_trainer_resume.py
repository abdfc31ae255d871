"""``train`` rerun in the same run directory: a finished run says so and changes nothing (no step past its end), and
after a resume its log holds each step once."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_records, tiny_target

import hf_eagle3
from hf_eagle3.training.features import cache_features
from hf_eagle3.training.trainer import (
    TrainConfig,
    draft_config_for_target,
    init_draft,
    train,
)
from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny target, its answers where ``train --data`` reads them, and their features (4 shards)."""
    tmp = tmp_path_factory.mktemp("resume")
    target = tiny_target("llama")
    target.save_pretrained(tmp / "target")
    records = tiny_records(target, n=12, new=12)
    (tmp / "data").mkdir()
    (tmp / "data" / "responses-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cache_features(target, records, tmp / "features", [2, 3, 3], per_shard=3, dtype=torch.float32, progress=False)
    return tmp, records


def _new_draft(tmp, records):
    head = torch.load(tmp / "features" / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)
    torch.manual_seed(0)
    return init_draft(draft_config_for_target(head["config"], 64, intermediate_size=96), head, d2t, t2d)


def _cfg(**kw):
    return TrainConfig(**{**dict(lr=3e-3, epochs=4, batch_tokens=128, warmup_steps=1, ttt_length=2, log_every=1,
                                 save_every=2, mixed_precision="no", holdout_shards=1, select_by="last", max_steps=5),
                          **kw})


def _logged_steps(run) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_the_cli_on_a_finished_run_says_so_and_changes_nothing(setup, capsys):
    from hf_eagle3.training.cli import main

    tmp, _ = setup
    out = tmp / "finished"
    args = ["train", "--target", str(tmp / "target"), "--data", str(tmp / "data"), "--out", str(out),
            "--features-dir", str(tmp / "features"), "--skip-features", "--draft-vocab-size", "64",
            "--max-steps", "3", "--epochs", "4", "--save-every", "2", "--batch-tokens", "128", "--warmup-steps", "1",
            "--ttt-length", "2", "--mixed-precision", "no", "--save-dtype", "float32"]
    main(args)
    first = hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft").state_dict()
    log = (out / "run" / "log.jsonl").read_text()
    selection = (out / "run" / "selection.json").read_text()
    capsys.readouterr()
    main(args)  # the retry of a pipeline whose run had finished: returns, exit status 0
    printed = capsys.readouterr().out
    assert torch.load(out / "run" / "checkpoint.pt", weights_only=False)["step"] == 3
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft").state_dict()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
    assert (out / "run" / "log.jsonl").read_text() == log
    assert (out / "run" / "selection.json").read_text() == selection
    assert "finished" in printed and "--max-steps" in printed and "step 4/" not in printed


@pytest.mark.parametrize("ended_by", ["max_steps", "epochs"])
def test_a_finished_run_trains_no_step_past_its_end(setup, ended_by):
    tmp, records = setup
    cfg = _cfg(max_steps=5) if ended_by == "max_steps" else _cfg(max_steps=0, epochs=1)
    run = tmp / f"ended-{ended_by}"
    done = train(_new_draft(tmp, records), tmp / "features", run, cfg, log=lambda s: None)
    steps = torch.load(run / "checkpoint.pt", weights_only=False)["step"]
    lines = []
    again = train(_new_draft(tmp, records), tmp / "features", run, cfg, log=lines.append)
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == steps
    for a, b in zip(done.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    option = "--max-steps" if ended_by == "max_steps" else "--epochs"
    assert any("finished" in line and option in line for line in lines), lines
    assert not any(line.startswith("step ") for line in lines)


def test_the_log_holds_each_step_once_after_a_resume(setup):
    tmp, records = setup
    run = tmp / "killed"

    def killed_at_step_3(line):
        if line.startswith("step 3/"):  # logged after checkpoint 2: steps 1..3 are in the log, step 2 on disk
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_new_draft(tmp, records), tmp / "features", run, _cfg(), log=killed_at_step_3)
    assert _logged_steps(run) == [1, 2, 3]
    resumed = train(_new_draft(tmp, records), tmp / "features", run, _cfg(), log=lambda s: None)
    assert _logged_steps(run) == [1, 2, 3, 4, 5]
    whole = train(_new_draft(tmp, records), tmp / "features", tmp / "whole", _cfg(), log=lambda s: None)
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_a_kill_during_the_final_save_is_finished_by_the_rerun_as_the_whole_run_would(setup, monkeypatch):
    """Killed after the last checkpoint is written but before it is scored on the held-out shards: the rerun trains
    nothing, scores that checkpoint, and selects and returns what the uninterrupted run does."""
    from hf_eagle3.training import trainer as trainer_module

    tmp, records = setup
    cfg = _cfg(select_by="holdout", select_chain_length=2)
    whole = train(_new_draft(tmp, records), tmp / "features", tmp / "whole-holdout", cfg, log=lambda s: None)
    score = trainer_module._Selection.score

    def killed_at_the_last(self, weights, step, *minutes):
        if step == 5:
            raise KeyboardInterrupt
        return score(self, weights, step, *minutes)

    monkeypatch.setattr(trainer_module._Selection, "score", killed_at_the_last)
    run = tmp / "killed-holdout"
    with pytest.raises(KeyboardInterrupt):
        train(_new_draft(tmp, records), tmp / "features", run, cfg, log=lambda s: None)
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 5
    monkeypatch.setattr(trainer_module._Selection, "score", score)
    lines = []
    again = train(_new_draft(tmp, records), tmp / "features", run, cfg, log=lines.append)
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 5

    def scores(path):
        return [{k: v for k, v in r.items() if k != "training_minutes"}  # the clock differs between the runs
                for r in map(json.loads, (path / "log.jsonl").read_text().splitlines()) if "loss" not in r]

    assert scores(run) == scores(tmp / "whole-holdout")
    assert (run / "selection.json").read_text() == (tmp / "whole-holdout" / "selection.json").read_text()
    for a, b in zip(whole.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert any("finished" in line for line in lines) and not any(line.startswith("step ") for line in lines)
