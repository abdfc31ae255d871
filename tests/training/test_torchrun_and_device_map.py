"""Training data and drafts at the scale users have: ``hf-eagle3 prepare`` and ``train`` launched by ``torchrun``
on two processes (gloo on this CPU), and ``prepare`` with a target spread by ``device_map`` (layers offloaded)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_eagle3.smollm2 import smollm2_path
from hf_eagle3.training.prepare import iter_records, prepare

CONVERSATIONS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]
                  + ([{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
                     if i % 3 == 0 else [])} for i in range(9)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama target with SmolLM2's tokenizer, saved where ``--target`` can load it."""
    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    path = tmp_path_factory.mktemp("target")
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    target.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _torchrun(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "hf_eagle3.cli", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_torchrun_prepare_then_train_with_fsdp(saved, tmp_path):
    """``torchrun --nproc-per-node 2 hf-eagle3 prepare``: each process answers its own conversations (every turn
    once, features included, every process's files apart); then ``torchrun ... train --fsdp`` on those features saves
    one draft, chosen on the held-out shard, that decodes losslessly."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out, feats = tmp_path / "responses", tmp_path / "features"
    common = ["--target", str(saved), "--prompts", str(data), "--out", str(out), "--features-dir", str(feats),
              "--max-new-tokens", "6", "--batch-size", "2", "--dtype", "float32", "--max-feature-prompt-tokens", "64"]
    _torchrun("prepare", *common)
    keys = [(r["id"], r.get("turn", 0)) for r in iter_records(out)]
    expected = sorted([(c["id"], 0) for c in CONVERSATIONS] + [(c["id"], 1) for c in CONVERSATIONS[::3]])
    assert sorted(keys) == expected  # every turn once
    assert sorted(p.name for p in out.iterdir()) == ["responses-p0-00000.jsonl", "responses-p1-00000.jsonl"]
    in_shards = sorted((x["id"], x["turn"]) for p in feats.glob("shard-p*.pt")
                       for x in torch.load(p, weights_only=False))
    assert in_shards == expected and {p.name[:9] for p in feats.glob("shard-*.pt")} == {"shard-p0-", "shard-p1-"}
    _torchrun("prepare", *common)  # a rerun finds everything answered
    assert sorted((r["id"], r.get("turn", 0)) for r in iter_records(out)) == expected

    run = tmp_path / "run"
    proc = _torchrun("train", "--target", str(saved), "--data", str(out), "--out", str(run), "--features-dir",
                     str(feats), "--skip-features", "--fsdp", "--draft-vocab-size", "64", "--epochs", "3",
                     "--batch-tokens", "128", "--warmup-steps", "1", "--ttt-length", "2", "--save-every", "1",
                     "--mixed-precision", "no", "--save-dtype", "float32")
    summary = json.loads((run / "draft" / "training_summary.json").read_text())
    assert summary["selection"]["selected_step"] >= 1 and summary["holdout"]["chain"]["k"] == 5
    assert proc.stdout.count("saved ") == 1  # one process saves
    import hf_eagle3

    draft = hf_eagle3.Eagle3DraftModel.from_pretrained(run / "draft")
    target = AutoModelForCausalLM.from_pretrained(saved).eval()
    ids = torch.tensor([next(iter_records(out))["prompt_ids"]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False), plain)


def test_prepare_with_a_target_spread_over_devices(saved, tmp_path):
    """A target placed by ``device_map`` with layers offloaded to disk (accelerate's hooks move the weights in):
    the same answers and the same features as the target in one piece."""
    tok = AutoTokenizer.from_pretrained(saved)
    whole = AutoModelForCausalLM.from_pretrained(saved).eval()
    n = whole.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "disk" if i in (1, n - 1) else "cpu" for i in range(n)}}
    spread = AutoModelForCausalLM.from_pretrained(saved, device_map=device_map,
                                                  offload_folder=str(tmp_path / "offload")).eval()
    assert spread.hf_device_map["model.layers.1"] == "disk"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS[:4]))
    kwargs = dict(max_new_tokens=5, batch_size=2, progress=False, layer_ids=[1, 2, n - 1],
                  feature_dtype=torch.float32, log=lambda s: None)
    for name, model in (("whole", whole), ("spread", spread)):
        prepare(model, tok, data, tmp_path / name, features_dir=tmp_path / f"{name}-features", **kwargs)
    assert list(iter_records(tmp_path / "whole")) == list(iter_records(tmp_path / "spread"))
    for a, b in zip(sorted((tmp_path / "whole-features").glob("shard-*.pt")),
                    sorted((tmp_path / "spread-features").glob("shard-*.pt"))):
        for x, y in zip(torch.load(a, weights_only=False), torch.load(b, weights_only=False)):
            torch.testing.assert_close(x["features"], y["features"])
            assert torch.equal(x["target_argmax"], y["target_argmax"])
