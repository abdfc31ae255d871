"""``prepare --features-dir``: a batch's responses and feature shard are one commit, so a run killed between writing
the two loses nothing and doubles nothing on its rerun, which drops what has no partner and says so."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import tiny_target
from transformers import AutoTokenizer

from hf_eagle3.smollm2 import smollm2_path
from hf_eagle3.training import prepare as prepare_module
from hf_eagle3.training.features import FeatureShards
from hf_eagle3.training.prepare import iter_records, prepare

PROMPTS = [{"id": f"p{i}", "prompt": f"Question number {i}?"} for i in range(5)]
EXPECTED = sorted((f"p{i}", 0) for i in range(5))


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(smollm2_path()))


@pytest.fixture(scope="module")
def target(tok):
    return tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _run(target, tok, tmp_path, lines=None):
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return prepare(target, tok, data, tmp_path / "out", max_new_tokens=4, batch_size=2, progress=False,
                   features_dir=tmp_path / "feats", layer_ids=[0, 1, 1], feature_dtype=torch.float32,
                   log=(lines.append if lines is not None else lambda s: None))


def _feature_keys(feats) -> list:
    return [(item["id"], item["turn"]) for path in sorted(feats.glob("shard-*.pt"))
            for item in torch.load(path, weights_only=False)]


def _assert_paired(tmp_path):
    """Every turn answered once, with exactly one feature record, and nothing half-written left behind."""
    responses = [(r["id"], r["turn"]) for r in iter_records(tmp_path / "out")]
    features = _feature_keys(tmp_path / "feats")
    assert Counter(features) == Counter(responses), (sorted(features), sorted(responses))
    assert sorted(responses) == EXPECTED
    assert len(FeatureShards(tmp_path / "feats", holdout_shards=0).records()) == len(EXPECTED)  # what train reads
    assert [p.name for p in (tmp_path / "feats").iterdir() if not p.name.endswith((".pt", ".json"))] == []


def test_killed_between_a_feature_shard_and_its_responses_the_rerun_doubles_nothing(tmp_path, tok, target,
                                                                                       monkeypatch):
    recorder = prepare_module._GenerationFeatureRecorder
    write_shard, calls = recorder.write_shard, []

    def killed_after_the_second_shard(self, *args, **kwargs):
        path = write_shard(self, *args, **kwargs)
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies before the batch's responses are written
        return path

    monkeypatch.setattr(recorder, "write_shard", killed_after_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        _run(target, tok, tmp_path)
    monkeypatch.setattr(recorder, "write_shard", write_shard)
    assert len(list(iter_records(tmp_path / "out"))) == 2  # the first batch only
    lines = []
    _run(target, tok, tmp_path, lines)
    _assert_paired(tmp_path)
    assert any("dropped 2 feature record(s) and 0 response(s)" in line for line in lines), lines


def test_killed_between_the_responses_and_the_commit_the_rerun_answers_the_batch_once(tmp_path, tok, target,
                                                                                      monkeypatch):
    recorder = prepare_module._GenerationFeatureRecorder
    commit, calls = recorder.commit, []

    def killed_before_the_second_commit(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the responses are on disk, the feature shard not yet in place
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(recorder, "commit", killed_before_the_second_commit)
    with pytest.raises(KeyboardInterrupt):
        _run(target, tok, tmp_path)
    monkeypatch.setattr(recorder, "commit", commit)
    assert len(list(iter_records(tmp_path / "out"))) == 4  # two batches of responses, one of them uncommitted
    assert len(_feature_keys(tmp_path / "feats")) == 2
    lines = []
    _run(target, tok, tmp_path, lines)
    _assert_paired(tmp_path)
    assert any("dropped 2 feature record(s) and 2 response(s)" in line for line in lines), lines


def test_features_without_responses_on_disk_are_dropped_and_reported(tmp_path, tok, target):
    """The state a kill between the two writes leaves when the shard is written first: feature records whose
    responses are missing. The rerun drops them and answers those turns once."""
    _run(target, tok, tmp_path)
    shard = next((tmp_path / "out").glob("responses-*.jsonl"))
    rows = shard.read_text().splitlines()
    shard.write_text("".join(line + "\n" for line in rows[:3]))  # the last batch's responses never reached disk
    lines = []
    _run(target, tok, tmp_path, lines)
    _assert_paired(tmp_path)
    assert any("dropped 2 feature record(s) and 0 response(s)" in line for line in lines), lines
    before = sorted(p.name for p in (tmp_path / "feats").iterdir())
    lines = []
    _run(target, tok, tmp_path, lines)  # a complete directory: nothing dropped, nothing written
    assert lines == ["5 conversation(s) of 5 row(s) read"]
    assert sorted(p.name for p in (tmp_path / "feats").iterdir()) == before
