"""A trainer that says what ended it (epochs, steps, the time budget) and warns when the data is too small for its
schedule, naming what to change."""

from __future__ import annotations

from conftest import tiny_training_data


# --------------------------------------------------------------------------------------- schedule and end reason
def test_schedule_warning_names_what_to_change():
    from hf_eagle3.training.trainer import TrainConfig, schedule_warning

    assert schedule_warning(100, TrainConfig(epochs=2, warmup_steps=50)) is None
    one = schedule_warning(1, TrainConfig(epochs=1, warmup_steps=50, max_minutes=1.5))
    assert "1 optimiser step(s) per epoch" in one and "fewer than the 50 warm-up steps" in one
    for hint in ("Add data", "--batch-tokens", "--epochs", "--warmup-steps", "--max-minutes"):
        assert hint in one
    short = schedule_warning(10, TrainConfig(epochs=2, warmup_steps=50))
    assert "per epoch" not in short and "20 step(s) in all" in short
    assert "5 step(s) in all" in schedule_warning(10, TrainConfig(epochs=2, warmup_steps=50, max_steps=5))


def test_train_warns_about_small_data_and_says_what_ended_it(tmp_path):
    from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, init_draft, train

    feats, head, d2t, t2d = tiny_training_data(tmp_path)

    def run(name, **overrides):
        lines = []
        draft = init_draft(draft_config_for_target(head["config"], 64, intermediate_size=96), head, d2t, t2d)
        cfg = TrainConfig(ttt_length=2, batch_tokens=4096, mixed_precision="no", save_every=1000, **overrides)
        train(draft, feats, tmp_path / name, cfg, log=lines.append)
        assert lines[-1].startswith("selected the checkpoint of step ")  # after the end line, the selection's
        return lines[:-1]

    lines = run("epochs", epochs=3, warmup_steps=50)  # one training shard of 2 short records: one batch per epoch
    assert lines[0] == "mixed precision: no (as given)"
    warnings = [line for line in lines if line.startswith("warning: the data is small")]
    assert len(warnings) == 1 and "1 optimiser step(s) per epoch" in warnings[0]
    assert lines[-1] == "training ended: epochs done (3 epoch(s), 3 step(s))"
    lines = run("budget", epochs=1, warmup_steps=1, max_minutes=10.0)
    assert lines[-1].startswith("training ended: epochs done (1 epoch(s), 1 step(s)), ")
    assert "of the 10 minutes of --max-minutes used: raise --epochs" in lines[-1]
    assert run("steps", epochs=5, max_steps=2, warmup_steps=1)[-1].startswith("training ended: max steps reached")
    ended = run("time", epochs=100, max_minutes=1e-6, warmup_steps=1)[-1]
    assert ended.startswith("training ended: time budget reached (--max-minutes 1e-06, 1 step(s), in epoch 1 of 100)")
