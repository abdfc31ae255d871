"""``hf-eagle3 check DRAFT --target TARGET`` and :func:`hf_eagle3.checkpoints.check.check_draft`: what was read, whether the pair
fits (naming the problem and the fix), and which layer-id convention accepts more, measured."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_draft, tiny_target

from hf_eagle3.checkpoints import check as check_mod
from hf_eagle3.checkpoints.check import check_draft, format_report
from hf_eagle3.checkpoints.export import export_flat, export_speculators
from hf_eagle3.cli import main
from hf_eagle3.loading import shipped_draft_path

SHIPPED_DRAFT = shipped_draft_path()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target saved to disk, and a draft for it pinned to layers [1, 3, 4], in the flat and speculators
    layouts."""
    tmp = tmp_path_factory.mktemp("check")
    target = tiny_target("llama")
    target.generation_config.eos_token_id = None
    target.save_pretrained(tmp / "target")
    draft = tiny_draft(target, 48, feature_layer_ids=[1, 3, 4])
    export_flat(draft, tmp / "flat")
    export_speculators(draft, tmp / "spec")
    return target, tmp


def test_report_names_what_was_read_in_each_convention(pair):
    target, tmp = pair
    flat = check_draft(tmp / "flat", target, num_prompts=1, max_new_tokens=6, k=2)
    assert flat["layout"] == "flat" and flat["problems"] == [] and flat["notes"] == []
    lay = flat["layers"]
    assert lay["as_read"] == [1, 3, 4] and lay["output_of_layer"] == [0, 2, 3]
    assert "eagle_config" in lay["source"] and lay["shifted"] == [0, 2, 3]  # the other reading of eagle_config
    assert [c["layer_ids"] for c in flat["candidates"]] == [[1, 3, 4], [0, 2, 3]]
    for cand in flat["candidates"]:
        assert 1.0 <= cand["mean_acceptance_length"] <= 3.0 and len(cand["acceptance_per_position"]) == 2
    spec = check_draft(tmp / "spec", target, measure=False)
    assert spec["layout"] == "speculators" and spec["layers"]["shifted"] == [2, 4, 5] and spec["candidates"] == []
    assert spec["variant"]["vocab"] == {"draft": 48, "target": 256, "mapping": "d2t"}
    assert spec["variant"]["lm_head"] == "own" and spec["variant"]["embedding"] == "shared with the target"
    text = format_report(flat)
    assert "inputs of layers [1, 3, 4]" in text and "outputs of layers [0, 2, 3]" in text and "fit     OK" in text


def test_advice_names_the_better_ids_and_how_to_set_them(pair, monkeypatch):
    """The decision: the shifted ids win only by more than the tie margin, and the advice says where to write them
    in the draft's own layout."""
    target, tmp = pair
    scores = {}

    def fake(target, draft, prompts, layer_ids, max_new_tokens, k):
        return {"layer_ids": list(layer_ids), "mean_acceptance_length": scores[tuple(layer_ids)],
                "acceptance_per_position": []}

    monkeypatch.setattr(check_mod, "measure_acceptance", fake)
    scores.update({(1, 3, 4): 1.2, (0, 2, 3): 2.4})
    report = check_draft(tmp / "flat", target)
    assert report["best"] == "shifted"
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [-1, 1, 2]" in report["advice"]
    assert "draft.config.feature_layer_ids = [0, 2, 3]" in report["advice"]
    assert "<- better" in format_report(report)
    scores.update({(1, 3, 4): 1.5, (0, 2, 3): 1.52})  # within the margin: keep the ids as read
    assert check_draft(tmp / "flat", target)["best"] == "as read"
    scores.update({(1, 3, 4): 1.1, (2, 4, 5): 1.9})
    report = check_draft(tmp / "spec", target)
    assert report["best"] == "shifted" and "eagle_aux_hidden_state_layer_ids = [2, 4, 5]" in report["advice"]


def test_mismatched_pair_names_the_problem_and_the_fix(pair):
    _, tmp = pair
    other = tiny_target("llama", hidden_size=32, intermediate_size=64, vocab_size=300, num_hidden_layers=4)
    report = check_draft(tmp / "flat", other)
    assert report["candidates"] == [] and len(report["problems"]) == 3
    hidden, vocab, layers = report["problems"]
    assert "hidden size: the target has 32" in hidden and "Fix:" in hidden
    assert "vocabulary: the target has 300" in vocab and "Fix:" in vocab
    assert "layers [1, 3, 4], the target has 4" in layers
    assert "PROBLEMS" in format_report(report)


def test_cli_json_and_exit_codes(pair, capsys):
    _, tmp = pair
    assert main(["check", str(tmp / "flat"), "--target", str(tmp / "target"), "--json", "--num-prompts", "1",
                 "--max-new-tokens", "5", "--k", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["best"] in ("as read", "shifted") and len(report["candidates"]) == 2
    narrow = tiny_draft(tiny_target("llama", hidden_size=32, intermediate_size=64), hidden_size=32)
    narrow.save_pretrained(tmp / "narrow")
    assert main(["check", str(tmp / "narrow"), "--target", str(tmp / "target"), "--no-measure"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEMS" in out and "hidden size" in out


@pytest.mark.slow
def test_shipped_draft_on_smollm2_reports_the_right_layer_ids(smollm2, tmp_path):
    """The shipped draft reads [2, 15, 27]: measured, that beats the shifted ids. Written the wrong way into a flat
    config (our ids in eagle_config, which means output-of-layer), check finds the fix."""
    model, tok = smollm2
    report = check_draft(SHIPPED_DRAFT, model, tok, k=4)  # the defaults: 4 prompts x 96 tokens
    assert report["problems"] == [] and report["notes"] == [] and report["layers"]["as_read"] == [2, 15, 27]
    good, shifted = report["candidates"]
    assert shifted["layer_ids"] == [3, 16, 28]
    assert good["mean_acceptance_length"] > shifted["mean_acceptance_length"], report["candidates"]
    assert report["best"] == "as read"
    export_flat(str(SHIPPED_DRAFT), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]  # read as [3, 16, 28]
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    wrong = check_draft(tmp_path, model, tok, k=4)
    assert wrong["layers"]["as_read"] == [3, 16, 28] and wrong["best"] == "shifted"
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 14, 26]" in wrong["advice"]
    assert "<- better" in format_report(wrong)


def test_note_when_the_draft_names_another_target(pair):
    target, _ = pair
    draft = tiny_draft(target, 48)
    draft.config.target_name_or_path = "org/another-model"
    report = check_draft(draft, target, measure=False)
    assert report["problems"] == [] and "made for org/another-model" in report["notes"][0]
    assert "note    the draft was made for org/another-model" in format_report(report)
