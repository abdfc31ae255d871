"""Interoperability with the real `speculators` package (vLLM's draft-model library).

speculators 0.9.0 pins ``transformers<=5.19.0`` while hf-eagle3 needs ``>=5.20``, so this file is not collected by
the main suite (``norecursedirs`` in pyproject.toml): ``.ci/run`` runs it by path in a venv of its own
(``.ci/specvenv``: speculators, transformers 5.19.0 and hf-eagle3 installed without dependencies).

What is proven, in fp32 with atol 1e-5, on a tiny random Llama verifier built in code (offline):

* speculators builds its EAGLE-3 draft as its trainer does (``build_draft_model`` with the defaults of its own
  ``TrainConfig``: one llama layer, ``norm_before_residual``, ``norm_before_fc``, ``norm_output``, every draft layer
  ``sliding_attention``, flex attention), with random weights and a reduced draft vocabulary, and saves it with its
  own ``save_pretrained``; ``hf_eagle3.Eagle3DraftModel.from_pretrained`` loads it and the logits of three chained
  draft steps (prefill over target features, then two steps fed the previous step's output through hf-eagle3's KV
  cache) equal those of speculators' own training-time-test forward (``ttt_steps=3``) at every position;
* ``export_draft(draft, dir, format="speculators")`` of a native hf-eagle3 draft (same variants, with its own
  embedding, a copy of the verifier's as speculators' trainer makes it) loads in speculators'
  ``Eagle3DraftModel.from_pretrained`` and its forward gives hf-eagle3's logits for three chained steps.
  Not covered: a draft sharing the target's embedding is exported without ``embed_tokens.weight``, and speculators
  0.9.0 then leaves its embedding uninitialized (it takes the verifier's only where the placeholder still reads NaN,
  which Transformers' meta-device loading does not keep), so such an export does not load correctly in speculators.

speculators' forward is teacher-forced: at position i, step k reads token i + k of the sequence and the step-(k-1)
output of position i, attending to the prefix up to i and to the earlier steps of position i only. That is exactly a
prefill of the first i + 1 positions followed by k cached draft steps, so each position is a chain to compare.
With a sliding window that binds, speculators measures the window of step k >= 1 from the base position i while
hf-eagle3 (like vLLM, which serves these drafts) measures it from the step's own position i + k (docs/layouts.md):
the two agree for step 0 everywhere and for step k where i + k < window; the test also checks they do differ
elsewhere, so a change on either side shows.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import warnings

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))

from speculators.models.eagle3 import Eagle3DraftModel as SpecEagle3  # noqa: E402
from speculators.train.cli import build_draft_model  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_eagle3 import Eagle3Config, Eagle3DraftModel  # noqa: E402
from hf_eagle3.checkpoints.export import export_draft  # noqa: E402
from hf_eagle3.core.draft_cache import Eagle3KVCache  # noqa: E402

V, H, DV, N, STEPS = 256, 64, 96, 128, 3  # target vocab, hidden, draft vocab, sequence, chained steps
# N: speculators extends its flex-attention block mask per step assuming the sequence fills whole 128-blocks.
LAYER_IDS = [1, 3, 4]  # captured target layers (input of layer i, both conventions)
ATOL = 1e-5
# speculators' default attention is flex attention, which runs unfused (and warns so) without torch.compile on CPU.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")


def trainer_defaults() -> dict:
    """speculators' own EAGLE-3 training defaults (its ``TrainConfig``, as ``speculators train`` resolves them)."""
    return TrainConfig().flatten()


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A tiny random Llama verifier saved to disk (speculators reads its config and its embedding / head)."""
    path = tmp_path_factory.mktemp("verifier")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def vocab_mapping(seed: int = 0):
    """A random reduced draft vocabulary: ``t2d`` [V] bool and ``d2t`` [DV] offsets (target = draft + d2t)."""
    gen = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(V, generator=gen)[:DV]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return t2d, used - torch.arange(DV)


def randomise(model, skip=("embed_tokens",), seed: int = 1):
    """Random weights; norms drawn away from 1 so that a missing or extra norm shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in skip) or name.startswith("verifier_"):
                continue
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def speculators_draft(verifier_dir: str, **overrides) -> SpecEagle3:
    """speculators' draft, built by its trainer's ``build_draft_model`` from its defaults (plus ``overrides``)."""
    args = trainer_defaults()
    assert args["speculator_type"] == "eagle3"
    args.update(verifier_name_or_path=verifier_dir, target_layer_ids=LAYER_IDS, mask_token_id=0, **overrides)
    t2d, d2t = vocab_mapping()
    model = build_draft_model(argparse.Namespace(**args), SpecEagle3, t2d, d2t, DV)
    return randomise(model).eval()


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, N, 3 * H, generator=gen)
    ids = torch.randint(3, V, (1, N), generator=gen)
    return feats, ids, 1 + torch.arange(N)[None]  # positions as speculators' shift_batch leaves them


def speculators_logits(model: SpecEagle3, feats, ids, pos) -> torch.Tensor:
    """speculators' own training-time-test forward (``ttt_steps=STEPS``); the draft-vocabulary logits of every step
    are read at its ``lm_head`` (the forward returns only their argmax). Returns [STEPS, N, DV]."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            tokens = model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids),
                           position_ids=pos.clone(), ttt_steps=STEPS)
    finally:
        hook.remove()
    assert len(seen) == STEPS and len(tokens) == STEPS
    for step, logits in enumerate(seen):  # the hooked scores are the ones speculators drafts from
        assert torch.equal(logits.argmax(-1), tokens[step])
    return torch.cat(seen, 0)


def hf_eagle3_logits(draft: Eagle3DraftModel, feats, ids, pos) -> torch.Tensor:
    """For every position i: a prefill of positions 0..i over the target features, then STEPS - 1 chained draft
    steps through the KV cache, step k fed the previous step's ``hidden_states`` and token i + k (0 past the end,
    as speculators pads). Returns [STEPS, N, DV]."""
    out_logits = torch.empty(STEPS, N, draft.config.draft_vocab_size)
    padded = torch.cat([ids, ids.new_zeros(1, STEPS)], 1)
    with torch.no_grad():
        for i in range(N):
            cache = Eagle3KVCache()
            out = draft(input_ids=ids[:, : i + 1], target_features=feats[:, : i + 1], position_ids=pos[:, : i + 1],
                        cache=cache)
            out_logits[0, i] = out.logits[0, -1]
            hidden = out.hidden_states[:, -1:]
            for k in range(1, STEPS):
                out = draft(input_ids=padded[:, i + k: i + k + 1], hidden_states=hidden, cache=cache,
                            position_ids=pos[:, i: i + 1] + k)
                out_logits[k, i] = out.logits[0, -1]
                hidden = out.hidden_states
    return out_logits


def comparable(window: int | None) -> torch.Tensor:
    """[STEPS, N] bool: where speculators' training mask and the positional (vLLM) window agree."""
    step = torch.arange(STEPS)[:, None]
    i = torch.arange(N)[None, :]
    if window is None or window >= N + STEPS:
        return torch.ones(STEPS, N, dtype=torch.bool)
    return (step == 0) | (i + step < window)


def assert_equal_where_comparable(ours, theirs, window):
    mask = comparable(window)
    diff = (ours - theirs).abs().amax(-1)  # [STEPS, N]
    print(f"max |logit diff| over {int(mask.sum())} compared (step, position) pairs: {diff[mask].max().item():.3g}")
    assert diff[mask].max() <= ATOL, diff
    assert (mask[1:]).any(), "no chained step was compared"
    if not mask.all():  # the documented difference of the two window rules is real
        assert diff[~mask].min() > 1e-3, diff


# ------------------------------------------------------------------------------------------ speculators -> ours
@pytest.mark.parametrize("window", [None, 16], ids=["default-window", "window-16"])
def test_speculators_draft_loads_in_hf_eagle3_with_equal_chained_logits(verifier_dir, tmp_path, window):
    overrides = {} if window is None else {"sliding_window": window}
    spec = speculators_draft(verifier_dir, **overrides)
    cfg = spec.config
    defaults = trainer_defaults()
    # the variants this checks are speculators' current defaults
    assert cfg.norm_output and cfg.norm_before_fc and cfg.norm_before_residual and not cfg.fc_norm
    assert cfg.transformer_layer_config.layer_types == ["sliding_attention"]
    assert cfg.transformer_layer_config.sliding_window == (window or defaults["sliding_window"])
    spec.save_pretrained(tmp_path / "spec")
    saved = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert saved["speculators_model_type"] == "eagle3" and saved["norm_output"] and saved["norm_before_fc"]

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no field of speculators' own save is ignored
        ours = Eagle3DraftModel.from_pretrained(tmp_path / "spec")
    c = ours.config
    assert c.norm_output and c.norm_before_fc and c.norm_before_residual and not c.fc_norm
    assert c.draft_sliding_window == (window or defaults["sliding_window"])
    assert c.feature_layer_ids == LAYER_IDS and c.draft_vocab_size == DV
    assert torch.equal(ours.d2t, spec.d2t) and torch.equal(ours.t2d, spec.t2d)

    feats, ids, pos = inputs()
    theirs = speculators_logits(spec, feats, ids, pos)
    mine = hf_eagle3_logits(ours, feats, ids, pos)
    assert_equal_where_comparable(mine, theirs, window)

    # the comparison can fail: the same weights read without norm_output give other chained logits
    off = copy.deepcopy(ours)
    off.config.norm_output = False
    assert (hf_eagle3_logits(off, feats, ids, pos)[1:] - theirs[1:]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------ ours -> speculators
def native_draft(verifier_dir: str, window: int | None) -> Eagle3DraftModel:
    """A random native hf-eagle3 draft with speculators' default variants and its own embedding (the verifier's)."""
    config = Eagle3Config(vocab_size=V, draft_vocab_size=DV, hidden_size=H, target_hidden_size=H,
                          intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                          norm_before_residual=True, norm_before_fc=True, norm_output=True,
                          draft_sliding_window=window, feature_layer_ids=LAYER_IDS,
                          has_embed_tokens=True, target_name_or_path=verifier_dir)
    torch.manual_seed(3)
    draft = Eagle3DraftModel(config).eval()
    t2d, d2t = vocab_mapping(seed=5)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    randomise(draft, seed=7)
    target = LlamaForCausalLM.from_pretrained(verifier_dir).eval()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    draft.bind_target(target)
    return draft


@pytest.mark.parametrize("window", [2048, 16], ids=["window-2048", "window-16"])
def test_hf_eagle3_speculators_export_loads_in_speculators_with_equal_chained_logits(verifier_dir, tmp_path,
                                                                                     window):
    ours = native_draft(verifier_dir, window)
    export_draft(ours, tmp_path / "exp", format="speculators")
    spec = SpecEagle3.from_pretrained(str(tmp_path / "exp")).eval()
    cfg = spec.config
    assert cfg.norm_output and cfg.norm_before_fc and cfg.norm_before_residual
    assert cfg.transformer_layer_config.layer_types == ["sliding_attention"]
    assert cfg.transformer_layer_config.sliding_window == window
    assert cfg.eagle_aux_hidden_state_layer_ids == LAYER_IDS
    assert torch.equal(spec.d2t, ours.d2t) and torch.equal(spec.t2d, ours.t2d)
    assert torch.equal(spec.embed_tokens.weight, ours.embed_tokens.weight)

    feats, ids, pos = inputs(seed=1)
    theirs = speculators_logits(spec, feats, ids, pos)
    mine = hf_eagle3_logits(ours, feats, ids, pos)
    assert_equal_where_comparable(mine, theirs, window)

    # the comparison can fail: speculators reading the export without norm_output gives other chained logits
    spec.config.norm_output = False
    assert (speculators_logits(spec, feats, ids, pos)[1:] - mine[1:]).abs().max() > 1e-2


def test_versions():
    """The pins this file was proven against (the venv of .ci/run installs exactly these)."""
    from importlib.metadata import version

    print({name: version(name) for name in ("speculators", "transformers", "torch", "hf-eagle3")})
    assert version("speculators") == "0.9.0" and version("transformers") == "5.19.0"
