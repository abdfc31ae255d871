"""The EAGLE-3 draft variants published in 2026, each proven against a direct computation.

Synthetic checkpoints carry the config fields the producers publish (speculators' EAGLE 3.1 defaults, ModelOpt's
nested ``eagle_config``, drafts without ``lm_head``, Transformers-5 RoPE shapes); every test fails when the field is
ignored: ``norm_output`` on and off give different second-step logits and each equals its own direct computation, a
sliding window shorter than the sequence changes the logits and equals an explicit banded mask, and so on. Greedy
identity with the target alone and the chi-square sampling test hold with a ``norm_output`` draft whose sliding
window is shorter than the prompt.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from conftest import (
    assisted_continuations,
    cached_target,
    greedy,
    plain_continuations,
    random_prompt,
    sampling_models,
    tiny_draft,
    tiny_target,
    token_p_values,
)
from test_draft_loading import (
    llama31_8b_config,
    native_from_state,
    random_state,
    speculators_config,
    write_checkpoint,
)
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_eagle3 import Eagle3CandidateGenerator, Eagle3Config, Eagle3DraftModel, Eagle3FeatureCapture
from hf_eagle3.checkpoints.export import export_flat, export_speculators
from hf_eagle3.core.config_layouts import config_dict_to_native
from hf_eagle3.core.configuration_eagle3 import DraftConfigError
from hf_eagle3.core.draft_cache import Eagle3KVCache
from hf_eagle3.loading import shipped_draft_path

V, T = 256, 64
SHIPPED_DRAFT = shipped_draft_path()


def small_config(**overrides) -> Eagle3Config:
    kw = dict(vocab_size=V, draft_vocab_size=48, hidden_size=T, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6)
    kw.update(overrides)
    return Eagle3Config(**kw)


def features_and_ids(n: int = 12, seed: int = 0, width: int = 3 * T):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, width, generator=gen), torch.randint(4, V, (1, n + 3), generator=gen)


def chain(draft, feats, ids, steps: int = 3):
    """Logits of a prefill over ``feats`` and ``steps`` chained draft steps, through ``draft.forward`` and a cache."""
    n = feats.shape[1]
    cache = Eagle3KVCache()
    with torch.no_grad():
        out = draft(input_ids=ids[:, :n], target_features=feats, cache=cache)
        logits = [out.logits[:, -1]]
        hidden = out.hidden_states[:, -1:]
        for s in range(steps - 1):
            out = draft(input_ids=ids[:, n + s: n + s + 1], hidden_states=hidden, cache=cache,
                        position_ids=torch.tensor([[n + s]]))
            logits.append(out.logits[:, -1])
            hidden = out.hidden_states[:, -1:]
    return torch.stack(logits, 1)


def direct_chain(draft, feats, ids, steps: int = 3, norm_output: bool = False, window: int | None = None):
    """The same chain computed from the draft's modules with explicit masks and no cache: every step re-attends the
    whole sequence; ``norm_output`` feeds ``norm(h)`` forward and reads ``lm_head`` without a second norm."""
    n = feats.shape[1]
    m = draft
    with torch.no_grad():
        hiddens = m.project_features(feats)  # inputs of the positions so far
        tokens = ids[:, :n]
        logits = []
        for s in range(steps):
            length = hiddens.shape[1]
            pos = torch.arange(length)
            cos, sin = m.rope(pos[None], hiddens.dtype)
            mask = pos[None, :] <= pos[:, None]
            if window is not None:
                mask &= pos[None, :] > pos[:, None] - window
            h = m.midlayer.forward(m.embed(tokens), hiddens, cos, sin, None, mask)
            last = h[:, -1:]
            if norm_output:
                fed = m.norm(last)
                logits.append(m.lm_head(fed)[:, -1])
            else:
                fed = last
                logits.append(m.lm_head(m.norm(last))[:, -1])
            hiddens = torch.cat([hiddens, fed], dim=1)
            tokens = ids[:, : n + s + 1]
    return torch.stack(logits, 1)


def randomised(draft):
    with torch.no_grad():  # norms away from 1, so that a missing or extra norm shows
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return draft


# ------------------------------------------------------------------------------------------------ norm_output
def test_norm_output_loaded_and_each_setting_equals_its_direct_computation(tmp_path):
    """speculators' EAGLE 3.1 layout (norm_output + norm_before_fc, its training defaults): the field is read, and
    on vs off changes the second step's logits, each equal to a direct computation."""
    cfg = small_config(norm_output=True, norm_before_fc=True, norm_before_residual=True)
    state = random_state(cfg, seed=11)
    state = {k: (v.uniform_(0.5, 1.5) if "norm" in k else v) for k, v in state.items()}
    spec_state = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    spec = speculators_config(norm_output=True, norm_before_fc=True)
    spec["transformer_layer_config"].pop("rope_scaling")
    draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "spec", spec, spec_state)).float()
    assert draft.config.norm_output and draft.config.norm_before_fc
    draft.bind_target(cached_target())
    off = copy.deepcopy(draft)
    off.config.norm_output = False
    feats, ids = features_and_ids()
    on_logits, off_logits = chain(draft, feats, ids), chain(off, feats, ids)
    torch.testing.assert_close(on_logits, direct_chain(draft, feats, ids, norm_output=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off_logits, direct_chain(off, feats, ids, norm_output=False), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on_logits[:, 0], off_logits[:, 0])  # the first step is the same
    assert (on_logits[:, 1:] - off_logits[:, 1:]).abs().max() > 1e-2  # later steps are not: ignoring it shows


def test_norm_output_nested_in_eagle_config_and_flat_export(tmp_path):
    cfg = llama31_8b_config(eagle_config={"norm_output": True, "eagle_aux_hidden_state_layer_ids": [0, 2, 3]})
    kwargs, _ = config_dict_to_native(cfg)
    assert kwargs["norm_output"] is True and kwargs["feature_layer_ids"] == [1, 3, 4]
    draft = randomised(tiny_draft(cached_target(), 48, norm_output=True, seed=3))
    export_flat(draft, tmp_path / "flat")
    assert json.loads((tmp_path / "flat" / "config.json").read_text())["norm_output"] is True
    again = Eagle3DraftModel.from_pretrained(tmp_path / "flat")
    assert again.config.norm_output
    again.bind_target(cached_target()), draft.bind_target(cached_target())
    feats, ids = features_and_ids(seed=2)
    torch.testing.assert_close(chain(again, feats, ids), chain(draft, feats, ids))


# ----------------------------------------------------------------------------------------------- sliding window
def test_sliding_window_read_as_vllm_does():
    layer = speculators_config()["transformer_layer_config"]
    for types, window, expected in ((["sliding_attention"], 2048, 2048), (["full_attention"], 2048, None),
                                    (None, 2048, None)):
        cfg = speculators_config()
        cfg["transformer_layer_config"] = dict(layer, sliding_window=window, layer_types=types)
        assert config_dict_to_native(cfg)[0]["draft_sliding_window"] == expected, types
    flat = llama31_8b_config(layer_types=["sliding_attention"], sliding_window=7)
    assert config_dict_to_native(flat)[0]["draft_sliding_window"] == 7
    with pytest.raises(DraftConfigError, match="sliding_window"):
        config_dict_to_native(llama31_8b_config(layer_types=["sliding_attention"]))


def test_sliding_window_equals_banded_attention_and_changes_the_logits():
    target = cached_target()
    windowed = randomised(tiny_draft(target, 48, draft_sliding_window=4, seed=5))
    full = copy.deepcopy(windowed)
    full.config.draft_sliding_window = None
    full.midlayer.self_attn.sliding_window = None
    windowed.bind_target(target), full.bind_target(target)
    feats, ids = features_and_ids(n=12, seed=4)
    got = chain(windowed, feats, ids, steps=4)
    torch.testing.assert_close(got, direct_chain(full, feats, ids, steps=4, window=4), rtol=1e-5, atol=1e-5)
    assert (got - chain(full, feats, ids, steps=4)).abs().max() > 1e-2  # a window shorter than the sequence shows
    # A window longer than everything changes nothing.
    wide = copy.deepcopy(full)
    wide.midlayer.self_attn.sliding_window = 64
    torch.testing.assert_close(chain(wide, feats, ids, steps=4), chain(full, feats, ids, steps=4))


def eagle31_draft(target, draft_vocab_size=None, **kw):
    """A draft as speculators trains by default in 2026: norm_output, norm_before_fc, a sliding window (short here)."""
    return randomised(tiny_draft(target, draft_vocab_size, norm_output=True, norm_before_fc=True,
                                 norm_before_residual=True, draft_sliding_window=4, seed=7, **kw))


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_identity_norm_output_and_window_shorter_than_prompt(k):
    target = cached_target()
    draft = eagle31_draft(target, 48)
    ids = random_prompt(14, seed=k)  # 14 > window 4
    ref = greedy(target, ids, max_new_tokens=12)
    assert torch.equal(greedy(target, ids, max_new_tokens=12, assistant_model=draft, num_assistant_tokens=k), ref)
    tree = greedy(target, ids, max_new_tokens=12, assistant_model=draft, tree_top_k=3, tree_depth=3,
                  tree_total_tokens=8)
    assert torch.equal(tree, ref)


def test_sampling_keeps_distribution_with_norm_output_and_window():
    """The chi-square test of tests/core/test_sampling_distribution.py with an EAGLE 3.1 draft whose window (2) is shorter than
    the prompt (4)."""
    target, base = sampling_models()
    draft = tiny_draft(target, 16, hidden_size=32, intermediate_size=48, norm_output=True, draft_sliding_window=2,
                       seed=1)
    draft.load_state_dict(base.state_dict(), strict=False)
    prompt = torch.tensor([[5, 7, 9, 11]])
    sampling = dict(do_sample=True, max_new_tokens=4, temperature=0.7, top_k=8, top_p=0.9)
    samples, accepted = assisted_continuations(target, draft, prompt, 400, 3000, num_assistant_tokens=2, **sampling)
    assert accepted > 0.1
    p = token_p_values(samples, plain_continuations(target, prompt, 20000, **sampling))
    assert min(p.values()) > 1e-3 / 3, p


# ---------------------------------------------------------------------------------- ModelOpt nested norm_before_fc
def test_modelopt_nested_norm_before_fc(tmp_path):
    """gpt-oss drafts exported by ModelOpt keep norm_before_fc inside eagle_config (vLLM reads it first)."""
    native_cfg = small_config(norm_before_fc=True, rope_theta=150000.0, feature_layer_ids=[1, 3, 4])
    state = random_state(native_cfg, seed=8)
    state["input_norm.weight"].uniform_(0.5, 1.5)
    cfg = llama31_8b_config(head_dim=16, rope_theta=150000.0, torch_dtype="float32", norm_before_fc=False,
                            rms_norm_eps=1e-6,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3], "norm_before_fc": True,
                                          "use_aux_hidden_state": True, "use_last_layernorm": True})
    draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "modelopt", cfg, state))
    assert draft.config.norm_before_fc and draft.config.feature_layer_ids == [1, 3, 4]
    reference = native_from_state(native_cfg, state)
    draft.bind_target(cached_target()), reference.bind_target(cached_target())
    feats, ids = features_and_ids(seed=6)
    torch.testing.assert_close(chain(draft.float(), feats, ids), chain(reference, feats, ids))


# ------------------------------------------------------------------------------------ speculators with fc_norm
def test_speculators_fc_norm_load_and_export(tmp_path):
    native_cfg = small_config(fc_norm=True, norm_before_residual=True, rope_theta=500000.0)
    state = random_state(native_cfg, seed=9)
    for i in range(3):
        state[f"fc_norm.{i}.weight"].uniform_(0.5, 1.5)
    spec_state = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    spec = speculators_config(fc_norm=True)
    spec["transformer_layer_config"].pop("rope_scaling")
    draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "spec", spec, spec_state))
    assert draft.config.fc_norm
    reference = native_from_state(native_cfg, state)
    draft.bind_target(cached_target()), reference.bind_target(cached_target())
    feats, ids = features_and_ids(seed=8)
    torch.testing.assert_close(chain(draft, feats, ids), chain(reference, feats, ids))
    export_speculators(draft, tmp_path / "out")
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["fc_norm"] is True
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "out")
    reloaded.bind_target(cached_target())
    torch.testing.assert_close(chain(reloaded, feats, ids), chain(reference, feats, ids))


def test_speculators_export_writes_norm_output_and_window(tmp_path):
    draft = eagle31_draft(cached_target(), 48)
    export_speculators(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["norm_output"] is True and cfg["norm_before_fc"] is True and cfg["norm_before_residual"] is True
    layer = cfg["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 4
    again = Eagle3DraftModel.from_pretrained(tmp_path)
    assert (again.config.norm_output, again.config.draft_sliding_window) == (True, 4)
    again.bind_target(cached_target()), draft.bind_target(cached_target())
    feats, ids = features_and_ids(seed=9)
    torch.testing.assert_close(chain(again, feats, ids, steps=4), chain(draft, feats, ids, steps=4))


# ------------------------------------------------------------------------------------------------ RoPE shapes
def _rope_reference(theta, scaling=None, head_dim=16):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=T, num_attention_heads=4, head_dim=head_dim,
                                            max_position_embeddings=2048, rope_parameters=params))
    return rope(torch.zeros(1, 5, head_dim), torch.tensor([[0, 1, 7, 100, 1500]]))


YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "truncate": False}


@pytest.mark.parametrize(
    "fields,theta,scaling",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, 500000.0, None),
        ({"rope_scaling": dict(YARN, rope_theta=150000.0)}, 150000.0, YARN),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
          "layer_types": ["full_attention"]}, 1e6, None),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": dict(YARN, rope_theta=2e4)},
          "layer_types": ["sliding_attention"], "sliding_window": 128}, 2e4, YARN),
    ],
    ids=["theta_in_rope_parameters", "theta_in_yarn_rope_scaling", "nested_full", "nested_sliding_yarn"],
)
def test_rope_config_shapes(fields, theta, scaling):
    kwargs, _ = config_dict_to_native(llama31_8b_config(head_dim=16, **fields))
    config = Eagle3Config(**kwargs)
    assert config.rope_theta == theta
    draft = Eagle3DraftModel(config)
    cos, sin = draft.rope(torch.tensor([[0, 1, 7, 100, 1500]]), torch.float32)
    cos_ref, sin_ref = _rope_reference(theta, scaling)
    torch.testing.assert_close(cos[:, 0], cos_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], sin_ref, rtol=0, atol=1e-5)


def test_partial_rotary_factor_rotates_only_the_leading_channels():
    kwargs, _ = config_dict_to_native(llama31_8b_config(head_dim=16, rope_theta=1e4, partial_rotary_factor=0.5))
    config = Eagle3Config(**kwargs)
    assert config.partial_rotary_factor == 0.5
    draft = Eagle3DraftModel(config)
    pos = torch.tensor([[0, 1, 7, 100, 1500]])
    cos, sin = draft.rope(pos, torch.float32)
    assert cos.shape[-1] == 8
    inv = 1.0 / (1e4 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))  # vLLM: get_rope(rotary_dim=8)
    angles = pos[0, :, None].double() * inv
    torch.testing.assert_close(cos[0, 0], torch.cat([angles, angles], -1).cos().float(), rtol=0, atol=1e-5)
    from hf_eagle3.core.rope import apply_rope

    x = torch.randn(1, 4, 5, 16)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])  # the tail passes unchanged
    x1, x2 = x[..., :4], x[..., 4:8]
    torch.testing.assert_close(y[..., :8], torch.cat([x1, x2], -1) * cos + torch.cat([-x2, x1], -1) * sin)
    assert not torch.allclose(y[..., :8], x[..., :8])


# --------------------------------------------------------------------------------------------- no lm_head
def test_draft_without_lm_head_uses_the_targets_head(tmp_path):
    """nvidia gpt-oss-120b-Eagle3 style: no lm_head.weight; the target's head restricted to the draft vocab (d2t)."""
    target = cached_target()
    cfg = small_config()
    state = random_state(cfg, seed=12)
    del state["lm_head.weight"]
    draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "headless", llama31_8b_config(
        head_dim=16, torch_dtype="float32", rms_norm_eps=1e-6), state))
    assert not draft.config.has_lm_head and not hasattr(draft, "lm_head")
    feats, ids = features_and_ids(seed=10)
    with pytest.raises(ValueError, match="bind_target"):
        draft(input_ids=ids[:, :12], target_features=feats)
    draft.bind_target(target)
    with torch.no_grad():
        out = draft(input_ids=ids[:, :12], target_features=feats)
    rows = target.lm_head.weight[torch.arange(48) + state["d2t"]]
    torch.testing.assert_close(out.logits, draft.norm(out.hidden_states) @ rows.T)
    prompt = random_prompt(9, seed=3)
    assert torch.equal(greedy(target, prompt, max_new_tokens=10, assistant_model=draft, num_assistant_tokens=3),
                       greedy(target, prompt, max_new_tokens=10))
    export_flat(draft, tmp_path / "flat")  # exported as it came: without lm_head
    assert not Eagle3DraftModel.from_pretrained(tmp_path / "flat").config.has_lm_head


# ------------------------------------------------------------------------------------------------ feature order
def test_features_concatenated_in_ascending_layer_order():
    kwargs, _ = config_dict_to_native(llama31_8b_config(eagle_aux_hidden_state_layer_ids=[5, 1, 3]))
    assert Eagle3Config(**kwargs).feature_layer_ids == [1, 3, 5]
    target = cached_target()
    ids = random_prompt(7, seed=2)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        with Eagle3FeatureCapture(target, [4, 1, 2]) as capture:
            target(ids)
            got = capture.features()
    torch.testing.assert_close(got, torch.cat([hidden[1], hidden[2], hidden[4]], dim=-1))


# ------------------------------------------------------------------------------------- greedy + logits processors
def test_greedy_drafting_applies_logits_processors():
    """As Transformers' assisted decoding: in greedy mode the draft's token is the argmax of the PROCESSED scores
    when processors are set; without processors the fast path (argmax of the raw scores) is unchanged."""
    draft = tiny_draft(cached_target(), 48, seed=2)
    gen = Eagle3CandidateGenerator.__new__(Eagle3CandidateGenerator)
    from hf_eagle3.core.logits_process import Eagle3D2TLogitsProcessor

    gen.d2t, gen.do_sample, gen.ensemble = Eagle3D2TLogitsProcessor(draft.d2t, V), False, False
    scores = torch.randn(1, 48, generator=torch.Generator().manual_seed(0))
    best = int(scores.argmax())
    best_target = int(best + draft.d2t[best])
    seq = torch.tensor([[5, best_target, 9]])
    gen.logits_processor = []
    token, processed = gen._select(seq, scores)
    assert int(token) == best_target and processed is None
    gen.logits_processor = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1e6)])
    token, processed = gen._select(seq, scores)
    mapped = gen.d2t(seq, scores)
    assert int(token) != best_target and int(token) == int(gen.logits_processor(seq, mapped).argmax())
    assert processed is None


def test_greedy_identity_with_repetition_penalty_and_no_repeat_ngram():
    target = cached_target()
    draft = tiny_draft(target, 48, seed=4)
    ids = random_prompt(10, seed=5)
    for kw in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}):
        ref = greedy(target, ids, max_new_tokens=12, **kw)
        assert torch.equal(greedy(target, ids, max_new_tokens=12, assistant_model=draft, num_assistant_tokens=3,
                                  **kw), ref), kw


# ----------------------------------------------------------------------------------------------- unknown fields
@pytest.mark.parametrize(
    "fields,name",
    [
        ({"logit_scale": 2.0}, "logit_scale"),
        ({"num_hidden_layers": 2}, "num_hidden_layers"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "eagle_config.use_aux_hidden_state"),
        ({"eagle_config": {"parallel_draft_step": 3}}, "eagle_config.parallel_draft_step"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ],
)
def test_math_changing_fields_are_refused_by_name(fields, name):
    with pytest.raises(DraftConfigError, match=name):
        config_dict_to_native(llama31_8b_config(**fields))


def test_harmless_unknown_fields_warn_once():
    with pytest.warns(UserWarning) as record:
        config_dict_to_native(llama31_8b_config(brand_new_field=1, another_one="x",
                                                eagle_config={"some_modelopt_flag": True}))
    msgs = [str(w.message) for w in record if "ignoring fields" in str(w.message)]
    assert len(msgs) == 1
    assert "brand_new_field" in msgs[0] and "another_one" in msgs[0] and "eagle_config.some_modelopt_flag" in msgs[0]
    with warnings.catch_warnings():  # the published configs themselves warn about nothing
        warnings.simplefilter("error")
        config_dict_to_native(llama31_8b_config())
        config_dict_to_native(speculators_config([1, 3, 4]))


# ------------------------------------------------------------------------------------------------ flat export
FLAT_KEYS = {
    "architectures", "model_type", "vocab_size", "draft_vocab_size", "num_hidden_layers", "tie_word_embeddings",
    "rope_theta", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias", "initializer_range",
    "eagle_config", "eagle_aux_hidden_state_layer_ids", "target_name_or_path", "torch_dtype",
}


def test_flat_export_of_the_shipped_draft_reads_right_in_the_eagle_reference(tmp_path):
    """Nothing a reader of the EAGLE authors' layout would take for an own embedding or another hidden size."""
    from safetensors import safe_open

    export_flat(str(SHIPPED_DRAFT), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert set(cfg) == FLAT_KEYS
    assert cfg["hidden_size"] == 576 and cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" not in names and "lm_head.weight" in names
    # A draft whose hidden size differs from its target's still says so.
    narrow = tiny_draft(tiny_target("llama"), hidden_size=32, has_embed_tokens=True)
    export_flat(narrow, tmp_path / "narrow")
    assert json.loads((tmp_path / "narrow" / "config.json").read_text())["target_hidden_size"] == 64


def test_training_a_sliding_window_draft_is_refused_where_the_window_binds():
    from hf_eagle3.training.ttt import TTTAttention

    draft = tiny_draft(cached_target(), 48, draft_sliding_window=4)
    draft.bind_target(cached_target())
    feats, ids = features_and_ids(n=6)
    with pytest.raises(ValueError, match=r"sliding window \(4\) binds on these sequences \(6 positions"):
        draft(input_ids=ids[:, :6], target_features=feats, cache=TTTAttention())


def test_speculators_config_built_as_its_trainer_builds_it(tmp_path):
    """transformer_layer_config made the way speculators' trainer makes it (a Transformers LlamaConfig with
    ``sliding_window`` / ``use_sliding_window`` / ``layer_types`` and ``rope_parameters``, saved with
    ``to_diff_dict``) and its EAGLE 3.1 defaults at the top level: read without warnings, every field honoured."""
    from transformers import LlamaConfig

    layer = LlamaConfig(vocab_size=V, hidden_size=T, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                        head_dim=16, tie_word_embeddings=False, sliding_window=4, use_sliding_window=True,
                        layer_types=["sliding_attention"])
    layer.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    cfg = speculators_config(norm_before_fc=True, norm_output=True, fc_norm=False, embed_requires_grad=False)
    cfg["transformer_layer_config"] = layer.to_diff_dict()
    native = small_config(norm_before_fc=True, norm_output=True, norm_before_residual=True, rope_theta=500000.0,
                          draft_sliding_window=4)
    state = {k: (v.uniform_(0.5, 1.5) if "norm" in k else v) for k, v in random_state(native, seed=13).items()}
    spec_state = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        draft = Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "spec", cfg, spec_state))
    c = draft.config
    assert (c.draft_sliding_window, c.rope_theta, c.norm_output, c.norm_before_fc) == (4, 500000.0, True, True)
    draft.bind_target(cached_target())
    full = copy.deepcopy(draft)
    full.midlayer.self_attn.sliding_window = None
    feats, ids = features_and_ids(n=10, seed=13)
    torch.testing.assert_close(chain(draft, feats, ids, steps=3),
                               direct_chain(full, feats, ids, steps=3, norm_output=True, window=4),
                               rtol=1e-5, atol=1e-5)
