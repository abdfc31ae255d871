"""The shipped draft in OpenVINO GenAI, exported by ``hf-eagle3 export --format openvino``.

optimum-intel 2.2.0 pins ``transformers<5.6`` while hf-eagle3 needs ``>=5.20``, so this file is not collected by the
main suite (``norecursedirs`` in pyproject.toml): ``.ci/run`` runs it by path in a venv of its own (``.ci/ovvenv``:
optimum-intel, openvino, openvino-genai), with ``HF_EAGLE3_PYTHON`` naming a python that has hf-eagle3 (the
main venv), as a user runs the two environments side by side.

What is proven, on SmolLM2-135M-Instruct and the shipped draft, fp32 (``INFERENCE_PRECISION_HINT=f32``), greedy,
a constant 5 draft tokens per round, the built-in prompts:

* ``hf-eagle3 export --format openvino --optimum-cli ...`` (run in hf-eagle3's environment) writes an IR whose
  ``rt_info`` GenAI reads as the draft's captured layers, in GenAI's output-of-layer convention;
* GenAI's speculative output equals GenAI's own plain decoding of the target, prompt for prompt;
* GenAI accepts as many draft tokens as hf-eagle3 does on the same prompt ids (total within 5 %);
* negative control: the same IR without the layer list (what ``optimum-cli`` alone writes) makes GenAI fall back to
  its default layers, and the total accepted drops by more than 5 % while the outputs stay equal, so a regression
  of the layer list fails the test above.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
import pytest

ROOT = Path(__file__).resolve().parents[2]
HF_EAGLE3_PYTHON = os.environ.get("HF_EAGLE3_PYTHON")
OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")
F32 = {"INFERENCE_PRECISION_HINT": "f32"}
TOLERANCE = 0.05



def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """hf-eagle3's reference decoding, the draft exported by hf-eagle3 and the target converted by optimum-cli."""
    if HF_EAGLE3_PYTHON is None:
        pytest.fail("set HF_EAGLE3_PYTHON to a python that has hf-eagle3 (e.g. .ci/venv/bin/python)")
    work = tmp_path_factory.mktemp("openvino")
    _run([HF_EAGLE3_PYTHON, "tests/interop/openvino_reference.py", str(work / "ref.json")])
    _run([HF_EAGLE3_PYTHON, "-m", "hf_eagle3.cli", "export", "examples/drafts/smollm2-135m-eagle3", str(work / "draft"),
          "--format", "openvino", "--optimum-cli", OPTIMUM_CLI])
    ref = json.loads((work / "ref.json").read_text())
    _run([OPTIMUM_CLI, "export", "openvino", "-m", ref["target"], "--task", "text-generation-with-past",
          "--weight-format", "fp32", str(work / "target")])
    return work, ref


def _decode(target: Path, draft: Path | None, ref: dict) -> tuple[list[list[int]], int]:
    """GenAI's greedy outputs for the reference prompt ids, and the total accepted draft tokens."""
    kwargs = {"draft_model": ov_genai.draft_model(str(draft), "CPU", **F32)} if draft is not None else {}
    pipe = ov_genai.LLMPipeline(str(target), "CPU", **kwargs, **F32)
    config = ov_genai.GenerationConfig(max_new_tokens=ref["max_new_tokens"])
    if draft is not None:
        config.num_assistant_tokens = ref["k"]
    outputs, accepted = [], 0
    for row in ref["rows"]:
        result = pipe.generate(ov.Tensor(np.array([row["prompt_ids"]], dtype=np.int64)), config)
        outputs.append([int(t) for t in result.tokens[0]])
        if draft is not None:
            accepted += result.extended_perf_metrics.get_num_accepted_tokens()
    return outputs, accepted


def test_genai_runs_the_exported_draft_at_hf_eagle3_acceptance(converted):
    work, ref = converted
    model = ov.Core().read_model(str(work / "draft" / "openvino_model.xml"))
    assert model.get_rt_info("eagle3_mode").astype(str) == "True"
    assert model.get_rt_info("hidden_layers_list").astype(str).split() == ["1", "14", "26"]  # our 2, 15, 27 minus 1

    plain, _ = _decode(work / "target", None, ref)
    spec, accepted = _decode(work / "target", work / "draft", ref)
    assert spec == plain
    ours = sum(row["accepted"] for row in ref["rows"])
    assert abs(accepted - ours) <= TOLERANCE * ours, (accepted, ours)

    # Negative control: the layer list removed, as optimum-cli alone leaves the IR.
    bare = work / "draft_without_layers"
    shutil.copytree(work / "draft", bare)
    tree = ET.parse(bare / "openvino_model.xml")
    rt_info = tree.getroot().find("rt_info")
    rt_info.remove(rt_info.find("hidden_layers_list"))
    tree.write(bare / "openvino_model.xml", encoding="utf-8", xml_declaration=True)
    fallback, accepted_default = _decode(work / "target", bare, ref)
    assert fallback == plain
    assert accepted_default < (1 - TOLERANCE) * ours, (accepted_default, ours)
    print(f"accepted draft tokens: hf-eagle3 {ours}, GenAI {accepted}, GenAI without the layer list {accepted_default}")
