"""``auto`` dtypes chosen by the hardware, options that explain themselves, a trainer that says what ended
it (and warns when the data is too small for its schedule), and malformed draft configs named."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from hf_eagle3.cli import build_parser
from hf_eagle3.loading import shipped_draft_path
from hf_eagle3.training import cli as train_cli
from hf_eagle3.training import hardware

SHIPPED_DRAFT = shipped_draft_path()


# --------------------------------------------------------------------------------------------------- auto dtype
@pytest.fixture
def cpu_flags(monkeypatch):
    """Stub the CPU flags (and report no CUDA): ``cpu_flags(has_bf16)``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def stub(has_bf16: bool):
        flags = {"avx2", "avx512f", "avx512_bf16"} if has_bf16 else {"avx2", "fma"}
        monkeypatch.setattr(hardware, "cpu_flags", lambda path="/proc/cpuinfo": flags)

    return stub


def test_auto_dtype_follows_the_cpu_flags(cpu_flags):
    cpu_flags(False)
    assert hardware.resolve_dtype("auto", "cpu") == (
        "float32", "dtype: auto -> float32 (no bf16 hardware: CPU flags lack avx512_bf16/amx_bf16)")
    assert hardware.resolve_dtype("auto", "cpu", label="mixed precision", bf16="bf16", fallback="no")[0] == "no"
    assert hardware.resolve_dtype("bfloat16", "cpu") == ("bfloat16", "dtype: bfloat16 (as given)")  # explicit wins
    cpu_flags(True)
    assert hardware.resolve_dtype("auto", "cpu") == ("bfloat16", "dtype: auto -> bfloat16 (CPU flags have avx512_bf16)")
    assert hardware.resolve_dtype("auto", "cpu", bf16="bf16", fallback="no")[0] == "bf16"
    assert hardware.resolve_dtype("float32", "cpu")[0] == "float32"


def test_auto_dtype_on_gpus_and_unknown_machines(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert hardware.resolve_dtype("auto", "cuda:1")[0] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert hardware.resolve_dtype("auto", "cuda") == (
        "float32", "dtype: auto -> float32 (no bf16 hardware: this GPU lacks bf16)")
    monkeypatch.setattr(hardware, "cpu_flags", lambda path="/proc/cpuinfo": None)  # no /proc/cpuinfo (macOS, ...)
    assert hardware.resolve_dtype("auto", "cpu")[0] == "float32"
    assert hardware.cpu_flags("/nonexistent/cpuinfo") is None


def test_prepare_and_train_default_to_auto_and_print_the_choice(cpu_flags, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "Hello?"}\n')  # prepare reads its data before loading
    parser = build_parser()
    args = parser.parse_args(["prepare", "--prompts", "p.jsonl", "--out", "o"])
    assert args.dtype == "auto"
    train = parser.parse_args(["train", "--data", "d", "--out", "o"])
    assert (train.feature_dtype, train.mixed_precision) == ("auto", "auto")

    from hf_eagle3.training import prepare as prepare_module

    loaded = []
    monkeypatch.setattr(train_cli, "load_target",
                        lambda name, dtype, device=None, **kw: loaded.append(dtype) or (None, None))
    monkeypatch.setattr(prepare_module, "prepare", lambda *a, **kw: None)
    cases = [(False, [], "float32"), (True, [], "bfloat16"),  # auto follows the hardware; explicit values win
             (False, ["--dtype", "bfloat16"], "bfloat16"), (True, ["--dtype", "float32"], "float32")]
    for has_bf16, argv, expected in cases:
        cpu_flags(has_bf16)
        args = parser.parse_args(["prepare", "--prompts", "p.jsonl", "--out", "o", "--device", "cpu"] + argv)
        train_cli.cmd_prepare(args)
        assert loaded[-1] == expected
        assert f"dtype: {'auto -> ' if not argv else ''}{expected}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------- help lines
def _subparsers(parser: argparse.ArgumentParser, path=()):
    """Every (sub)command parser under ``parser``, with its command path."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _subparsers(sub, path + (name,))


# Options of `bench` (hf_eagle3/cli.py, owned elsewhere) whose help does not state a default yet; remove an entry
# once its help says it.
KNOWN_WITHOUT_DEFAULT = set()


def test_every_option_of_every_command_explains_itself_and_its_default():
    commands = dict(_subparsers(build_parser()))
    assert {("demo",), ("bench",), ("prepare",), ("train",), ("export",)} <= set(commands)
    problems = []
    for path, parser in commands.items():
        parser.format_help()  # renders
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            text = action.help or ""
            if not text.strip() or text == argparse.SUPPRESS:
                problems.append(f"{' '.join(path)} {name}: no help")
            takes_value = action.option_strings and action.nargs != 0 and not action.required
            if takes_value and "default" not in text.lower() and (path[0], name) not in KNOWN_WITHOUT_DEFAULT:
                problems.append(f"{' '.join(path)} {name}: help names no default ({text!r})")
    assert not problems, "\n".join(problems)


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
    from hf_eagle3.training.features import cache_features
    from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, init_draft, train
    from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens

    target = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt_ids": torch.randint(4, 256, (6,), generator=g).tolist(),
                "response_ids": torch.randint(4, 256, (10,), generator=g).tolist()} for i in range(4)]
    feats = tmp_path / "features"
    cache_features(target, records, feats, [2, 3, 3], per_shard=2, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)

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


# ------------------------------------------------------------------------------------------------ malformed config
def _shipped_copy(tmp_path, edit) -> Path:
    path = tmp_path / "draft"
    shutil.copytree(SHIPPED_DRAFT, path)
    cfg = json.loads((path / "config.json").read_text())
    text = edit(cfg)
    (path / "config.json").write_text(text if isinstance(text, str) else json.dumps(cfg))
    return path


@pytest.mark.parametrize("loader", ["config", "model"])
def test_a_draft_config_without_a_required_field_names_file_and_field(tmp_path, loader):
    from hf_eagle3 import Eagle3Config, Eagle3DraftModel
    from hf_eagle3.core.configuration_eagle3 import DraftConfigError

    path = _shipped_copy(tmp_path, lambda cfg: cfg.pop("vocab_size"))
    load = Eagle3Config.from_pretrained if loader == "config" else Eagle3DraftModel.from_pretrained
    with pytest.raises(DraftConfigError, match=r"field 'vocab_size' is missing; expected a positive integer") as err:
        load(path)
    assert isinstance(err.value, ValueError) and str(path / "config.json") in str(err.value)
    # no model_type either (read as the flat layout): still a DraftConfigError naming the field, not a bare KeyError
    path = tmp_path / "flat"
    shutil.copytree(tmp_path / "draft", path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["model_type"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftConfigError, match="field 'vocab_size' is missing"):
        Eagle3DraftModel.from_pretrained(path)
    with pytest.raises(DraftConfigError, match=r"field 'hidden_size' is 'wide'; expected a positive integer"):
        load(_shipped_copy(tmp_path / "typed", lambda cfg: cfg.update(hidden_size="wide")))


def test_a_draft_config_that_is_not_json_names_the_file(tmp_path):
    from hf_eagle3 import Eagle3Config, Eagle3DraftModel
    from hf_eagle3.core.config_layouts import config_dict_to_native
    from hf_eagle3.core.configuration_eagle3 import DraftConfigError, read_config_file

    path = _shipped_copy(tmp_path, lambda cfg: json.dumps(cfg)[:-20])
    for load in (Eagle3Config.from_pretrained, Eagle3DraftModel.from_pretrained,
                 lambda p: read_config_file(p / "config.json")):
        with pytest.raises(DraftConfigError, match=r"config\.json: not valid JSON \(.*line 1") as err:
            load(path)
        assert str(path / "config.json") in str(err.value)
    with pytest.raises(DraftConfigError, match="expected a JSON object"):
        config_dict_to_native([1, 2], source="x/config.json")
    spec = {"speculators_model_type": "eagle3", "transformer_layer_config": {"vocab_size": 10, "hidden_size": 8,
                                                                           "intermediate_size": 16}}
    field = r"x\.json: field 'transformer_layer_config\.num_attention_heads' is missing"
    with pytest.raises(DraftConfigError, match=field):
        config_dict_to_native(spec, source="x.json")
