"""``auto`` dtypes chosen by the hardware (:mod:`hf_eagle3.training.hardware`): the CPU flags or the GPU decide, an
explicit value wins, and ``prepare`` / ``train`` default to ``auto`` and print the choice."""

from __future__ import annotations

import pytest
import torch

from hf_eagle3.cli import build_parser
from hf_eagle3.training import cli as train_cli
from hf_eagle3.training import hardware


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
