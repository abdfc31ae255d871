"""``hf-eagle3 export --format openvino``: checks, the layer list GenAI reads, and the conversion steps around
optimum-cli, here with a stand-in program (the real optimum-intel and OpenVINO GenAI run in
tests/interop/test_openvino_interop.py, in a venv of their own)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import cached_target, tiny_draft

from hf_eagle3 import Eagle3Config
from hf_eagle3.checkpoints.export import export_draft, export_openvino
from hf_eagle3.checkpoints.openvino import check_openvino_layout, openvino_layer_ids, write_openvino_layers
from hf_eagle3.loading import shipped_draft_path

IR_XML = """<?xml version="1.0"?>
<net name="Model0" version="11">
\t<layers />
\t<edges />
\t<rt_info>
\t\t<Runtime_version value="2026.4.1" />
\t\t<eagle3_mode value="True" />
\t\t<optimum><optimum_intel_version value="2.2.0" /></optimum>
\t</rt_info>
</net>
"""


def _rt_info(path: Path) -> dict[str, list[str]]:
    rt_info = ET.parse(path).getroot().find("rt_info")
    return {child.tag: [c.get("value") for c in rt_info.findall(child.tag)] for child in rt_info}


def fake_optimum_cli(tmp_path: Path, fail: bool = False) -> Path:
    """A stand-in for optimum-cli: checks the arguments hf-eagle3 passes, logs the call, writes an IR as optimum-intel
    leaves it (``eagle3_mode`` but no layer list), or fails."""
    program = tmp_path / "bin" / "optimum-cli"
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import json, shutil, sys
        from pathlib import Path
        args = sys.argv[1:]
        open({str(tmp_path / "calls.log")!r}, "a").write(" ".join(args) + "\\n")
        assert args[:3] == ["export", "openvino", "-m"] and "--trust-remote-code" in args, args
        assert args[args.index("--task") + 1] == "text-generation-with-past", args
        flat, out = Path(args[3]), Path(args[-1])
        config = json.loads((flat / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"], config
        if {fail!r}:
            print("conversion failed on purpose", file=sys.stderr)
            sys.exit(3)
        out.mkdir(parents=True)
        (out / "openvino_model.xml").write_text({IR_XML!r})
        (out / "openvino_model.bin").write_bytes(b"weights")
        shutil.copy(flat / "config.json", out / "config.json")
        print("weight format", args[args.index("--weight-format") + 1])
    """))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return program


def test_layer_ids_in_genai_convention():
    shipped = Eagle3Config.from_pretrained(shipped_draft_path())
    assert shipped.feature_layer_ids == [2, 15, 27]
    assert openvino_layer_ids(shipped) == [1, 14, 26]  # outputs of layers 1, 14, 26 = inputs of 2, 15, 27
    unpinned = Eagle3Config(vocab_size=64, hidden_size=32, num_attention_heads=4)
    assert openvino_layer_ids(unpinned, num_target_layers=32) == [1, 15, 28]  # reference [2, 16, 29] minus one
    with pytest.raises(ValueError, match="--target"):
        openvino_layer_ids(unpinned)
    with pytest.raises(ValueError, match="index 0"):
        openvino_layer_ids(Eagle3Config(vocab_size=64, hidden_size=32, num_attention_heads=4,
                                        feature_layer_ids=[0, 2, 3]))


@pytest.mark.parametrize("variant", [
    {"norm_before_residual": True}, {"norm_output": True}, {"norm_before_fc": True}, {"fc_norm": True},
    {"qk_norm": True}, {"draft_sliding_window": 64}, {"partial_rotary_factor": 0.5}, {"attention_bias": True},
    {"has_embed_tokens": True},
])
def test_layouts_genai_cannot_run_are_refused(variant):
    check_openvino_layout(Eagle3Config(vocab_size=64, hidden_size=32, num_attention_heads=4))
    name = next(iter(variant)).replace("draft_sliding_window", "sliding-window").replace("has_embed_tokens", "embedding")
    with pytest.raises(ValueError, match=name):
        check_openvino_layout(Eagle3Config(vocab_size=64, hidden_size=32, num_attention_heads=4, **variant))


def test_write_layers_keeps_other_entries_and_is_idempotent(tmp_path):
    (tmp_path / "openvino_model.xml").write_text(IR_XML)
    for _ in range(2):
        write_openvino_layers(tmp_path, [1, 14, 26])
        info = _rt_info(tmp_path / "openvino_model.xml")
        assert info["eagle3_mode"] == ["True"] and info["hidden_layers_list"] == ["1 14 26"]
        assert info["Runtime_version"] == ["2026.4.1"] and "optimum" in info
    with pytest.raises(FileNotFoundError, match="optimum-cli export openvino"):
        write_openvino_layers(tmp_path / "missing", [1, 2, 3])


def test_export_runs_optimum_cli_and_writes_the_layers(tmp_path):
    draft = tiny_draft(cached_target(), draft_vocab_size=64, feature_layer_ids=[1, 2, 3])
    program = fake_optimum_cli(tmp_path)
    out = export_draft(draft, tmp_path / "out" / "draft", format="openvino", optimum_cli=program)
    info = _rt_info(out / "openvino_model.xml")
    assert info["hidden_layers_list"] == ["0 1 2"] and info["eagle3_mode"] == ["True"]
    assert (out / "openvino_model.bin").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["draft"]  # no temporary folder left
    assert "--weight-format fp32" in (tmp_path / "calls.log").read_text()
    export_draft(draft, tmp_path / "out16", format="openvino", optimum_cli=program, dtype="fp16")
    assert (tmp_path / "calls.log").read_text().splitlines()[-1].count("--weight-format fp16") == 1


def test_export_failures_leave_nothing_behind(tmp_path):
    target = cached_target()
    draft = tiny_draft(target, draft_vocab_size=64, feature_layer_ids=[1, 2, 3])
    out = tmp_path / "out" / "draft"
    with pytest.raises(RuntimeError, match="conversion failed on purpose"):
        export_openvino(draft, out, optimum_cli=fake_optimum_cli(tmp_path / "failing", fail=True))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    program = fake_optimum_cli(tmp_path)
    # Refused before optimum-cli runs: a layout GenAI cannot run, bf16 weights, an occupied output folder.
    with pytest.raises(ValueError, match="norm_before_fc"):
        export_openvino(tiny_draft(target, feature_layer_ids=[1, 2, 3], norm_before_fc=True), out,
                        optimum_cli=program)
    with pytest.raises(ValueError, match="fp32 or fp16"):
        export_openvino(draft, out, optimum_cli=program, dtype="bf16")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        export_openvino(draft, tmp_path / "busy", optimum_cli=program)
    assert not (tmp_path / "calls.log").exists()
    with pytest.raises(FileNotFoundError, match="--optimum-cli"):
        export_openvino(draft, out, optimum_cli=tmp_path / "nowhere" / "optimum-cli")
    with pytest.raises(ValueError, match="--optimum-cli only applies"):
        export_draft(draft, tmp_path / "flat", format="flat", optimum_cli=program)


def test_cli(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path / "empty"))
    base = [sys.executable, "-m", "hf_eagle3.cli", "export", str(shipped_draft_path())]
    done = subprocess.run(base + [str(tmp_path / "a"), "--optimum-cli", "x"], capture_output=True, text=True)
    assert done.returncode == 2 and "--optimum-cli only applies to --format openvino" in done.stderr
    done = subprocess.run(base + [str(tmp_path / "b"), "--format", "openvino"], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 1 and "optimum-cli is not on PATH" in done.stderr, done.stderr
    assert not (tmp_path / "b").exists()
    program = fake_optimum_cli(tmp_path)
    done = subprocess.run(base + [str(tmp_path / "c"), "--format", "openvino", "--optimum-cli", str(program)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _rt_info(tmp_path / "c" / "openvino_model.xml")["hidden_layers_list"] == ["1 14 26"]
    assert json.loads((tmp_path / "c" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
