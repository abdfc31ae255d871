"""Drafting captured whole: with static drafting steps (``draft.generation_config.compile_config`` asking for them),
each round of the package's loop (the feed padded to a bucket, every level, top-k, selection, masks) runs as one
compiled region.

Over a 256-token call, fixed trees and ``"auto"`` trees, one row and a ragged batch: no graph break (dynamo's graph
capture with ``fullgraph=True``, which also fails on any read of a value to the host inside), one graph per shape
bucket the call used and none more, a second call compiling only for buckets the first did not use (none for a fixed
shape; ``"auto"``'s sizes follow the rounds' timings), and the output identical to the target alone (greedy, fp32).
With the target's own rounds compiled on a static cache as well, the same. Equality with the eager drafting, round
by round, is in ``test_compiled_drafting.py`` and ``test_drafter.py``; sampling in ``test_compiled_drafting.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import endless_pair, random_prompt
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_eagle3.core import tree_policy
from hf_eagle3.core import transformers_compat as compat
from hf_eagle3.core.draft_round import FEED_BUCKETS
from hf_eagle3.core.target_cache import NODE_BUCKETS

CAPTURED = CompileConfig(backend="aot_eager", mode="reduce-overhead", fullgraph=True)
SHAPES = {
    "tree 3x4x8": dict(tree_top_k=3, tree_depth=4, tree_total_tokens=8),
    "tree auto": dict(tree_top_k=3, tree_depth=4, tree_total_tokens="auto"),
}


@pytest.fixture(scope="module")
def pair():
    return endless_pair()


@pytest.fixture(autouse=True)
def trees_every_round(monkeypatch):
    """``"auto"`` trees drafted every round (a random draft's would not pay)."""
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *args: True)


def prompts(rows: int):
    if rows == 1:
        return random_prompt(9, seed=21), {}
    ids = torch.randint(4, 256, (rows, 11), generator=torch.Generator().manual_seed(22))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # ragged rows
    return ids, {"attention_mask": mask}


def call(target, draft, ids, extra, shape, new_tokens=256, **kwargs):
    """One greedy call with captured rounds; returns the output and the graphs it compiled."""
    draft.generation_config.compile_config = CAPTURED
    counters.clear()
    try:
        out = target.generate(ids, do_sample=False, assistant_model=draft, max_new_tokens=new_tokens,
                              **extra, **SHAPES[shape], **kwargs)
    finally:
        draft.generation_config.compile_config = None
    return out, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_long_call_compiles_one_graph_per_bucket(pair, drafters, shape, rows):
    target, draft = pair
    torch.compiler.reset()
    ids, extra = prompts(rows)
    out, graphs = call(target, draft, ids, extra, shape)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=256, **extra))
    buckets = drafters[-1].buckets
    assert graphs == len(buckets) >= 2  # the prompt's eager feed, then padded feeds
    # The bound: feed widths (and the eager feed) x depths x node buckets.
    assert len(buckets) <= (len(FEED_BUCKETS) + 1) * SHAPES[shape]["tree_depth"] * len(NODE_BUCKETS)
    again, more = call(target, draft, ids, extra, shape)
    assert torch.equal(again, out)
    assert more == len(drafters[-1].buckets - buckets)  # "auto" sizes follow timings: maybe a bucket not used before
    if shape != "tree auto":
        assert more == 0


@pytest.mark.skipif(not compat.ASSISTS_ON_STATIC_CACHE, reason="Transformers refuses assisted decoding on a static "
                    "cache before 5.24")
@pytest.mark.parametrize("rows", [1, 3])
def test_captured_rounds_with_the_targets_compiled_rounds(pair, drafters, rows):
    """A static target cache with a compiled forward too: the target's graphs (per node width) and the draft's (per
    bucket) compile once each; the output is the target's."""
    target, draft = pair
    torch.compiler.reset()
    ids, extra = prompts(rows)
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # a CPU: Transformers compiles only on accelerators unless told so
    kwargs = dict(cache_implementation="static", compile_config=config)
    out, graphs = call(target, draft, ids, extra, "tree auto", new_tokens=128, **kwargs)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=128, **extra))
    buckets = drafters[-1].buckets
    assert graphs > len(buckets)  # the target's graphs besides the draft's
    again, more = call(target, draft, ids, extra, "tree 3x4x8", new_tokens=128, **kwargs)
    assert torch.equal(again, out)
    again, more = call(target, draft, ids, extra, "tree 3x4x8", new_tokens=128, **kwargs)
    assert torch.equal(again, out) and more == 0  # a fixed shape: the same buckets and widths again
