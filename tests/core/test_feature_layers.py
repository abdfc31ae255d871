"""Drafts that read more than three target layers (``feature_layer_ids`` listing more, as DeepSpec's EAGLE-3 recipe
taps five): ``fc`` fuses that many hidden states, every decoding path stays exact, the checkpoint keeps them, and the
layouts whose engines fuse exactly three refuse before writing anything; fewer than three is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_target as target_of
from conftest import greedy, random_prompt, tiny_draft

import hf_eagle3
from hf_eagle3.checkpoints.export import export_flat, export_speculators
from hf_eagle3.checkpoints.openvino import openvino_layer_ids
from hf_eagle3.core.configuration_eagle3 import default_feature_layer_ids

FIVE = [0, 1, 1, 2, 3]  # inputs of these layers of the 4-layer tiny target


def test_default_layers_and_refusals():
    assert default_feature_layer_ids(32) == [2, 16, 29]  # the reference [2, N // 2, N - 3]
    assert default_feature_layer_ids(32, 5) == [2, 9, 16, 22, 29]  # spread evenly from 2 to N - 3
    with pytest.raises(ValueError, match="at least 3 target layers"):
        default_feature_layer_ids(32, 2)
    target = target_of("llama")
    with pytest.raises(ValueError, match="at least 3 layers"):
        tiny_draft(target, feature_layer_ids=[1, 2])


def _features_seen(draft, monkeypatch) -> list:
    """Record the width of the features every draft forward fuses."""
    seen, project = [], draft.project_features
    monkeypatch.setattr(draft, "project_features", lambda f: seen.append(f.shape[-1]) or project(f))
    return seen


@pytest.mark.parametrize("settings", [dict(num_assistant_tokens=3),
                                      dict(tree_top_k=2, tree_depth=3, tree_total_tokens=6)], ids=["chain", "tree"])
def test_a_five_layer_draft_decodes_exactly(settings, monkeypatch):
    target = target_of("llama")
    draft = tiny_draft(target, seed=2, feature_layer_ids=FIVE)
    width = target.config.hidden_size
    assert draft.config.num_feature_layers == 5 and draft.fc.in_features == 5 * width
    seen = _features_seen(draft, monkeypatch)
    for rows in (1, 2):
        ids = torch.cat([random_prompt(7, seed=3 + b) for b in range(rows)])
        mask = torch.ones_like(ids)
        out = greedy(target, ids, attention_mask=mask, max_new_tokens=14, assistant_model=draft, **settings)
        assert torch.equal(out, greedy(target, ids, attention_mask=mask, max_new_tokens=14))
    assert seen and set(seen) == {5 * width}  # every draft forward fused five hidden states


def test_the_layers_survive_saving_and_only_native_layouts_take_them(tmp_path):
    target = target_of("llama")
    draft = tiny_draft(target, seed=2, feature_layer_ids=FIVE)
    draft.save_pretrained(tmp_path / "native")
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "native")
    assert again.config.feature_layer_ids == FIVE and torch.equal(again.fc.weight, draft.fc.weight)
    for export, name in ((export_flat, "flat"), (export_speculators, "speculators")):
        with pytest.raises(ValueError, match=f"The {name} layout .* exactly 3 target layers .* --format native"):
            export(draft, tmp_path / name)
        assert not (tmp_path / name).exists()  # refused before anything was written
    with pytest.raises(ValueError, match="exactly three decoder layers"):
        openvino_layer_ids(draft.config)
    three = tiny_draft(target, seed=2, feature_layer_ids=[1, 2, 3])
    assert (export_flat(three, tmp_path / "flat3") / "config.json").exists()  # the control: three layers export
