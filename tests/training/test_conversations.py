"""The data users have: conversation layouts read, bad rows counted and skipped, every user turn answered by the
target with its chat template (system prompts included), loss on assistant tokens only, resume after a kill."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target
from transformers import AutoTokenizer

from hf_eagle3.smollm2 import smollm2_path
from hf_eagle3.training.conversations import read_conversations, render
from hf_eagle3.training.prepare import done_turns, iter_records, prepare

CHAT = [
    {"id": "chat", "messages": [{"role": "system", "content": "Answer in one word."},
                                {"role": "user", "content": "Name a colour."},
                                {"role": "assistant", "content": "Blue."},
                                {"role": "user", "content": "Another one?"},
                                {"role": "assistant", "content": "Red."}]},
    {"id": "share", "system": "You are terse.",
     "conversations": [{"from": "human", "value": "Two plus two?"}, {"from": "gpt", "value": "Four."},
                       {"from": "human", "value": "Times three?"}]},
    {"id": "one", "prompt": "Say hello."},
    {"id": "bench", "turns": ["First question?", "Second question?"]},
]
BAD = [
    {"id": "empty", "messages": [{"role": "user", "content": "  "}]},
    {"id": "tool", "messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"}]},
    {"id": "nouser", "messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]},
    {"id": "latesys", "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
    {"id": "nothing", "text": "no conversation here"},
    {"id": "one", "prompt": "A second row with the id of another."},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(smollm2_path()))


@pytest.fixture(scope="module")
def target(tok):
    return tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return path


def test_layouts_are_read_as_conversations_and_bad_rows_counted(tmp_path):
    convs, summary = read_conversations(_jsonl(tmp_path / "d.jsonl", CHAT + BAD, ['{"id": "cut", "mess']))
    assert [c["id"] for c in convs] == ["chat", "share", "one", "bench"]
    share = convs[1]["messages"]
    assert [m["role"] for m in share] == ["system", "user", "assistant", "user"]
    assert share[0]["content"] == "You are terse." and share[2]["content"] == "Four."
    assert [m["content"] for m in convs[3]["messages"]] == ["First question?", "Second question?"]
    assert summary.read == 11 and summary.kept == 4
    assert dict(summary.skipped) == {
        "empty user turn": 1,
        "unknown role 'tool' (known: system, user, assistant, human, gpt)": 1,
        "no user turn": 1,
        "a system prompt after the first message": 1,
        "no 'messages', 'conversations', 'prompt' or 'turns' field": 1,
        "an id seen before (ids name a conversation's answers on disk)": 1,
        "not JSON": 1,
    }
    assert summary.first["not JSON"].endswith("d.jsonl:11")
    # a JSON file holding a list of rows (ShareGPT's usual layout) reads the same
    (tmp_path / "d.json").write_text(json.dumps(CHAT + BAD))
    again, summary = read_conversations(tmp_path / "d.json")
    assert again == convs and summary.kept == 4 and sum(summary.skipped.values()) == 6
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_conversations(tmp_path / "missing.jsonl")


def test_datasets_folders_are_read(tmp_path):
    """A folder ``Dataset.save_to_disk`` wrote, and a folder of data files, through ``datasets``."""
    import datasets

    rows = [{"id": c["id"], "messages": c["messages"]} for c in CHAT if "messages" in c] + [
        {"id": "x", "messages": [{"role": "user", "content": "Only a question."}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    convs, summary = read_conversations(tmp_path / "saved")
    assert [c["id"] for c in convs] == ["chat", "x"] and summary.kept == 2
    (tmp_path / "files").mkdir()
    _jsonl(tmp_path / "files" / "train.jsonl", rows)
    convs, _ = read_conversations(tmp_path / "files", split="train")
    assert [c["messages"] for c in convs] == [r["messages"] for r in rows]
    with pytest.raises(ValueError, match="no split 'test'"):
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
        read_conversations(tmp_path / "dict", split="test")


def test_every_user_turn_is_answered_by_the_target_in_order(tmp_path, tok, target):
    data = _jsonl(tmp_path / "d.jsonl", CHAT + BAD)
    lines = []
    out = prepare(target, tok, data, tmp_path / "out", max_new_tokens=5, batch_size=3, progress=False,
                  log=lines.append)
    assert lines[0] == "4 conversation(s) of 10 row(s) read, 6 skipped:"
    records = {(r["id"], r["turn"]): r for r in iter_records(out)}
    assert sorted(records) == [("bench", 0), ("bench", 1), ("chat", 0), ("chat", 1), ("one", 0), ("share", 0),
                               ("share", 1)]
    for (cid, turn), rec in records.items():
        conv = next(c for c in CHAT if c["id"] == cid)
        messages = [{"role": "system", "content": conv.get("system") or m["content"]}
                    for m in conv.get("messages", [])[:1] if m["role"] == "system"]
        if cid == "share":
            messages = [{"role": "system", "content": "You are terse."}]
        users = ([m["content"] for m in conv.get("messages", []) if m["role"] == "user"]
                 or [m["value"] for m in conv.get("conversations", []) if m["from"] == "human"]
                 or conv.get("turns") or [conv.get("prompt")])
        for t in range(turn + 1):  # the target's own earlier answers, never the data's
            messages.append({"role": "user", "content": users[t]})
            if t < turn:
                messages.append({"role": "assistant",
                                 "content": tok.decode(records[cid, t]["response_ids"], skip_special_tokens=True)})
        assert rec["prompt_ids"] == render(tok, messages, add_generation_prompt=True), (cid, turn)
        assert 1 <= len(rec["response_ids"]) <= 5
    # the system prompt is in every turn's prompt; the data's answers ("Blue.", "Four.") are in none
    assert tok.decode(records["chat", 1]["prompt_ids"]).count("Answer in one word.") == 1
    assert all("Blue." not in tok.decode(r["prompt_ids"]) and "Four." not in tok.decode(r["prompt_ids"])
               for r in records.values())


def test_the_loss_falls_on_assistant_tokens_only_each_once(tmp_path, tok, target):
    """Through the feature pass and the batches training reads: the positions the loss counts are exactly the
    target's answers' tokens (every turn's, once), never a system, user or template token."""
    from hf_eagle3.training.features import cache_features, collate

    data = _jsonl(tmp_path / "d.jsonl", CHAT)
    out = prepare(target, tok, data, tmp_path / "out", max_new_tokens=4, batch_size=4, progress=False,
                  log=lambda s: None)
    records = list(iter_records(out))
    shard = cache_features(target, records, tmp_path / "f", [0, 1, 1], per_shard=64, dtype=torch.float32,
                           progress=False)[0]
    items = torch.load(shard, weights_only=False)
    vocab = target.config.vocab_size
    batch = collate(items, torch.ones(vocab, dtype=torch.bool), torch.zeros(vocab, target.config.hidden_size))
    counted = []
    for r, x in enumerate(items):
        predicted = x["input_ids"][1:]  # position i predicts token i + 1
        counted.append(predicted[batch["loss_mask"][r, : len(predicted)].bool()].tolist())
    answers = sorted(map(tuple, (r["response_ids"] for r in records)))
    assert sorted(map(tuple, counted)) == answers
    assert sum(map(len, counted)) == int(batch["loss_mask"].sum())


def test_a_killed_run_resumes_without_answering_a_turn_twice(tmp_path, tok, target, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", CHAT)
    calls = {"n": 0}
    generate = type(target).generate

    def dies_on_the_third_call(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "generate", dies_on_the_third_call)
    with pytest.raises(KeyboardInterrupt):
        prepare(target, tok, data, tmp_path / "out", max_new_tokens=4, batch_size=2, progress=False,
                log=lambda s: None)
    first = done_turns(tmp_path / "out")
    assert len(first) == 4  # two batches written: the four first turns
    monkeypatch.setattr(type(target), "generate", generate)
    prepare(target, tok, data, tmp_path / "out", max_new_tokens=4, batch_size=2, progress=False, log=lambda s: None)
    keys = [(r["id"], r["turn"]) for r in iter_records(tmp_path / "out")]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 7
    chat1 = next(r for r in iter_records(tmp_path / "out") if (r["id"], r["turn"]) == ("chat", 1))
    assert tok.decode(first["chat", 0], skip_special_tokens=True) in tok.decode(chat1["prompt_ids"])
    assert len(list((tmp_path / "out").glob("responses-*.jsonl"))) == 2  # the rerun's own file


def test_rows_the_chat_template_cannot_render_are_skipped(tmp_path, tok, target):
    import copy

    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    lines = []
    out = prepare(target, strict, _jsonl(tmp_path / "d.jsonl", CHAT), tmp_path / "out", max_new_tokens=3,
                  progress=False, log=lines.append)
    assert lines[0] == "2 conversation(s) of 4 row(s) read, 2 skipped:"
    assert "the chat template cannot render it" in lines[1] and lines[1].lstrip().startswith("2 x")
    assert sorted({r["id"] for r in iter_records(out)}) == ["bench", "one"]


def test_given_answers_are_used_on_request_with_a_warning(tmp_path, tok, target):
    data = _jsonl(tmp_path / "d.jsonl", CHAT)
    with pytest.warns(UserWarning, match="off-policy"):
        out = prepare(target, tok, data, tmp_path / "out", answers="given", progress=False, log=lambda s: None)
    records = {(r["id"], r["turn"]): r for r in iter_records(out)}
    assert sorted(records) == [("chat", 0), ("chat", 1), ("share", 0)]  # rows without an answer have none to give
    assert tok.decode(records["chat", 1]["response_ids"]) == "Red.<|im_end|>"
    assert "Blue." in tok.decode(records["chat", 1]["prompt_ids"])  # the data's own earlier answer
    with pytest.raises(ValueError, match="drop features_dir"):
        prepare(target, tok, data, tmp_path / "nothing", answers="given", features_dir=tmp_path / "f")
    with pytest.raises(ValueError, match="'regenerate'"):
        prepare(target, tok, data, tmp_path / "nothing", answers="theirs")
    assert not (tmp_path / "nothing").exists() and not (tmp_path / "f").exists()


def test_processes_share_whole_conversations(tmp_path, tok, target):
    data = _jsonl(tmp_path / "d.jsonl", CHAT)
    for index in (0, 1):
        prepare(target, tok, data, tmp_path / "out", max_new_tokens=3, progress=False, num_shards=2,
                shard_index=index, log=lambda s: None)
    by_file = {f.name: sorted({json.loads(line)["id"] for line in f.read_text().splitlines()})
               for f in (tmp_path / "out").iterdir()}
    assert by_file == {"responses-p0-00000.jsonl": ["chat", "one"], "responses-p1-00000.jsonl": ["bench", "share"]}
    assert len(done_turns(tmp_path / "out")) == 7


def test_prepare_cli_refuses_bad_settings_before_loading_the_target(tmp_path):
    from hf_eagle3.cli import main

    data = _jsonl(tmp_path / "d.jsonl", CHAT)
    with pytest.raises(SystemExit, match="no such file"):
        main(["prepare", "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="--features-dir has nothing to capture"):
        main(["prepare", "--prompts", str(data), "--out", str(tmp_path / "out"), "--answers", "given",
              "--features-dir", str(tmp_path / "f")])
    assert not (tmp_path / "out").exists() and not (tmp_path / "f").exists()


def test_bad_bytes_are_a_bad_row_and_a_byte_order_mark_is_read_past(tmp_path):
    """One row with a byte that is not UTF-8 is skipped and counted with its line, like any bad row (the other rows
    are read); a UTF-8 byte order mark before the first row is not part of it."""
    rows = [json.dumps(r).encode() for r in CHAT]
    bad = json.dumps({"id": "latin", "prompt": "caf\u00e9?"}, ensure_ascii=False).encode("latin-1")  # 0xe9
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join([b"\xef\xbb\xbf" + rows[0], rows[1], bad, rows[2], rows[3]]) + b"\n")
    convs, summary = read_conversations(path)
    assert [c["id"] for c in convs] == ["chat", "share", "one", "bench"]
    assert summary.read == 5 and summary.kept == 4
    reason = "not UTF-8 text (re-save the file as UTF-8)"
    assert dict(summary.skipped) == {reason: 1} and summary.first[reason].endswith("d.jsonl:3")
    assert summary.lines() == ["4 conversation(s) of 5 row(s) read, 1 skipped:", f"  1 x {reason} (first: {path}:3)"]
    (tmp_path / "d.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(CHAT).encode())  # a JSON document with a BOM
    assert [c["id"] for c in read_conversations(tmp_path / "d.json")[0]] == ["chat", "share", "one", "bench"]
    (tmp_path / "bad.json").write_bytes(b"[\n" + rows[0] + b",\n" + bad + b"\n]")  # one document: refused whole
    with pytest.raises(ValueError, match=r"bad\.json:3: .*not UTF-8.*re-save it as UTF-8"):
        read_conversations(tmp_path / "bad.json")
