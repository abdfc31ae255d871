"""``hf-eagle3 ... --help`` answers without importing torch or Transformers (they load after parsing), and a command
still finds the package installed (``generate`` hooked, the draft registered) once it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_eagle3.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)
HEAVY = ("torch", "transformers")


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _modules_after(*argv: str) -> set[str]:
    """The top-level modules a fresh ``python -X importtime -m hf_eagle3.cli ARGV`` imported (its import log)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_eagle3.cli", *argv], capture_output=True,
                         text=True, env=_env(), cwd=ROOT, timeout=120)
    assert run.returncode in (0, 2), run.stderr[-2000:]
    lines = [line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert lines, "no import log"
    return {name.split(".")[0] for name in lines}


def test_the_subcommands_are_the_documented_ones():
    assert {"demo", "bench", "calibrate", "prepare", "train", "evaluate", "export", "check"} <= set(COMMANDS)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_imports_neither_torch_nor_transformers(command):
    loaded = _modules_after(*([command] if command else []), "--help")
    assert "hf_eagle3" in loaded and "argparse" in loaded
    assert not loaded & set(HEAVY), f"`hf-eagle3 {command or ''} --help` imported {sorted(loaded & set(HEAVY))}"


def test_a_wrong_option_is_refused_before_torch_loads():
    loaded = _modules_after("bench", "--no-such-option")
    assert not loaded & set(HEAVY)


def test_a_plain_import_still_installs_everything():
    """Outside the command's own process, ``import hf_eagle3`` registers the draft and hooks ``generate`` at once."""
    code = ("import sys, hf_eagle3\n"
            "from transformers import AutoConfig\n"
            "assert hf_eagle3._installed and 'torch' in sys.modules\n"
            "AutoConfig.for_model('eagle3_draft')\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_a_command_runs_installed():
    """The command's process installs once its arguments are parsed: a command (here one standing in for
    ``calibrate``) finds the draft registered with ``AutoConfig`` and the public names bound."""
    code = ("import runpy, sys\n"
            "sys.orig_argv = [sys.executable, '-m', 'hf_eagle3.cli', *sys.argv[1:]]  # as `python -m` sets it\n"
            "import hf_eagle3\n"
            "assert not hf_eagle3._installed and 'torch' not in sys.modules\n"
            "import hf_eagle3.bench.calibrate as calibrate\n"
            "def stand_in(args):\n"
            "    from transformers import AutoConfig\n"
            "    AutoConfig.for_model('eagle3_draft')\n"
            "    print('installed', hf_eagle3._installed, 'Eagle3DraftModel' in vars(hf_eagle3))\n"
            "calibrate.calibrate_command = stand_in\n"
            "runpy.run_module('hf_eagle3.cli', run_name='__main__', alter_sys=True)\n")
    run = subprocess.run([sys.executable, "-c", code, "calibrate", "--show"], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "installed True True" in run.stdout
