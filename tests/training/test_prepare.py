"""``prepare --features-dir``: a batch's responses and feature shard are one commit, so a run killed between writing
the two loses nothing and doubles nothing on its rerun, which drops what has no partner and says so. A run resumes
where it stopped, processes share the prompts, and the features it writes are what ``cache_features`` writes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import tiny_target
from transformers import AutoTokenizer

from hf_eagle3.smollm2 import smollm2_path
from hf_eagle3.training import prepare as prepare_module
from hf_eagle3.training.features import FeatureShards, cache_features
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


@pytest.mark.slow
def test_prepare_is_resumable(tmp_path):
    """Responses are regenerated with the target's chat template; a rerun answers only the missing prompts."""
    import json

    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path
    from hf_eagle3.training.prepare import done_turns, iter_records, prepare

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question number {i}?"}) + "\n" for i in range(5)))
    out = tmp_path / "data"
    prepare(target, tok, prompts, out, max_prompts=3, max_new_tokens=6, batch_size=2, progress=False)
    assert set(done_turns(out)) == {("p0", 0), ("p1", 0), ("p2", 0)}
    with open(next(out.glob("responses-*.jsonl")), "a") as f:
        f.write('{"id": "p3", "prompt_ids": [1, 2')  # a line cut by an interruption
    prepare(target, tok, prompts, out, max_new_tokens=6, batch_size=2, progress=False)
    records = list(iter_records(out))
    assert sorted(r["id"] for r in records) == ["p0", "p1", "p2", "p3", "p4"]  # nothing answered twice
    expected = tok.apply_chat_template([{"role": "user", "content": "Question number 4?"}], add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    rec = next(r for r in records if r["id"] == "p4")
    assert rec["prompt_ids"] == list(expected) and 1 <= len(rec["response_ids"]) <= 6


@pytest.mark.slow
def test_prepare_shares_the_prompts_between_processes(tmp_path, monkeypatch):
    """`prepare(num_shards=, shard_index=)` (one process per GPU): each process answers its share into files of its
    own in the same directories; together they answer every prompt once, features included; reruns resume."""
    import json

    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path
    from hf_eagle3.training.cli import process_share
    from hf_eagle3.training.prepare import iter_records, prepare

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(7)))
    out, feats = tmp_path / "data", tmp_path / "features"
    kwargs = dict(max_new_tokens=5, batch_size=2, progress=False, features_dir=feats, layer_ids=[0, 1, 1],
                  feature_dtype=torch.float32, num_shards=2)
    for index in (0, 1):
        prepare(target, tok, prompts, out, shard_index=index, **kwargs)
    by_file = {f.name: [json.loads(line)["id"] for line in f.read_text().splitlines()] for f in out.iterdir()}
    assert by_file == {"responses-p0-00000.jsonl": ["p0", "p2", "p4", "p6"],
                       "responses-p1-00000.jsonl": ["p1", "p3", "p5"]}
    shards = sorted(p.name for p in feats.glob("shard-*.pt"))
    assert shards == ["shard-p0-00000.pt", "shard-p0-00001.pt", "shard-p1-00000.pt", "shard-p1-00001.pt"]
    in_shards = [item["id"] for name in shards for item in torch.load(feats / name, weights_only=False)]
    assert sorted(in_shards) == [f"p{i}" for i in range(7)]
    assert sorted(r["id"] for r in iter_records(out)) == [f"p{i}" for i in range(7)]
    prepare(target, tok, prompts, out, shard_index=1, **kwargs)  # rerun: its share is done, nothing is added
    assert len(list(out.iterdir())) == 2 and len(list(feats.glob("shard-*.pt"))) == 4
    assert len(list(iter_records(out))) == 7
    with pytest.raises(ValueError, match="0 <= shard_index < num_shards"):
        prepare(target, tok, prompts, tmp_path / "bad", shard_index=2, **kwargs)
    assert not (tmp_path / "bad").exists()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert process_share(None, None) == (4, 3) and process_share(2, 0) == (2, 0)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert process_share(None, None) == (1, 0)


@pytest.mark.parametrize("do_sample", [False, True])
def test_prepare_writes_the_features_cache_features_would(tmp_path, do_sample):
    """Features captured during generation (left-padded batches) equal a separate cache_features pass."""
    import json

    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path
    from hf_eagle3.training.prepare import iter_records, prepare

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = tmp_path / "prompts.jsonl"
    texts = ["Hi?", "Tell me about the sea, the sky and the wind.", "Why?", "A much longer question " * 3]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out, fused = tmp_path / "data", tmp_path / "fused"
    prepare(target, tok, prompts, out, max_new_tokens=7, batch_size=3, do_sample=do_sample, progress=False,
            features_dir=fused, layer_ids=[0, 1, 1], feature_dtype=torch.float32, max_feature_prompt_tokens=6)
    records = list(iter_records(out))
    reference = cache_features(target, records, tmp_path / "ref", [0, 1, 1], per_shard=100, dtype=torch.float32,
                               progress=False)
    ref = {item["id"]: item for item in torch.load(reference[0], weights_only=False)}
    shards = sorted(fused.glob("shard-*.pt"))
    assert len(shards) == 2 and (fused / "target_head.pt").exists()
    items = [item for path in shards for item in torch.load(path, weights_only=False)]
    assert sorted(item["id"] for item in items) == ["p0", "p1", "p2", "p3"]
    for item in items:
        r = ref[item["id"]]
        p = int(r["prompt_len"])
        keep = min(p, 6)
        n = len(item["input_ids"])
        assert item["prompt_len"] == keep
        assert n == len(r["input_ids"]) - p + keep - (0 if len(r["input_ids"]) - p < 7 else 1)  # unfed last token
        span = slice(p - keep, p - keep + n)
        assert torch.equal(item["input_ids"], r["input_ids"][span])
        torch.testing.assert_close(item["features"], r["features"][span], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(item["last_hidden"], r["last_hidden"][span], atol=1e-4, rtol=1e-4)
        assert torch.equal(item["target_argmax"], r["target_argmax"][span])
    # generation itself is unchanged by the recording, and no hook stays behind
    assert not any(layer._forward_pre_hooks for layer in target.model.layers) and not target.model._forward_hooks
    with pytest.raises(ValueError, match="other layer ids"):
        prepare(target, tok, prompts, tmp_path / "data2", max_new_tokens=2, progress=False, features_dir=fused,
                layer_ids=[0, 1, 0])
    with pytest.raises(ValueError, match="out of range"):  # refused before any file is written
        prepare(target, tok, prompts, tmp_path / "data3", max_new_tokens=2, progress=False,
                features_dir=tmp_path / "bad", layer_ids=[0, 1, 99])
    assert not (tmp_path / "bad").exists()
    assert not any(layer._forward_pre_hooks for layer in target.model.layers) and not target.model._forward_hooks
