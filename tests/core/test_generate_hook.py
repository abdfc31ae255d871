"""The ``generate`` hook and the target feature hooks: installed only for EAGLE-3 calls, always removed, idempotent,
transparent for every other use of ``generate``, and working on targets placed with an accelerate ``device_map``."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_target as target
from conftest import random_prompt as prompt
from conftest import tiny_draft, tiny_target
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, StoppingCriteria
from transformers.generation import utils as gen_utils

import hf_eagle3
from hf_eagle3 import Eagle3CandidateGenerator, install_generate_hook
from hf_eagle3.core.generate_hook import use_drafting
from hf_eagle3.core.transformers_compat import SELECTS_HIDDEN_STATES

GenerationMixin = gen_utils.GenerationMixin


def pre_hooks(model) -> list[str]:
    """Names of the modules of ``model`` that carry a forward pre-hook."""
    return [name for name, m in model.named_modules() if m._forward_pre_hooks]


class RaiseAfter(StoppingCriteria):
    """A stopping criterion that raises on its ``n``-th call (i.e. after ``n`` target forwards)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls >= self.n:
            raise KeyboardInterrupt("stop here")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("features", ["hooks", "outputs"])
def test_hooks_removed_when_drafting_raises(monkeypatch, features):
    if features == "outputs" and not SELECTS_HIDDEN_STATES:
        pytest.skip("Transformers < 5.25 cannot hand over selected hidden states (the hooks case covers it)")
    t, draft = target(), tiny_draft(target())
    ids = prompt()
    reference = t.generate(ids, do_sample=False, max_new_tokens=8)
    with use_drafting(features=features):
        expected = t.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft)
    assert torch.equal(expected, reference)

    def boom(*args, **kwargs):
        if features == "hooks":
            assert pre_hooks(t), "the feature hooks are in place while the draft runs"
        else:
            assert pre_hooks(t) == [], "the outputs protocol needs no hooks on the target"
        raise RuntimeError("draft failure")

    monkeypatch.setattr(draft, "forward", boom)
    with pytest.raises(RuntimeError, match="draft failure"), use_drafting(features=features):
        t.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft)
    assert pre_hooks(t) == []
    monkeypatch.undo()

    assert torch.equal(t.generate(ids, do_sample=False, max_new_tokens=8), reference)
    # The draft is usable again (no call state left behind).
    assert torch.equal(t.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft), reference)
    assert pre_hooks(t) == []


def test_hooks_removed_when_target_side_raises():
    """An exception raised between target forwards (here by a stopping criterion, even a BaseException)."""
    t, draft = target(), tiny_draft(target())
    ids = prompt(seed=1)
    reference = t.generate(ids, do_sample=False, max_new_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        t.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft, stopping_criteria=[RaiseAfter(3)])
    assert pre_hooks(t) == []
    assert torch.equal(t.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft), reference)


def test_install_is_idempotent():
    install_generate_hook()
    install_generate_hook()
    for name in ("generate", "_get_candidate_generator"):
        fn = getattr(GenerationMixin, name)
        assert getattr(fn, "_hf_eagle3_hook", None) is not None
        assert getattr(fn.__wrapped__, "_hf_eagle3_hook", None) is None, f"{name} wrapped twice"
    t = target()
    assert torch.equal(t.generate(prompt(), do_sample=False, max_new_tokens=6, assistant_model=tiny_draft(t)),
                       t.generate(prompt(), do_sample=False, max_new_tokens=6))


@pytest.fixture
def unhooked(monkeypatch):
    """A function running ``generate`` with the original (unhooked) Transformers methods."""

    def run(model, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(GenerationMixin, "generate", GenerationMixin.generate.__wrapped__)
            m.setattr(GenerationMixin, "_get_candidate_generator", GenerationMixin._get_candidate_generator.__wrapped__)
            return model.generate(*args, **kwargs)

    return run


def tiny_hf_assistant():
    """A small ordinary Hugging Face assistant with the target's vocabulary."""
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(9)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("do_sample", [False, True])
def test_other_generate_calls_unchanged(do_sample, unhooked, monkeypatch):
    t, ids = target(), prompt(seed=2)
    created = []
    original_init = Eagle3CandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        created.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(Eagle3CandidateGenerator, "__init__", spy)
    kwargs = dict(do_sample=do_sample, max_new_tokens=10, top_k=20)
    runs = {}
    for name, extra in [("plain", {}), ("assistant", {"assistant_model": tiny_hf_assistant()}),
                        ("prompt_lookup", {"prompt_lookup_num_tokens": 3})]:
        torch.manual_seed(0)
        before = unhooked(t, ids, **kwargs, **extra)
        torch.manual_seed(0)
        after = t.generate(ids, **kwargs, **extra)
        assert torch.equal(after, before), name
        runs[name] = after
    assert created == []  # the EAGLE-3 generator was never involved
    assert pre_hooks(t) == []
    if not do_sample:
        assert torch.equal(runs["assistant"], runs["plain"])


class Blocks(nn.Module):
    """A layer container that is not an ``nn.ModuleList`` (as in some custom decoders)."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.inner = layers

    def __getitem__(self, index):
        return self.inner[index]

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


def test_unfound_layers_name_target_layers_path():
    t = tiny_target("llama")
    t.generation_config.eos_token_id = None
    ids = prompt(seed=3)
    reference = t.generate(ids, do_sample=False, max_new_tokens=6)
    t.model.layers = Blocks(t.model.layers)
    t.extra_heads = nn.ModuleList(nn.Identity() for _ in range(len(t.model.layers)))  # an ambiguous look-alike
    assert torch.equal(t.generate(ids, do_sample=False, max_new_tokens=6), reference)  # the target still works
    draft = tiny_draft(t)
    with pytest.raises(ValueError) as err:
        t.generate(ids, do_sample=False, max_new_tokens=6, assistant_model=draft)
    assert "target_layers_path" in str(err.value) and "Could not find the decoder layers" in str(err.value)
    assert pre_hooks(t) == []
    draft.config.target_layers_path = "model.layers.inner"
    assert torch.equal(t.generate(ids, do_sample=False, max_new_tokens=6, assistant_model=draft), reference)
    with pytest.raises(ValueError, match="model.nothing"):
        draft.config.target_layers_path = "model.nothing"
        t.generate(ids, do_sample=False, max_new_tokens=6, assistant_model=draft)


@pytest.mark.parametrize("placement", ["single_cpu", "split_with_disk_offload"])
def test_accelerate_device_map(placement, tmp_path):
    t = target()
    t.save_pretrained(tmp_path / "target")
    n = t.config.num_hidden_layers
    if placement == "single_cpu":
        kwargs = {"device_map": {"": "cpu"}}
    else:
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": ("disk" if i in (2, n // 2) else "cpu") for i in range(n)})
        kwargs = {"device_map": device_map, "offload_folder": str(tmp_path / "offload")}
    placed = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32, **kwargs).eval()
    if placement != "single_cpu":
        assert set(placed.hf_device_map.values()) == {"cpu", "disk"}
        assert any(hasattr(m, "_hf_hook") for m in placed.modules())  # accelerate really wraps layers
    placed.generation_config.eos_token_id = None
    draft = tiny_draft(placed, 48)
    for length in (1, 9):
        ids = prompt(length, seed=4)
        reference = t.generate(ids, do_sample=False, max_new_tokens=8)
        assert torch.equal(placed.generate(ids, do_sample=False, max_new_tokens=8), reference)
        out = placed.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft, num_assistant_tokens=3)
        assert torch.equal(out, reference)
    assert pre_hooks(placed) == []


def test_hook_is_installed_on_import():
    assert hf_eagle3.is_eagle3_draft(tiny_draft(target()))
    assert not hf_eagle3.is_eagle3_draft(tiny_hf_assistant())
    assert getattr(GenerationMixin.generate, "_hf_eagle3_hook", None) == hf_eagle3.core.generate_hook.HOOK_VERSION


def test_inputs_embeds_need_input_ids():
    t, draft = target(), tiny_draft(target(), 48)
    ids = prompt(seed=5)
    embeds = t.get_input_embeddings()(ids).detach() * 1.01  # differs from the ids' own embedding
    reference = t.generate(ids, inputs_embeds=embeds, do_sample=False, max_new_tokens=8)
    out = t.generate(ids, inputs_embeds=embeds, do_sample=False, max_new_tokens=8, assistant_model=draft)
    assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="pass `input_ids` too"):
        t.generate(inputs_embeds=embeds, do_sample=False, max_new_tokens=8, assistant_model=draft)
    assert pre_hooks(t) == []
