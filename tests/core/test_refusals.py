"""Inputs EAGLE-3 decoding cannot take are refused before any target forward, on every path (batch-1 chain, tree,
batch), with a message that names the input and the fix: an empty prompt, a draft built in memory whose ``d2t`` maps
outside the target's vocabulary, and a draft on the meta device. A refused call leaves no hook on the target and
nothing bound on the draft, and plain ``generate`` works after it."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_draft, cached_target, random_prompt, tiny_draft

import hf_eagle3
from hf_eagle3.core.generate_hook import _ACTIVE

PATHS = {
    "chain": dict(rows=1, kwargs={}),
    "tree": dict(rows=1, kwargs=dict(tree_total_tokens=6, tree_depth=3, tree_top_k=2)),
    "batch": dict(rows=2, kwargs={}),
}


def hooks(model) -> dict:
    """Every forward pre-hook and forward hook on the modules of ``model``."""
    return {name: (list(m._forward_pre_hooks), list(m._forward_hooks)) for name, m in model.named_modules()
            if m._forward_pre_hooks or m._forward_hooks}


def refused_before_work(target, draft, ids, match: str, **kwargs) -> str:
    """Call ``target.generate(ids, assistant_model=draft, ...)``, expect a ``ValueError`` matching ``match`` with no
    target forward run, no hook left on the target and no active call; return the message."""
    before = hooks(target)
    forwards = []
    handle = target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=match) as err:
            target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=6, **kwargs)
    finally:
        handle.remove()
    assert forwards == [], f"refused after {len(forwards)} target forward(s): {err.value}"
    assert hooks(target) == before and _ACTIVE.get() is None
    assert draft.last_stats is None  # no statistics published: the call did no work
    return str(err.value)


def plain_still_works(target, rows: int) -> None:
    """Plain ``generate`` and EAGLE-3 decoding with a good draft still give the target's own tokens."""
    ids = torch.cat([random_prompt(5, seed=10 + r) for r in range(rows)])
    reference = target.generate(ids, do_sample=False, max_new_tokens=6)
    assert reference.shape == (rows, 11)
    out = target.generate(ids, assistant_model=cached_draft("llama"), do_sample=False, max_new_tokens=6)
    assert torch.equal(out, reference)


# ------------------------------------------------------------------------------------------------ empty prompt
@pytest.mark.parametrize("path", sorted(PATHS))
def test_an_empty_prompt_is_refused_naming_the_fix(path):
    """``input_ids`` of shape [B, 0]: plain ``generate`` fails on it too (no position to start from), so EAGLE-3
    refuses it up front, naming the shape and the fix (a BOS token, or no ``input_ids``). ``generate`` without
    ``input_ids`` starts from BOS and decodes as the target alone does."""
    target, spec = cached_target("llama"), PATHS[path]
    draft = tiny_draft(target)
    empty = torch.zeros(spec["rows"], 0, dtype=torch.long)
    message = refused_before_work(target, draft, empty, "empty prompt", **spec["kwargs"])
    assert f"shape {(spec['rows'], 0)}" in message and "bos_token_id" in message and "without input_ids" in message
    assert draft._target_embedding is None  # refused before binding
    plain_still_works(target, spec["rows"])
    if spec["rows"] == 1:  # the fix named: no input_ids, generate starts from BOS
        reference = target.generate(do_sample=False, max_new_tokens=6)
        out = target.generate(assistant_model=draft, do_sample=False, max_new_tokens=6, **spec["kwargs"])
        assert torch.equal(out, reference)


def test_an_empty_prompt_with_inputs_embeds_names_the_token_ids():
    target = cached_target("llama")
    draft = tiny_draft(target)
    embeds = target.get_input_embeddings()(random_prompt(5, seed=3))
    message = refused_before_work(target, draft, torch.zeros(1, 0, dtype=torch.long), "empty prompt",
                                  inputs_embeds=embeds)
    assert "inputs_embeds" in message and "token ids" in message


# ------------------------------------------------------------------------------------------------ d2t out of range
def out_of_range_draft(target):
    """A draft built in memory (draft vocabulary 64) whose last ``d2t`` entry maps past the target's vocabulary."""
    draft = tiny_draft(target, 64)
    with torch.no_grad():
        draft.d2t[-1] = target.config.vocab_size  # draft token 63 -> target token 63 + 256
    return draft


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_d2t_outside_the_target_vocabulary_is_refused_at_generate(path):
    """The check a checkpoint gets when loaded holds for a draft built in memory: refused when ``generate`` binds it,
    before the prefill, whichever entry is wrong (not only when that token is drafted)."""
    target, spec = cached_target("llama"), PATHS[path]
    draft = out_of_range_draft(target)
    ids = torch.cat([random_prompt(6, seed=4 + r) for r in range(spec["rows"])])
    message = refused_before_work(target, draft, ids, "d2t maps draft tokens outside the target vocabulary",
                                  **spec["kwargs"])
    assert "[0, 256)" in message and "draft token 63 -> target token 319" in message
    assert "the mapping the draft was trained with" in message  # the fix
    assert draft._target_embedding is None
    plain_still_works(target, spec["rows"])


def test_a_d2t_check_is_the_same_on_disk_and_in_memory(tmp_path):
    """One decision: loading the same draft from disk refuses it with the same message (but the source), and a draft
    whose ``d2t`` is repaired in place is checked again and decodes as the target alone."""
    target = cached_target("llama")
    draft = out_of_range_draft(target)
    draft.save_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError) as on_disk:
        hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError) as in_memory:
        draft.bind_target(target)
    assert str(on_disk.value).split(": ", 1)[1] == str(in_memory.value).split(": ", 1)[1]
    assert str(on_disk.value).startswith(str(tmp_path / "bad"))
    with torch.no_grad():
        draft.d2t[-1] = 0  # repaired in place (draft token 63 -> target token 63)
    ids = random_prompt(6, seed=5)
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=6)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=6))


# ------------------------------------------------------------------------------------------------ meta device
def meta_draft(target):
    """A draft built under ``torch.device("meta")``: shapes, no values."""
    with torch.device("meta"):
        return hf_eagle3.Eagle3DraftModel(tiny_draft(target).config)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_draft_on_the_meta_device_is_refused_naming_the_fix(path):
    """A draft whose weights were never loaded is refused before any target forward, naming the fix; the fix named
    (``to_empty`` then ``load_checkpoint_state_dict``) makes it decode as the target alone."""
    target, spec = cached_target("llama"), PATHS[path]
    draft = meta_draft(target)
    ids = torch.cat([random_prompt(6, seed=6 + r) for r in range(spec["rows"])])
    message = refused_before_work(target, draft, ids, "meta device", **spec["kwargs"])
    assert "from_pretrained" in message and "to_empty" in message and "load_checkpoint_state_dict" in message
    assert draft._target_embedding is None
    plain_still_works(target, spec["rows"])
    good = tiny_draft(target)
    draft.to_empty(device="cpu")
    draft.load_checkpoint_state_dict({k: v.clone() for k, v in good.state_dict().items()})
    draft.eval()
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=6, **spec["kwargs"])
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=6))
