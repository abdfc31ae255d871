"""A frozen head (``--freeze-head``): the draft's ``lm_head`` keeps the rows it starts with while the layer and ``fc``
train; with a draft vocabulary as large as the target's, those rows are the target's own head (a frozen
full-vocabulary head). The settings are recorded, and a resume with the other setting is refused with the fix."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_training_data


@pytest.fixture
def data(tmp_path):
    """The tiny training inputs (features cached once per test)."""
    return tiny_training_data(tmp_path)


def _run(data, tmp_path, lines, vocab: int, **overrides):
    """Train a new draft with a ``vocab``-token vocabulary for 2 steps; return the target head, the draft's
    starting weights and the trained draft."""
    from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, init_draft, train
    from hf_eagle3.training.vocab import build_vocab_mapping

    feats, head, _, _ = data
    target_vocab = head["config"]["vocab_size"]
    d2t, t2d = build_vocab_mapping({t: 1 for t in range(target_vocab)}, vocab, target_vocab)
    torch.manual_seed(0)
    draft = init_draft(draft_config_for_target(head["config"], vocab, intermediate_size=96), head, d2t, t2d)
    start = {name: p.detach().clone() for name, p in draft.named_parameters()}
    cfg = TrainConfig(**{**dict(ttt_length=2, batch_tokens=4096, mixed_precision="no", save_every=1000,
                                warmup_steps=1, epochs=4, log_every=1, select_by="last", max_steps=2), **overrides})
    trained = train(draft, feats, tmp_path / "run", cfg, log=lines.append)
    return head, start, trained


def test_a_frozen_full_vocabulary_head_stays_the_targets_while_the_rest_trains(data, tmp_path):
    lines = []
    head, start, draft = _run(data, tmp_path, lines, vocab=256, freeze_head=True)
    assert draft.config.draft_vocab_size == head["config"]["vocab_size"] and not draft.d2t.any()  # no remapping
    assert torch.equal(draft.lm_head.weight.detach().cpu(), head["lm_head"])  # the target's own head, untouched
    assert not torch.equal(draft.fc.weight.detach().cpu(), start["fc.weight"])  # while fc trained
    assert "head: frozen (lm_head keeps the rows it starts with; the layer and fc are trained)" in lines
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["freeze_head"] is True


def test_without_the_option_the_head_trains(data, tmp_path):
    """The negative control: the same run without ``freeze_head`` changes the head."""
    lines = []
    _, start, draft = _run(data, tmp_path, lines, vocab=256)
    assert not torch.equal(draft.lm_head.weight.detach().cpu(), start["lm_head.weight"])
    assert not any(line.startswith("head: frozen") for line in lines)


def test_a_resume_with_the_other_setting_is_refused(data, tmp_path):
    _run(data, tmp_path, [], vocab=64, freeze_head=True)
    with pytest.raises(ValueError, match="--freeze-head"):
        _run(data, tmp_path, [], vocab=64, freeze_head=False, max_steps=3)


def test_the_command_line_option():
    import argparse

    from hf_eagle3.training.parsers import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    base = ["train", "--data", "d", "--out", "o"]
    assert parser.parse_args(base + ["--freeze-head"]).freeze_head is True
    assert parser.parse_args(base).freeze_head is False
