"""Loading EAGLE-3 drafts in every published layout, layer-id conventions, and clear errors.

Synthetic checkpoints are written to temporary directories, scaled down but with the exact key names and config
fields of the published drafts: the Llama-3.1-8B draft (flat layout, ``midlayer.*``, no ``target_hidden_size`` /
``rope_theta`` / ``head_dim``, float16 ``pytorch_model.bin``), the Llama-3.3-70B draft (own ``embed_tokens``,
``target_hidden_size`` != ``hidden_size``), the `speculators` layout (``layers.0.*``, nested
``transformer_layer_config``) and our own ``save_pretrained`` output. Each must behave exactly like the same weights
loaded natively. A ``config.json`` that lacks a required field, holds a wrong type or is not JSON is refused naming
the file and the field.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cached_target as target
from conftest import tiny_draft, tiny_target
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel

from hf_eagle3 import Eagle3CandidateGenerator, Eagle3Config, Eagle3DraftModel, Eagle3FeatureCapture
from hf_eagle3.core.config_layouts import config_dict_to_native, native_to_flat_config, native_to_speculators_config
from hf_eagle3.loading import shipped_draft_path

V, T = 256, 64  # target vocabulary and hidden size (conftest.TINY)
SHIPPED_DRAFT = shipped_draft_path()


def random_state(config: Eagle3Config, seed: int = 0, dtype=torch.float32) -> dict:
    """Random weights (native names) for ``config``, with a sorted random ``d2t`` / ``t2d`` when vocabularies differ."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    state = {k: (v.normal_(0, 0.05) if v.is_floating_point() else v).to(dtype if v.is_floating_point() else v.dtype)
             for k, v in model.state_dict().items()}
    vd = config.draft_vocab_size
    if vd < config.vocab_size:
        used = torch.sort(torch.randperm(config.vocab_size)[:vd]).values
        state["d2t"] = used - torch.arange(vd)
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        state["t2d"][used] = True
    return state


def write_checkpoint(path, config: dict, state: dict, fmt: str = "safetensors") -> str:
    """Write ``config.json`` and the weights (``model.safetensors`` or ``pytorch_model.bin``) to ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = {k: v.contiguous() for k, v in state.items()}
    if fmt == "safetensors":
        save_file(state, os.path.join(path, "model.safetensors"))
    else:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
    return str(path)


def native_from_state(config: Eagle3Config, state: dict) -> Eagle3DraftModel:
    """The reference: the same weights loaded natively (no file, no conversion)."""
    model = Eagle3DraftModel(config)
    model.load_checkpoint_state_dict({k: v.clone() for k, v in state.items()})
    return model.float().eval()


def draft_logits(draft, seed: int = 0):
    """Draft logits and hidden states on random target features and tokens (after binding to the tiny target)."""
    draft.bind_target(target())
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, 9, 3 * draft.config.target_hidden_size, generator=gen)
    ids = torch.randint(0, V, (1, 9), generator=gen)
    with torch.no_grad():
        out = draft(input_ids=ids, target_features=feats)
        step = draft(input_ids=ids[:, -1:], hidden_states=out.hidden_states[:, -1:], position_ids=torch.tensor([[9]]))
    return out.logits, out.hidden_states, step.logits


def proposals(draft, length: int = 9, max_new_tokens: int = 12, k: int = 3):
    """Every candidate sequence the draft proposes during a greedy ``generate`` (plus the output)."""
    seen = []
    original = Eagle3CandidateGenerator.get_candidates

    def get_candidates(self, input_ids, **kwargs):
        seq, logits = original(self, input_ids, **kwargs)
        seen.append(seq[0, input_ids.shape[1]:].tolist())
        return seq, logits

    Eagle3CandidateGenerator.get_candidates = get_candidates
    try:
        ids = torch.randint(4, V, (1, length), generator=torch.Generator().manual_seed(length))
        out = target().generate(ids, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=draft,
                                num_assistant_tokens=k)
    finally:
        Eagle3CandidateGenerator.get_candidates = original
    return seen, out


def assert_same_draft(loaded: Eagle3DraftModel, reference: Eagle3DraftModel):
    """Identical configuration-relevant behaviour: logits, hidden states and proposals during generate."""
    for a, b in zip(draft_logits(loaded.float()), draft_logits(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # BLAS results may depend on alignment
    (seen_a, out_a), (seen_b, out_b) = proposals(loaded), proposals(reference)
    assert seen_a == seen_b and torch.equal(out_a, out_b)


def llama31_8b_config(**overrides) -> dict:
    """The published Llama-3.1-8B EAGLE-3 draft config.json, scaled down (same fields, no rope_theta/head_dim)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 3,
        "hidden_act": "silu",
        "hidden_size": T,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": 48,
    }
    cfg.update(overrides)
    return cfg


LLAMA31_KEYS = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def llama31_native_config() -> Eagle3Config:
    return Eagle3Config(vocab_size=V, draft_vocab_size=48, hidden_size=T, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5)


# ----------------------------------------------------------------------------------------------- layouts
def test_flat_llama31_8b_layout(tmp_path):
    native_cfg = llama31_native_config()
    state = random_state(native_cfg, seed=1, dtype=torch.float16)
    assert set(state) == LLAMA31_KEYS  # exactly the published key names
    path = write_checkpoint(tmp_path / "flat", llama31_8b_config(), state, fmt="bin")
    draft = Eagle3DraftModel.from_pretrained(path)
    assert draft.dtype == torch.float16  # as stored
    c = draft.config
    assert (c.hidden_size, c.target_hidden_size, c.head_dim, c.rope_theta) == (T, T, 16, 10000.0)
    assert (c.draft_vocab_size, c.vocab_size, c.has_embed_tokens, c.feature_layer_ids) == (48, V, False, None)
    assert not c.norm_before_residual
    assert torch.equal(draft.d2t, state["d2t"]) and torch.equal(draft.t2d, state["t2d"])
    assert_same_draft(draft, native_from_state(native_cfg, state))
    # Shares (does not copy) the target's embedding.
    assert draft.get_input_embeddings() is target().get_input_embeddings()
    assert "embed_tokens.weight" not in draft.state_dict()


def test_flat_llama33_70b_layout_own_embedding(tmp_path):
    native_cfg = Eagle3Config(vocab_size=V, draft_vocab_size=48, hidden_size=32, intermediate_size=80,
                              num_attention_heads=4, num_key_value_heads=2, target_hidden_size=T,
                              has_embed_tokens=True)
    state = random_state(native_cfg, seed=2, dtype=torch.bfloat16)
    assert state["embed_tokens.weight"].shape == (V, 32) and state["fc.weight"].shape == (32, 3 * T)
    cfg = llama31_8b_config(hidden_size=32, intermediate_size=80, target_hidden_size=T, torch_dtype="bfloat16")
    path = write_checkpoint(tmp_path / "flat70b", cfg, state)
    draft = Eagle3DraftModel.from_pretrained(path, dtype=torch.float32)
    assert draft.config.has_embed_tokens and draft.config.target_hidden_size == T and draft.config.head_dim == 8
    assert_same_draft(draft, native_from_state(native_cfg, state))
    assert draft.get_input_embeddings() is draft.embed_tokens  # its own, not the target's


def test_flat_angelslim_layout_explicit_head_dim(tmp_path):
    """``Eagle3LlamaForCausalLM`` drafts (AngelSlim) give head_dim (heads * head_dim != hidden) and rope_theta."""
    native_cfg = Eagle3Config(vocab_size=V, draft_vocab_size=48, hidden_size=T, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6)
    state = random_state(native_cfg, seed=5)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (4 * 32, 2 * T)
    cfg = llama31_8b_config(architectures=["Eagle3LlamaForCausalLM"], head_dim=32, rope_theta=1e6,
                            torch_dtype="float32")
    draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "angelslim", cfg, state))
    assert (draft.config.head_dim, draft.config.rope_theta) == (32, 1e6)
    assert_same_draft(draft, native_from_state(native_cfg, state))


def speculators_config(layer_ids=None, **overrides) -> dict:
    """A `speculators`-layout config.json (as vLLM loads) for a small Qwen3-free Llama draft."""
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0.dev42",
        "draft_vocab_size": 48,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "transformer_layer_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": V,
            "hidden_size": T,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]},
        },
    }
    if layer_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = layer_ids
    cfg.update(overrides)
    return cfg


YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "truncate": False}


def test_flat_modelopt_layout_yarn_rope(tmp_path):
    """Drafts exported by ModelOpt for gpt-oss-like targets: ``eagle_config`` layer ids, explicit head_dim and a
    ``yarn`` rope_scaling; RoPE (frequencies and the cos/sin attention factor) must equal Transformers' own."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    native_cfg = Eagle3Config(vocab_size=V, draft_vocab_size=48, hidden_size=T, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=150000.0,
                              draft_rope_scaling=dict(YARN), max_position_embeddings=2048, feature_layer_ids=[1, 3, 4])
    state = random_state(native_cfg, seed=6)
    cfg = llama31_8b_config(head_dim=16, rope_theta=150000.0, rope_scaling=dict(YARN), torch_dtype="float32",
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3], "use_aux_hidden_state": True})
    draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "modelopt", cfg, state))
    assert draft.config.draft_rope_scaling["rope_type"] == "yarn" and draft.config.feature_layer_ids == [1, 3, 4]
    assert draft.rope_attention_scaling > 1.0  # yarn scales cos/sin by 0.1 * ln(factor) + 1
    reference = LlamaRotaryEmbedding(LlamaConfig(hidden_size=T, num_attention_heads=4, head_dim=16,
                                                 max_position_embeddings=2048,
                                                 rope_parameters=dict(YARN, rope_theta=150000.0)))
    pos = torch.tensor([[0, 1, 63, 64, 500, 2000]])
    cos_ref, sin_ref = reference(torch.zeros(1, 6, 16), pos)
    cos, sin = draft.rope(pos, torch.float32)
    torch.testing.assert_close(cos[:, 0], cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], sin_ref, rtol=0, atol=1e-6)
    assert_same_draft(draft, native_from_state(native_cfg, state))
    assert torch.equal(proposals(draft)[1], target().generate(
        torch.randint(4, V, (1, 9), generator=torch.Generator().manual_seed(9)), do_sample=False, max_new_tokens=12))


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "no-such-rope"])
def test_unsupported_rope_scaling_is_refused_when_loading(tmp_path, kind):
    state = random_state(llama31_native_config(), seed=1)
    cfg = llama31_8b_config(rope_scaling={"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported") as err:
        Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / kind, cfg, state))
    assert "Set `draft_rope_scaling`" in str(err.value) and "yarn" in str(err.value)


def test_speculators_layout(tmp_path):
    native_cfg = Eagle3Config(vocab_size=V, draft_vocab_size=48, hidden_size=T, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                              max_position_embeddings=4096, rope_theta=500000.0, norm_before_residual=True,
                              draft_rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
                              feature_layer_ids=[1, 3, 4])
    state = random_state(native_cfg, seed=3)
    spec_state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    assert "layers.0.self_attn.q_proj.weight" in spec_state and not any(k.startswith("midlayer") for k in spec_state)
    path = write_checkpoint(tmp_path / "spec", speculators_config([1, 3, 4]), spec_state)
    draft = Eagle3DraftModel.from_pretrained(path)
    c = draft.config
    assert c.feature_layer_ids == [1, 3, 4]  # speculators ids are capture-BEFORE, like ours: unchanged
    assert c.norm_before_residual and c.rope_theta == 500000.0 and c.draft_rope_scaling["rope_type"] == "llama3"
    assert c.target_name_or_path == "tiny/llama"
    assert draft.generation_config.num_assistant_tokens == 4  # speculative_tokens
    assert_same_draft(draft, native_from_state(native_cfg, state))
    # A missing norm_before_residual means True for this layout (vLLM's default).
    cfg = speculators_config()
    del cfg["norm_before_residual"]
    assert config_dict_to_native(cfg)[0]["norm_before_residual"] is True


def test_native_round_trip_and_automodel(tmp_path):
    t = target()
    draft = tiny_draft(t, 48, seed=4, feature_layer_ids=[1, 2, 5], rope_theta=123456.0)
    draft.generation_config.num_assistant_tokens = 7
    draft.generation_config.num_assistant_tokens_schedule = "heuristic"
    draft.generation_config.assistant_confidence_threshold = 0.25
    draft.save_pretrained(tmp_path / "native")
    assert (tmp_path / "native" / "generation_config.json").is_file()
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "native")
    assert loaded.config.to_dict() | {"_name_or_path": None} == draft.config.to_dict() | {"_name_or_path": None}
    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
        assert getattr(loaded.generation_config, key) == getattr(draft.generation_config, key)
    assert_same_draft(loaded, draft)
    auto = AutoModel.from_pretrained(tmp_path / "native")
    assert type(auto) is Eagle3DraftModel
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "native"), Eagle3Config)
    assert auto.generation_config.num_assistant_tokens == 7
    assert_same_draft(auto, draft)


def test_exported_layouts_load_back(tmp_path):
    """Our flat / speculators config writers and the loader agree, layer ids included."""
    draft = tiny_draft(target(), 48, seed=6, feature_layer_ids=[1, 3, 5])
    state = {k: v for k, v in draft.state_dict().items()}
    flat = native_to_flat_config(draft.config)
    assert flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # SGLang: output of layer id
    spec = native_to_speculators_config(draft.config)
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # speculators: capture-before
    a = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "flat", flat, state))
    spec_state = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    b = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "spec", spec, spec_state))
    for loaded in (a, b):
        assert loaded.config.feature_layer_ids == [1, 3, 5]
        assert_same_draft(loaded, draft)


# --------------------------------------------------------------------------------------- layer-id conventions
@pytest.mark.parametrize(
    "cfg,expected",
    [
        (llama31_8b_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}), [2, 4, 5]),  # SGLang: +1
        (llama31_8b_config(eagle_aux_hidden_state_layer_ids=[1, 3, 4]), [1, 3, 4]),  # vLLM-style top level
        (speculators_config([1, 3, 4]), [1, 3, 4]),  # speculators: unchanged
        (llama31_8b_config(), None),  # reference default, resolved against the target
    ],
    ids=["sglang_eagle_config", "flat_top_level", "speculators", "default"],
)
def test_layer_id_conventions(cfg, expected):
    kwargs, _ = config_dict_to_native(cfg)
    kwargs.pop("_num_assistant_tokens", None)
    config = Eagle3Config(**kwargs)
    assert config.feature_layer_ids == expected
    assert config.resolve_feature_layer_ids(32) == (expected or [2, 16, 29])  # Llama-3.1-8B: 2, N//2, N-3


def test_captured_features_are_inputs_of_layers():
    """Feature i is ``output_hidden_states[i]``: the input of decoder layer i (0 = embeddings)."""
    t = target()
    ids = torch.randint(4, V, (1, 7), generator=torch.Generator().manual_seed(0))
    with Eagle3FeatureCapture(t, [0, 2, 5]) as capture, torch.no_grad():
        hs = t(ids, output_hidden_states=True).hidden_states
        feats = capture.features()
    torch.testing.assert_close(feats, torch.cat([hs[0], hs[2], hs[5]], dim=-1), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ errors
def test_wrong_key_name(tmp_path):
    state = random_state(llama31_native_config())
    state["midlayer.mlp.gate.weight"] = state.pop("midlayer.mlp.gate_proj.weight")
    path = write_checkpoint(tmp_path / "bad", llama31_8b_config(), state)
    with pytest.raises(ValueError) as err:
        Eagle3DraftModel.from_pretrained(path)
    msg = str(err.value)
    assert "midlayer.mlp.gate_proj.weight" in msg and "midlayer.mlp.gate.weight" in msg
    assert "Missing" in msg and "Unexpected" in msg and "rename" in msg


def test_wrong_shape(tmp_path):
    state = random_state(llama31_native_config())
    state["fc.weight"] = torch.zeros(T, 3 * T + 8)
    path = write_checkpoint(tmp_path / "bad", llama31_8b_config(), state)
    with pytest.raises(ValueError) as err:
        Eagle3DraftModel.from_pretrained(path)
    msg = str(err.value)
    assert "fc.weight" in msg and str((T, 3 * T + 8)) in msg and str((T, 3 * T)) in msg
    assert "target_hidden_size" in msg  # the config field to check


def test_missing_d2t(tmp_path):
    state = random_state(llama31_native_config())
    del state["d2t"]
    path = write_checkpoint(tmp_path / "bad", llama31_8b_config(), state)
    with pytest.raises(ValueError, match="no `d2t` mapping") as err:
        Eagle3DraftModel.from_pretrained(path)
    assert "Add the `d2t` tensor" in str(err.value)


def test_unknown_config(tmp_path):
    path = write_checkpoint(tmp_path / "bad", {"model_type": "bert", "architectures": ["BertModel"]}, {})
    with pytest.raises(ValueError, match="is not an EAGLE-3 draft"):
        Eagle3DraftModel.from_pretrained(path)


def hooks(model) -> dict:
    """The forward pre-hooks and forward hooks of every module of ``model`` (Transformers installs its own forward
    hooks for ``output_hidden_states``; the EAGLE-3 capture uses pre-hooks)."""
    return {name: (list(m._forward_pre_hooks), list(m._forward_hooks)) for name, m in model.named_modules()
            if m._forward_pre_hooks or m._forward_hooks}


def no_pre_hooks(model) -> bool:
    """No forward pre-hook on any module of ``model``."""
    return all(not m._forward_pre_hooks for m in model.modules())


def test_generate_errors_leave_no_hooks():
    t = target()
    ids = torch.randint(4, V, (1, 5), generator=torch.Generator().manual_seed(1))
    reference = t.generate(ids, do_sample=False, max_new_tokens=5)
    before = hooks(t)
    assert no_pre_hooks(t)

    other = tiny_draft(tiny_target("llama", hidden_size=32, num_attention_heads=4), hidden_size=32)
    other.config.feature_layer_ids = None
    with pytest.raises(ValueError) as err:
        t.generate(ids, do_sample=False, max_new_tokens=5, assistant_model=other)
    assert "hidden size 32" in str(err.value) and "hidden size 64" in str(err.value)
    assert "Use the draft made for this target" in str(err.value)
    assert hooks(t) == before and other.last_stats is None  # raised before any work

    deep = tiny_draft(t, feature_layer_ids=[2, 3, 9])
    with pytest.raises(ValueError) as err:
        t.generate(ids, do_sample=False, max_new_tokens=5, assistant_model=deep)
    assert "feature_layer_ids" in str(err.value) and "0..5" in str(err.value)
    assert hooks(t) == before and deep.last_stats is None

    draft = tiny_draft(t)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, -1] = 0  # right padding: refused inside the batched loop, after the hooks went on
    with pytest.raises(ValueError, match="left-padded") as err:
        t.generate(ids.repeat(2, 1), attention_mask=mask, do_sample=False, max_new_tokens=5, assistant_model=draft)
    assert "padding_side" in str(err.value)
    assert hooks(t) == before and no_pre_hooks(t)
    assert torch.equal(t.generate(ids, do_sample=False, max_new_tokens=5), reference)


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
