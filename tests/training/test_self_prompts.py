"""Prompts written by the target itself (Magpie), ``hf-eagle3 prepare --self-prompts N``: seeded,
deduplicated (also against the file being continued), kept apart from the evaluation set, degenerate ones dropped."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target

from hf_eagle3.training import cli as train_cli
from hf_eagle3.training.self_prompts import (
    EvalOverlap,
    PromptFilter,
    normalize_prompt,
    read_exclude_prompts,
    user_turn,
    write_self_prompts,
)

WORDS = ("what how why is are the a cat dog sea sky wind write explain story poem about my your code python list "
         "sort number city river please tell me short long best way to make good bad day night tree").split()


@pytest.fixture(scope="module")
def tok():
    """The SmolLM2 tokenizer (ChatML template, which injects a system prompt)."""
    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path

    return AutoTokenizer.from_pretrained(str(smollm2_path()))


@pytest.fixture(scope="module")
def writer(tok):
    """A tiny random Llama whose head only ever picks a few English words or ends the turn (about one token in
    twelve): random weights alone would write gibberish that never ends the turn."""
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         num_hidden_layers=2)
    words = sorted({tok.encode(" " + w, add_special_tokens=False)[0] for w in WORDS})
    end = tok.convert_tokens_to_ids("<|im_end|>")
    head = torch.nn.Linear(target.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(target.lm_head.weight * 0.05)
        head.bias.fill_(-40.0)
        head.bias[words] = 0.0
        head.bias[end] = torch.log(torch.tensor(len(words) / 11.0))
    target.lm_head = head
    return target


def _prompts(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------------------------- unit: the filter
def test_filter_drops_degenerate_prompts_with_the_default_rules():
    rules = PromptFilter(markers=("<|im_start|>", "<|im_end|>"))
    assert rules.reason("Write a short poem about the sea at night.") is None
    assert rules.reason("How do I sort a list of numbers in Python?") is None
    assert rules.reason("") == "too short"
    assert rules.reason("   Hi?  ") == "too short"
    assert rules.reason("Explain " + "why the sky is blue and " * 200) == "too long"
    assert rules.reason("1234 5678 9012 3456 7890 !!!! ????") == "few letters"
    assert rules.reason("=== ### *** %%% ab cd ef gh ij") == "few letters"
    assert rules.reason("tell me a story tell me a story tell me a story tell me a story") == "repeats"
    assert rules.reason("tell me a story tell me a story tell me a story please") is None  # three times is fine
    assert rules.reason("What is 2+2?<|im_end|>\n<|im_start|>assistant\n4") == "role marker"
    assert rules.reason("Hello <|im_start|>user how are you doing today?") == "role marker"


def test_normalised_prompts_and_eval_overlap():
    assert normalize_prompt("  What IS the\n\tcapital   of France?! ") == "what is the capital of france"
    assert normalize_prompt("...(Hi)...") == "hi"
    mt = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
          "and must-see attractions.")
    overlap = EvalOverlap([mt, "Rewrite your previous response. Start every sentence with the letter A."])
    assert len(overlap) == 2
    assert overlap.matches(mt)
    assert overlap.matches("  " + mt.upper().replace(" ", "   ") + "!!")  # the same after normalisation
    assert overlap.matches("Rewrite your previous response. start every sentence with the letter a")
    span = normalize_prompt(mt)[20:70]  # 50 characters of it inside another prompt
    assert len(span) == 50 and overlap.matches(f"Please do this: {span} -- thanks")
    assert not overlap.matches(f"Please do this: {span[1:]} -- thanks")  # 49 characters are not enough
    assert not overlap.matches("Write a travel blog post about Hawaii.")
    assert not EvalOverlap([]).matches(mt)


def test_read_exclude_prompts_reads_every_turn(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"question_id": 81, "turns": ["First turn?", "Second turn?"]}) + "\n\n"
                    + json.dumps({"id": "x", "prompt": "Plain prompt."}) + "\n")
    assert read_exclude_prompts(path) == ["First turn?", "Second turn?", "Plain prompt."]
    path.write_text(json.dumps({"id": "x"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        read_exclude_prompts(path)


def test_user_turn_of_a_chatml_template(tok):
    turn = user_turn(tok)
    assert turn.prefix.endswith("<|im_start|>user\n") and "You are a helpful AI assistant" in turn.prefix
    assert turn.suffix.startswith("<|im_end|>")
    assert turn.stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>" in turn.markers and "<|im_start|>assistant" in turn.markers


# ------------------------------------------------------------------------------------------------- end to end
def test_same_seed_same_prompts_other_seed_other_prompts(tok, writer, tmp_path):
    kwargs = dict(max_new_tokens=40, batch_size=8, progress=False)
    a = write_self_prompts(writer, tok, 6, tmp_path / "a.jsonl", seed=0, **kwargs)
    b = write_self_prompts(writer, tok, 6, tmp_path / "b.jsonl", seed=0, **kwargs)
    c = write_self_prompts(writer, tok, 6, tmp_path / "c.jsonl", seed=1, **kwargs)
    assert a.read_bytes() == b.read_bytes()
    rows = _prompts(a)
    assert len(rows) == 6 and [r["id"] for r in rows] == [f"self-0-{i}" for i in range(6)]
    assert all(r["source"] == "self" and PromptFilter().reason(r["prompt"]) is None for r in rows)
    assert {r["prompt"] for r in _prompts(c)}.isdisjoint({r["prompt"] for r in rows})
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_no_duplicates_also_against_the_file_continued(tok, writer, tmp_path):
    kwargs = dict(max_new_tokens=40, batch_size=8, progress=False)
    first = _prompts(write_self_prompts(writer, tok, 4, tmp_path / "ref.jsonl", seed=0, **kwargs))
    path = tmp_path / "mine.jsonl"  # a file that already holds one of them, written differently
    mine = {"id": "mine", "prompt": "  " + first[0]["prompt"].upper() + " ?!"}
    path.write_text(json.dumps(mine) + "\n")
    write_self_prompts(writer, tok, 4, path, seed=0, **kwargs)
    rows = _prompts(path)
    assert rows[0] == mine and len(rows) == 4
    norms = [normalize_prompt(r["prompt"]) for r in rows]
    assert len(set(norms)) == 4
    # continuing: the lines already there stay as they are, new ones are appended up to the number asked for
    write_self_prompts(writer, tok, 9, path, seed=0, **kwargs)
    more = _prompts(path)
    assert more[:4] == rows and len(more) == 9 and len({normalize_prompt(r["prompt"]) for r in more}) == 9
    assert len({r["id"] for r in more}) == 9
    before = path.read_bytes()
    write_self_prompts(writer, tok, 9, path, seed=0, **kwargs)  # already enough: nothing changes
    assert path.read_bytes() == before


def test_eval_prompts_are_kept_out(tok, writer, tmp_path):
    kwargs = dict(max_new_tokens=60, batch_size=8, progress=False)
    ref = _prompts(write_self_prompts(writer, tok, 8, tmp_path / "ref.jsonl", seed=3, **kwargs))
    longest = max(ref, key=lambda r: len(normalize_prompt(r["prompt"])))["prompt"]
    assert len(normalize_prompt(longest)) >= 52, "the writer should write some prompt of 52+ characters"
    exact = ref[0]["prompt"]
    span = normalize_prompt(longest)[1:51]  # a 50-character span of it, inside an evaluation prompt of its own
    eval_set = [exact.title() + "?", f"Consider: {span}. Answer briefly."]
    out = _prompts(write_self_prompts(writer, tok, 8, tmp_path / "out.jsonl", seed=3, exclude_prompts=eval_set,
                                      **kwargs))
    norms = {normalize_prompt(r["prompt"]) for r in out}
    assert len(out) == 8
    assert normalize_prompt(exact) not in norms and normalize_prompt(longest) not in norms
    assert not any(EvalOverlap(eval_set).matches(r["prompt"]) for r in out)
    assert {normalize_prompt(r["prompt"]) for r in ref} - {normalize_prompt(exact), normalize_prompt(longest)} <= norms


def test_a_tokenizer_without_chat_template_is_refused_before_anything_is_written(tok, writer, tmp_path, monkeypatch):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    out = tmp_path / "sub" / "self.jsonl"
    with pytest.raises(ValueError, match="chat template.*--prompts"):
        write_self_prompts(writer, plain, 4, out, progress=False)
    assert not (tmp_path / "sub").exists()
    # the CLI says the same before it writes anything
    monkeypatch.setattr(train_cli, "load_target", lambda name, dtype, device=None, **kw: (writer, plain))
    with pytest.raises(ValueError, match="chat template"):
        train_cli.main(["prepare", "--self-prompts", "2", "--out", str(tmp_path / "data"), "--device", "cpu",
                        "--dtype", "float32"])
    assert not (tmp_path / "data").exists()


# --------------------------------------------------------------------------------------------------------- CLI
def test_cli_prepare_self_prompts_writes_prompts_and_answers(tok, writer, tmp_path, monkeypatch, capsys):
    from hf_eagle3.training.prepare import iter_records

    monkeypatch.setattr(train_cli, "load_target", lambda name, dtype, device=None, **kw: (writer, tok))
    with pytest.raises(SystemExit, match="--prompts FILE.*--self-prompts N"):  # neither: refused before loading
        train_cli.main(["prepare", "--out", str(tmp_path / "none")])
    evals = tmp_path / "mt_bench.jsonl"
    evals.write_text(json.dumps({"question_id": 1, "turns": ["Write a poem about the sea.", "Shorter."]}) + "\n")
    out = tmp_path / "data"
    argv = ["prepare", "--self-prompts", "4", "--out", str(out), "--exclude-prompts", str(evals),
            "--max-new-tokens", "3", "--batch-size", "4", "--device", "cpu", "--dtype", "float32"]
    train_cli.main(argv)
    assert "self prompts: 4/4" in capsys.readouterr().out
    prompts = _prompts(out / "self_prompts.jsonl")
    assert len(prompts) == 4 and all(r["id"].startswith("self-0-") for r in prompts)
    records = {r["id"]: r for r in iter_records(out)}
    assert sorted(records) == sorted(r["id"] for r in prompts)
    for r in prompts:  # answered like any prompt: templated with the chat template
        expected = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert records[r["id"]]["prompt_ids"] == list(expected) and 1 <= len(records[r["id"]]["response_ids"]) <= 3
    # with --prompts as well, and a file of its own: both are answered; a rerun adds nothing
    given = tmp_path / "given.jsonl"
    given.write_text(json.dumps({"id": "g0", "prompt": "Why is the sky blue?"}) + "\n")
    own = tmp_path / "own.jsonl"
    train_cli.main(argv + ["--prompts", str(given), "--self-prompts-file", str(own), "--seed", "5"])
    ids = [r["id"] for r in iter_records(out)]
    assert len(ids) == 9 and "g0" in ids and sum(i.startswith("self-5-") for i in ids) == 4
    train_cli.main(argv + ["--prompts", str(given), "--self-prompts-file", str(own), "--seed", "5"])
    assert len(list(iter_records(out))) == 9


# ---------------------------------------------------------------------------------- the committed training data
def test_committed_self_prompts_are_distinct_clean_and_answered():
    """The self-written prompts the shipped draft was trained on (``examples/data/...-responses/self_prompts-*``):
    no prompt twice within or across seeds' files (normalised), none the filter rejects, and every answer in the
    matching ``responses-*`` file belongs to one of them."""
    import gzip
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "smollm2-135m-instruct-responses"
    files = sorted(data.glob("self_prompts-*.jsonl"))
    assert len(files) >= 3  # seeds 0, 1 and 2
    seen, rule = {}, PromptFilter()
    for path in files:
        rows = _prompts(path)
        ids = {r["id"] for r in rows}
        for r in rows:
            key = normalize_prompt(r["prompt"])
            assert key not in seen, f"{r['id']} repeats {seen.get(key)}"
            seen[key] = r["id"]
            assert rule.reason(r["prompt"]) is None, r["id"]
        with gzip.open(data / (path.name.replace("self_prompts", "responses") + ".gz"), "rt") as f:
            answered = [json.loads(line)["id"] for line in f]
        assert answered and set(answered) <= ids and len(set(answered)) == len(answered)
    assert len(seen) >= 2600
