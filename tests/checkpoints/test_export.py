"""Exports: trust_remote_code bundles loaded where hf_eagle3 is NOT importable, flat / speculators round trips, the
draft-length schedule every format saves (``"auto"`` unless told), and the target's embedding in speculators exports."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import cached_target, random_prompt, tiny_draft, tiny_target
from safetensors import safe_open

import hf_eagle3
from hf_eagle3.checkpoints.export import (
    AUTO_MAP,
    CORE_FILES,
    export_draft,
    export_flat,
    export_native,
    export_remote_code,
    export_speculators,
    register,
)

REPO_ROOT = Path(hf_eagle3.__file__).resolve().parent.parent
PROMPT = [[1, 5, 9, 20, 33, 7, 2, 11]]
NEW_TOKENS = 24

# Runs in a fresh interpreter (`python -I`: no PYTHONPATH, no user site, no cwd on sys.path). It removes every way
# the hf_eagle3 install exposes itself (the repository root on sys.path, the meta-path finder of a setuptools
# editable install), or, for a regular install next to torch in site-packages, puts a blocking finder in front;
# then checks that `import hf_eagle3` fails before touching the bundles.
ISOLATED_SCRIPT = textwrap.dedent(
    r"""
    import importlib.util, json, os, sys

    repo_root = os.path.realpath(sys.argv[1])
    spec_file, out_file = sys.argv[2], sys.argv[3]

    def exposes_repo(entry):  # the repository root itself (not the venv that may live below it)
        return os.path.realpath(entry or os.getcwd()) == repo_root

    sys.path[:] = [p for p in sys.path if not exposes_repo(p)]
    for finder in list(sys.meta_path):
        if type(finder).__module__.startswith("_frozen_importlib"):
            continue
        try:
            found = finder.find_spec("hf_eagle3", None)
        except Exception:
            found = None
        if found is not None:
            sys.meta_path.remove(finder)
    importlib.invalidate_caches()
    isolation = "removed"
    if importlib.util.find_spec("hf_eagle3") is not None:  # a regular install, in the same site-packages as torch

        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "hf_eagle3" or name.startswith("hf_eagle3."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, _Block())
        isolation = "blocked"
    else:
        assert importlib.util.find_spec("hf_eagle3") is None
    try:
        import hf_eagle3  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("isolation failed: hf_eagle3 is importable")
    assert not any(m == "hf_eagle3" or m.startswith("hf_eagle3.") for m in sys.modules)
    assert os.path.realpath(os.getcwd()) != repo_root and not os.path.exists("hf_eagle3")

    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    spec = json.load(open(spec_file))
    target = AutoModelForCausalLM.from_pretrained(spec["target"]).eval()
    ids = torch.tensor(spec["prompt"])
    ref = target.generate(ids, max_new_tokens=spec["new_tokens"], do_sample=False)
    probe = torch.load(spec["probe"])
    results = {"isolation": isolation, "bundles": {}}
    for name, bundle in spec["bundles"].items():
        res = {}
        try:
            AutoModel.from_pretrained(bundle, trust_remote_code=False)
            res["refusal"] = None
        except ValueError as err:
            res["refusal"] = str(err)
        draft = AutoModel.from_pretrained(bundle, trust_remote_code=True)
        res["class"] = type(draft).__name__
        res["module"] = type(draft).__module__
        res["num_assistant_tokens"] = draft.generation_config.num_assistant_tokens
        res["feature_layer_ids"] = draft.config.feature_layer_ids
        out = target.generate(ids, max_new_tokens=spec["new_tokens"], do_sample=False, assistant_model=draft)
        res["identical"] = bool(torch.equal(out, ref))
        res["tokens"] = out[0].tolist()
        res["num_drafts"] = None if draft.last_stats is None else draft.last_stats.num_drafts
        # A left-padded batch of two (the batched loop) and a tree (the tree loop), from the bundle's files too.
        batch = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[:, 2:]], -1), ids])
        mask = (batch != 0).long()
        mask[1] = 1
        plain = target.generate(batch, attention_mask=mask, max_new_tokens=spec["new_tokens"], do_sample=False)
        for kwargs in ({}, {"tree_total_tokens": 6, "tree_depth": 3, "tree_top_k": 2}):
            out = target.generate(batch, attention_mask=mask, max_new_tokens=spec["new_tokens"], do_sample=False,
                                  assistant_model=draft, **kwargs)
            res["batched_identical" + ("_tree" if kwargs else "")] = bool(torch.equal(out, plain))
        out = target.generate(ids, max_new_tokens=spec["new_tokens"], do_sample=False, assistant_model=draft,
                              tree_total_tokens=6, tree_depth=3, tree_top_k=2)
        res["tree_identical"] = bool(torch.equal(out, ref))
        with torch.no_grad():
            draft.bind_target(target)
            logits = draft(input_ids=probe["input_ids"], target_features=probe["features"]).logits
        res["probe_max_abs_diff"] = float((logits.float() - probe["logits"]).abs().max())
        results["bundles"][name] = res
    results["hf_eagle3_in_sys_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "hf_eagle3")
    results["remote_modules"] = sorted(m for m in sys.modules if m.startswith("transformers_modules"))
    json.dump(results, open(out_file, "w"))
    """
)


def _probe(draft, target):
    """Fixed inputs and the draft's logits on them (float32), for an exact comparison across processes."""
    torch.manual_seed(5)
    features = torch.randn(1, 5, 3 * target.config.hidden_size)
    input_ids = torch.randint(0, target.config.vocab_size, (1, 5))
    draft.bind_target(target)
    with torch.no_grad():
        logits = draft(input_ids=input_ids, target_features=features).logits.float()
    return {"features": features, "input_ids": input_ids, "logits": logits}


def _cli(argv):
    parser = argparse.ArgumentParser(prog="hf-eagle3")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def isolated_run(tmp_path_factory):
    """Export a tiny draft three ways (native, and converted from flat and speculators), load all three bundles in
    ONE isolated subprocess, and return (results, in-process reference tokens, bundle dirs)."""
    tmp = tmp_path_factory.mktemp("remote")
    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab_size=200, feature_layer_ids=[1, 3, 4])
    draft.generation_config.num_assistant_tokens = 4
    target.save_pretrained(tmp / "target")

    ids = torch.tensor(PROMPT)
    ref = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    with_draft = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft)
    assert torch.equal(ref, with_draft)
    torch.save(_probe(draft, target), tmp / "probe.pt")

    bundles = {"native": tmp / "bundle_native", "flat": tmp / "bundle_flat", "speculators": tmp / "bundle_spec"}
    export_remote_code(draft, bundles["native"])
    export_flat(draft, tmp / "flat")
    export_speculators(draft, tmp / "spec")
    # Converted with the command line, as a user would do with a published checkpoint.
    assert _cli(["export", str(tmp / "flat"), str(bundles["flat"]), "--remote-code"]) == 0
    assert _cli(["export", str(tmp / "spec"), str(bundles["speculators"]), "--remote-code"]) == 0

    copies_match = {  # checked right after writing (other edits of the working tree may follow)
        (name, f): (bundle / f).read_bytes() == (REPO_ROOT / "hf_eagle3" / "core" / f).read_bytes()
        for name, bundle in bundles.items()
        for f in CORE_FILES
    }
    spec = {
        "target": str(tmp / "target"),
        "prompt": PROMPT,
        "new_tokens": NEW_TOKENS,
        "probe": str(tmp / "probe.pt"),
        "bundles": {k: str(v) for k, v in bundles.items()},
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    workdir = tmp / "cwd"
    workdir.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTHON") and k not in ("HF_MODULES_CACHE", "HF_HOME", "TRANSFORMERS_CACHE")
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONNOUSERSITE="1",
        HF_HOME=str(tmp / "hf_home"),
        HF_MODULES_CACHE=str(tmp / "hf_modules"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", ISOLATED_SCRIPT, str(REPO_ROOT), str(tmp / "spec.json"), str(tmp / "out.json")],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text()), ref[0].tolist(), bundles, copies_match


def test_bundle_files(isolated_run):
    _, _, bundles, copies_match = isolated_run
    assert all(copies_match.values()), copies_match  # the copies are the package's own files
    for bundle in bundles.values():
        names = set(os.listdir(bundle))
        # the bundle's code is the core folder, file for file (its __init__, the folder's map, stays home)
        core_folder = {p.name for p in (REPO_ROOT / "hf_eagle3" / "core").glob("*.py")} - {"__init__.py"}
        assert {n for n in names if n.endswith(".py")} == core_folder == set(CORE_FILES), names
        config = json.loads((bundle / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP
        assert config["model_type"] == hf_eagle3.Eagle3Config.model_type


def test_bundle_runs_without_hf_eagle3(isolated_run):
    results, ref, _, _ = isolated_run
    assert results["isolation"] in ("removed", "blocked")
    assert results["hf_eagle3_in_sys_modules"] == []
    for module in CORE_FILES:  # every core file was imported from the dynamic-module copies (the lazy imports too)
        assert any(m.endswith("." + module[:-3]) for m in results["remote_modules"]), module
    for name, res in results["bundles"].items():
        assert res["class"] == "Eagle3DraftModel", name
        assert res["module"].startswith("transformers_modules."), (name, res["module"])
        assert res["identical"], name
        assert res["batched_identical"] and res["batched_identical_tree"] and res["tree_identical"], (name, res)
        assert res["tokens"] == ref, name  # same as the target alone in THIS process, too
        assert res["num_drafts"] and res["num_drafts"] > 0, name  # EAGLE-3 decoding really ran
        assert res["probe_max_abs_diff"] < 1e-5, (name, res["probe_max_abs_diff"])  # other thread count
        assert res["feature_layer_ids"] == [1, 3, 4], name
    assert results["bundles"]["native"]["num_assistant_tokens"] == 4
    assert results["bundles"]["flat"]["num_assistant_tokens"] == 4
    assert results["bundles"]["speculators"]["num_assistant_tokens"] == 4


def test_bundle_refused_without_trust_remote_code(isolated_run):
    results, _, _, _ = isolated_run
    for name, res in results["bundles"].items():
        assert res["refusal"] is not None, f"{name}: loading with trust_remote_code=False did not refuse"
        assert "trust_remote_code" in res["refusal"], res["refusal"]


# ------------------------------------------------------------------------------------------------ round trips
VARIANTS = {
    "plain": dict(),
    "pruned_vocab_layers": dict(draft_vocab_size=200, feature_layer_ids=[1, 3, 4]),
    "own_embedding_narrow": dict(hidden_size=32, has_embed_tokens=True, norm_before_residual=True),
    "qk_norm_norm_before_fc": dict(qk_norm=True, norm_before_fc=True, draft_vocab_size=128),
    # EAGLE 3.1 as speculators trains it (norm_output, a sliding window) with fc_norm, partial RoPE and a big theta
    "eagle31_window_fc_norm": dict(norm_output=True, fc_norm=True, draft_sliding_window=4, partial_rotary_factor=0.5,
                                   rope_theta=5e5, draft_vocab_size=200),
}


def _make_draft(variant):
    target = tiny_target("llama")
    kwargs = dict(VARIANTS[variant])
    dv = kwargs.pop("draft_vocab_size", None)
    draft = tiny_draft(target, draft_vocab_size=dv, **kwargs)
    with torch.no_grad():  # non-trivial norms, so that a mixed-up norm would show
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return target, draft


def _outputs(draft, target):
    probe = _probe(draft, target)
    with torch.no_grad():
        out = draft(input_ids=probe["input_ids"], target_features=probe["features"])
        step = draft(input_ids=probe["input_ids"][:, :1], hidden_states=out.hidden_states[:, -1:])
    return out.logits.float(), out.hidden_states.float(), step.logits.float()


def _assert_same_draft(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
    for key in ("vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "target_hidden_size",
                "norm_before_residual", "norm_before_fc", "fc_norm", "qk_norm", "has_embed_tokens",
                "feature_layer_ids", "norm_output", "draft_sliding_window", "partial_rotary_factor", "has_lm_head",
                "draft_rope_scaling"):
        assert getattr(a.config, key) == getattr(b.config, key), key


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fmt", ["native", "flat", "speculators"])
def test_round_trip_identical(tmp_path, variant, fmt):
    target, draft = _make_draft(variant)
    export_draft(draft, tmp_path / "out", format=fmt)
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "out")
    _assert_same_draft(draft, again)
    # Same weights (checked bit for bit above); outputs may differ by an ulp because the reloaded tensors sit at other
    # memory alignments (other SIMD paths).
    for x, y in zip(_outputs(draft, target), _outputs(again, target)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    ids = torch.tensor(PROMPT)
    a = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    b = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=again)
    assert torch.equal(a, b)


def _tensor_names_dtypes(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_flat_layout_matches_engines(tmp_path):
    _, draft = _make_draft("pruned_vocab_layers")
    export_flat(draft, tmp_path, dtype="bf16")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # SGLang would use embed_tokens as lm_head otherwise
    assert config["vocab_size"] == 256 and config["draft_vocab_size"] == 200
    # Hidden sizes equal: no target_hidden_size (the EAGLE reference reads it as "the draft has its own embedding").
    assert "target_hidden_size" not in config and config["torch_dtype"] == "bfloat16"
    # SGLang: output of layer id (ours - 1); vLLM: top-level, input of layer id (ours).
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    names = _tensor_names_dtypes(tmp_path)
    assert names.pop("d2t") == "I64" and names.pop("t2d") == "BOOL"
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight", "midlayer.mlp.gate_proj.weight"} <= set(names)
    assert all(not k.startswith(("layers.", "model.")) for k in names)
    assert set(names.values()) == {"BF16"}
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path)
    assert again.dtype == torch.bfloat16 and again.config.feature_layer_ids == [1, 3, 4]


def test_speculators_layout_matches_vllm(tmp_path):
    _, draft = _make_draft("pruned_vocab_layers")
    export_speculators(draft, tmp_path, num_speculative_tokens=3, dtype=torch.float16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    layer = config["transformer_layer_config"]
    assert layer["vocab_size"] == 256 and layer["num_hidden_layers"] == 1 and layer["model_type"] == "llama"
    assert config["draft_vocab_size"] == 200 and config["target_hidden_size"] == 64
    assert config["norm_before_residual"] is False  # explicit: vLLM reads a missing value as True
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    sc = config["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert "name_or_path" in sc["verifier"]
    names = _tensor_names_dtypes(tmp_path)
    assert names.pop("d2t") == "I64" and names.pop("t2d") == "BOOL"
    assert {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight"} <= set(names)
    assert not any(k.startswith("midlayer.") for k in names)
    assert set(names.values()) == {"F16"}
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path)
    assert again.dtype == torch.float16
    assert again.generation_config.num_assistant_tokens == 3


def test_fc_norm_exportable_to_speculators(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target, fc_norm=True)
    export_speculators(draft, tmp_path / "spec")  # speculators has fc_norm too (per captured layer, width T)
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["fc_norm"] is True
    _assert_same_draft(draft, hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "spec"))
    export_flat(draft, tmp_path / "flat")  # the flat layout records it
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "flat")
    _assert_same_draft(draft, again)


def test_native_export_dtype_and_no_auto_map(tmp_path):
    _, draft = _make_draft("plain")
    export_native(draft, tmp_path, dtype="bf16")
    config = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" not in config and config["dtype"] == "bfloat16"
    assert not any(name in os.listdir(tmp_path) for name in CORE_FILES)
    assert draft.dtype == torch.float32  # the caller's draft is left as it was
    assert hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path).dtype == torch.bfloat16


def test_cli_export_formats(tmp_path, capsys):
    _, draft = _make_draft("pruned_vocab_layers")
    draft.save_pretrained(tmp_path / "src")
    assert _cli(["export", str(tmp_path / "src"), str(tmp_path / "spec"), "--format", "speculators",
                 "--dtype", "bf16", "--num-spec-tokens", "6"]) == 0
    assert "speculators checkpoint" in capsys.readouterr().out
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
    assert _cli(["export", str(tmp_path / "spec"), str(tmp_path / "flat"), "--format", "flat"]) == 0
    assert json.loads((tmp_path / "flat" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _cli(["export", str(tmp_path / "flat"), str(tmp_path / "bundle"), "--remote-code", "--dtype", "fp32"]) == 0
    config = json.loads((tmp_path / "bundle" / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["dtype"] == "float32"
    back = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "bundle")
    assert torch.equal(back.d2t, draft.d2t) and back.config.feature_layer_ids == [1, 3, 4]
    capsys.readouterr()
    assert _cli(["export", str(tmp_path / "src"), str(tmp_path / "x"), "--remote-code", "--format", "flat"]) == 2
    assert "native layout" in capsys.readouterr().err
    assert _cli(["export", str(tmp_path / "src"), str(tmp_path / "x"), "--num-spec-tokens", "3"]) == 2
    assert "speculators" in capsys.readouterr().err
    assert _cli(["export", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1  # a clear message, no traceback
    assert "error:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="native layout"):  # the Python API raises
        export_draft(draft, tmp_path / "x", format="flat", remote_code=True)
    with pytest.raises(SystemExit):  # argparse rejects unknown choices
        _cli(["export", str(tmp_path / "src"), str(tmp_path / "x"), "--dtype", "int8"])


# ------------------------------------------------------------------------------------------- saved by export/train
@pytest.mark.parametrize("fmt", ["native", "flat", "speculators"])
def test_export_writes_auto_unless_told(tmp_path, fmt):
    from hf_eagle3 import Eagle3DraftModel

    draft = tiny_draft(cached_target("llama"), 48, seed=6)
    assert draft.generation_config.num_assistant_tokens_schedule == "constant"
    export_draft(draft, tmp_path / "auto", format=fmt)
    assert json.loads((tmp_path / "auto" / "generation_config.json").read_text())["num_assistant_tokens_schedule"] == "auto"
    assert Eagle3DraftModel.from_pretrained(tmp_path / "auto").generation_config.num_assistant_tokens_schedule == "auto"
    assert draft.generation_config.num_assistant_tokens_schedule == "constant"  # the draft passed in is unchanged
    export_draft(draft, tmp_path / "keep", format=fmt, schedule=None)
    saved = json.loads((tmp_path / "keep" / "generation_config.json").read_text())
    assert saved["num_assistant_tokens_schedule"] == "constant"
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        export_draft(draft, tmp_path / "bad", format=fmt, schedule="fast")
    assert not (tmp_path / "bad").exists()


def test_a_newly_trained_draft_saves_auto():
    from hf_eagle3 import Eagle3Config
    from hf_eagle3.training.trainer import init_draft

    config = Eagle3Config(vocab_size=32, draft_vocab_size=16, hidden_size=16, intermediate_size=32,
                          num_attention_heads=2, num_key_value_heads=1, target_hidden_size=16)
    head = {"lm_head": torch.randn(32, 16)}
    d2t = torch.zeros(16, dtype=torch.long)
    t2d = torch.zeros(32, dtype=torch.bool)
    t2d[:16] = True
    draft = init_draft(config, head, d2t, t2d)
    assert draft.generation_config.num_assistant_tokens_schedule == "auto"


def test_speculators_export_carries_the_shared_embedding_when_the_target_is_known(tmp_path):
    """speculators' own loader does not take the verifier's embedding when a checkpoint lacks one: the export writes
    the target's (as speculators' checkpoints carry it) when it knows the target, and warns when it does not."""
    from safetensors.torch import load_file

    from hf_eagle3 import Eagle3DraftModel

    target = cached_target("llama")
    draft = tiny_draft(target, 48, seed=9)
    with pytest.warns(UserWarning, match="embed_tokens"):
        export_draft(draft, tmp_path / "bare", format="speculators")
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "bare" / "model.safetensors"))
    export_draft(draft, tmp_path / "full", format="speculators", target=target)
    weights = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "full")
    ids = random_prompt(6, seed=9)
    feats = torch.randn(1, 6, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    draft.bind_target(target)
    with torch.no_grad():
        a = draft(input_ids=ids, target_features=feats).logits
        b = reloaded(input_ids=ids, target_features=feats).logits
    torch.testing.assert_close(a, b)
    other = tiny_target("llama", hidden_size=32, intermediate_size=64)  # a target the draft does not fit
    with pytest.raises(ValueError, match="hidden"):
        export_draft(tiny_draft(target, 48, seed=9), tmp_path / "bad", format="speculators", target=other)
    assert not (tmp_path / "bad").exists()  # refused before anything was written
