"""The acceptance loss (``--loss lk`` / ``mixed``, LK losses, arXiv 2602.23881): its term is 1 - sum min(p, q) (0 at
q == p), its gradient raises the overlap, ``ce`` stays the soft cross-entropy it was, ``mixed`` is ce + W x lk, a
tiny training run with it finishes and logs its kind, a resume with another loss says so, and the command line
refuses bad values before any work."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import tiny_draft, tiny_target, tiny_training_data

from hf_eagle3.training.ttt import LOSS_KINDS, acceptance_loss, ttt_forward, ttt_loss


def _bound_draft(vocab=64, dv=32, hidden=32, seed=0):
    target = tiny_target("llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4)
    draft = tiny_draft(target, dv, seed=seed)
    draft.bind_target(target)
    return draft


def _batch(draft, seed, b=2, n=6):
    torch.manual_seed(seed)
    T, dv = draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits, mask = 3 * torch.randn(b, n, dv), torch.ones(b, n)
    mask[:, -1] = 0
    mask[0, 2] = 0.5  # a weighted position
    return feats, ids, tlogits, mask


def test_the_term_is_one_minus_the_overlap_and_zero_at_q_equal_p():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.3, 0.4, 0.1])
    # sum min(p, q) = 0.2 + 0.3 + 0.2 + 0 = 0.7
    got = acceptance_loss(p, q.log())
    assert float(got) == pytest.approx(0.3, abs=1e-6)
    assert float(got) == pytest.approx(0.5 * float((p - q).abs().sum()), abs=1e-6)  # = TV(p, q)
    # a batch: per row, and 0 where the draft's distribution is the target's
    rows = torch.softmax(torch.randn(3, 16, generator=torch.Generator().manual_seed(0)), -1)
    same = acceptance_loss(rows, rows.log() + 7.0)  # logits shifted by a constant: the same q
    assert same.shape == (3,) and torch.allclose(same, torch.zeros(3), atol=1e-6)
    # far apart: disjoint supports give 1
    assert float(acceptance_loss(torch.tensor([1.0, 0.0]), torch.tensor([-30.0, 30.0]))) == pytest.approx(1.0, abs=1e-6)


def test_one_sgd_step_on_the_term_raises_the_overlap():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(2 * torch.randn(8, 32, generator=g), -1)
    logits = torch.randn(8, 32, generator=g).requires_grad_(True)
    before = 1 - acceptance_loss(p, logits).detach()
    acceptance_loss(p, logits).sum().backward()
    assert logits.grad.abs().sum() > 0
    with torch.no_grad():
        after = 1 - acceptance_loss(p, logits - 1.0 * logits.grad)
    assert (after > before).all(), (before, after)
    # and through the draft: one SGD step on ttt_loss(loss="lk") raises the overlap it reports
    draft = _bound_draft()
    batch = _batch(draft, seed=2)
    loss, stats = ttt_loss(draft, *batch, ttt_length=2, loss="lk")
    loss.backward()
    with torch.no_grad():
        for w in draft.parameters():
            if w.grad is not None:
                w -= 0.5 * w.grad
    _, again = ttt_loss(draft, *batch, ttt_length=2, loss="lk")
    assert again["overlap"][0] > stats["overlap"][0] and again["overlap"][1] > stats["overlap"][1]


def _direct(draft, feats, ids, tlogits, mask, ttt_length, term):
    """The TTT loss computed position by position with ``term(p, logits)``, steps weighted 0.8**k."""
    steps = ttt_forward(draft, feats, ids, ttt_length)
    b, n = ids.shape
    total = 0.0
    for k in range(ttt_length):
        terms, weights = [], []
        for r in range(b):
            for t in range(n - 1):
                pos = t + 1 + k
                if pos < n and mask[r, pos] > 0:
                    terms.append(term(tlogits[r, pos].softmax(-1), draft.compute_logits(steps[k][r, t])))
                    weights.append(mask[r, pos])
        w = torch.stack(weights)
        total = total + 0.8**k * (torch.stack(terms) * w).sum() / w.sum()
    return total


def test_ce_is_unchanged_and_lk_and_mixed_are_what_they_say():
    draft = _bound_draft()
    batch = _batch(draft, seed=3)
    default, default_stats = ttt_loss(draft, *batch, ttt_length=2)
    ce, ce_stats = ttt_loss(draft, *batch, ttt_length=2, loss="ce")
    assert torch.equal(ce, default) and ce_stats == default_stats  # the default is ce, bit for bit

    def soft_ce(p, logits):
        return -(p * logits.log_softmax(-1)).sum()

    torch.testing.assert_close(ce, _direct(draft, *batch, 2, soft_ce), atol=1e-5, rtol=1e-5)
    lk, lk_stats = ttt_loss(draft, *batch, ttt_length=2, loss="lk")
    torch.testing.assert_close(lk, _direct(draft, *batch, 2, acceptance_loss), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lk, ce)
    # the overlap statistic is 1 - the lk step loss, whatever the loss trained
    for k in range(2):
        assert lk_stats["overlap"][k] == pytest.approx(1 - lk_stats["loss"][k], abs=1e-5)
        assert ce_stats["overlap"][k] == pytest.approx(lk_stats["overlap"][k], abs=1e-6)
    mixed, mixed_stats = ttt_loss(draft, *batch, ttt_length=2, loss="mixed", lk_weight=0.25)
    torch.testing.assert_close(mixed, ce + 0.25 * lk, atol=1e-5, rtol=1e-5)
    assert mixed_stats["acc"] == ce_stats["acc"]
    with pytest.raises(ValueError, match="loss='kl': use one of ce, lk, mixed"):
        ttt_loss(draft, *batch, ttt_length=2, loss="kl")
    with pytest.raises(ValueError, match="lk_weight must be a finite number > 0"):
        ttt_loss(draft, *batch, ttt_length=2, loss="mixed", lk_weight=0.0)


def test_a_tiny_mixed_run_finishes_logs_its_loss_and_a_resume_with_another_says_so(tmp_path):
    from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, init_draft, train

    feats, head, d2t, t2d = tiny_training_data(tmp_path)

    def run(lines, **overrides):
        torch.manual_seed(0)
        draft = init_draft(draft_config_for_target(head["config"], 64, intermediate_size=96), head, d2t, t2d)
        cfg = TrainConfig(**{**dict(ttt_length=2, batch_tokens=4096, mixed_precision="no", save_every=1000,
                                    warmup_steps=1, epochs=4, log_every=1, select_by="last"), **overrides})
        return train(draft, feats, tmp_path / "run", cfg, log=lines.append)

    lines = []
    run(lines, loss="mixed", lk_weight=0.5, max_steps=2)
    assert "loss: mixed (soft cross-entropy + 0.5 x the acceptance term 1 - sum min(p, q))" in lines
    assert lines[-1].startswith("training ended: max steps reached")
    config = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert config["loss"] == "mixed" and config["lk_weight"] == 0.5
    records_logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records_logged] == [1, 2]
    for r in records_logged:
        assert r["loss_kind"] == "mixed" and len(r["overlap"]) == 2 and all(0 < a <= 1 for a in r["overlap"])
        # mixed = ce + 0.5 x (1 - overlap) >= ce > 0; its value is finite
        assert torch.isfinite(torch.tensor(r["loss"])) and r["loss"] > 0.5 * (1 - r["overlap"][0])
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["objective"] == {
        "loss": "mixed", "lk_weight": 0.5}
    # resumed with another loss: trained on (like a changed --lr), and the log says the loss changes meaning
    lines = []
    run(lines, loss="ce", max_steps=3)
    assert any(line.startswith("the checkpoint (step 2) was trained with mixed (soft cross-entropy + 0.5 x ")
               and "training continues with ce (soft cross-entropy): the logged loss changes meaning from step 3"
               in line for line in lines), lines
    last = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["loss_kind"] == "ce"
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["loss"] == "ce"
    with pytest.raises(ValueError, match="loss='tv': use one of ce, lk, mixed"):
        run([], loss="tv")


def _parse(argv):
    from hf_eagle3.training.parsers import register

    parser = argparse.ArgumentParser("hf-eagle3-train")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_the_command_line_threads_the_loss_and_refuses_bad_values_before_any_work(tmp_path, capsys):
    from hf_eagle3.training import parsers
    from hf_eagle3.training.cli import _check_train_options, _train_config, main

    assert parsers.LOSS_KINDS == LOSS_KINDS  # the parser's copy (it must not import torch) is the trainer's
    base = ["train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]
    cfg = _train_config(_parse(base), "last")
    assert cfg.loss == "ce" and cfg.lk_weight == 1.0  # the default: today's objective
    cfg = _train_config(_parse(base + ["--loss", "mixed", "--lk-weight", "2.5"]), "last")
    assert cfg.loss == "mixed" and cfg.lk_weight == 2.5
    assert _train_config(_parse(base + ["--loss", "lk"]), "last").loss == "lk"
    assert _train_config(_parse(base + ["--loss", "mixed"]), "last").lk_weight == 1.0
    for bad, message in ((["--loss", "kl"], "argument --loss: invalid choice: 'kl'"),
                         (["--loss", "mixed", "--lk-weight", "-1"], "argument --lk-weight: -1: give a finite number > 0"),
                         (["--loss", "mixed", "--lk-weight", "x"], "argument --lk-weight: 'x' is not a number")):
        with pytest.raises(SystemExit) as exit_info:
            _parse(base + bad)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--lk-weight 2 weighs the acceptance term of --loss mixed; this run has "
                                         "--loss ce"):
        _check_train_options(_parse(base + ["--lk-weight", "2"]))
    with pytest.raises(SystemExit, match="--lk-weight 2 weighs"):
        main(base + ["--loss", "lk", "--lk-weight", "2"])
    assert not (tmp_path / "out").exists()  # refused before the data is read or anything is written
