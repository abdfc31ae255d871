"""Host synchronisations per decoding round, counted on the CPU with :class:`host_syncs.HostSyncCounter` (the
operations that would block the host on a GPU), per path: none inside a draft forward on any path, and at most one
read-back per round on every path of hf-eagle3's own (trees, batches, greedy and sampled).

Both directions count: reads to the host, and copies to the device from pageable host memory. Counts are marginal:
the difference between a call of 32 and one of 16 new tokens, divided by the difference in rounds, so that what a
call does once (prefill, settings, the cost model) cancels. The draft is random, so nearly every
round accepts nothing."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from conftest import tiny_draft, tiny_target
from host_syncs import HostSyncCounter
from transformers import CompileConfig

from hf_eagle3.core import drafter as drafter_module
from hf_eagle3.core import transformers_compat as compat
from hf_eagle3.core import tree_policy
from hf_eagle3.core.draft_round import draft_round

PATHS = {
    "chain k=5": dict(num_assistant_tokens=5, num_assistant_tokens_schedule="constant"),
    "chain auto": dict(num_assistant_tokens=5, num_assistant_tokens_schedule="auto"),
    "tree 4x4x8": dict(tree_top_k=4, tree_depth=4, tree_total_tokens=8),
    "tree auto": dict(tree_top_k=4, tree_depth=4, tree_total_tokens="auto"),
    "tree 4x4x8, static cache": dict(tree_top_k=4, tree_depth=4, tree_total_tokens=8, cache_implementation="static"),
    # A round drafted as one captured region (static drafting steps), its function run eagerly under the counter.
    "tree 4x4x8, captured round": dict(tree_top_k=4, tree_depth=4, tree_total_tokens=8),
    "tree auto, captured round": dict(tree_top_k=4, tree_depth=4, tree_total_tokens="auto"),
}

# hf-eagle3's marginal host syncs per round: (path, batch size, sampled) -> ceiling. Chains at batch 1 run in
# Transformers' loop (none of ours); every path of ours reads the round back once (the verified trees of all rows and
# the target's choices or sampling decisions at every node, in one transfer).
CEILINGS = {
    (path, size, sample): 0.0 if (path == "chain k=5" and size == 1) else 1.0
    for path in ("chain k=5", "tree 4x4x8") for size in (1, 2, 4, 8) for sample in (False, True)
}
CEILINGS.update({("chain auto", 2, False): 1.0, ("chain auto", 2, True): 1.0, ("tree auto", 2, True): 1.0})
CEILINGS.update({("tree auto", size, False): 1.0 for size in (1, 2, 4, 8)})
CEILINGS.update({("tree auto", 1, True): 1.0})
CEILINGS.update({(path, size, sample): 1.0 for path in ("tree 4x4x8, captured round", "tree auto, captured round")
                 for size in (1, 4) for sample in (False, True)})
if compat.ASSISTS_ON_STATIC_CACHE:
    CEILINGS.update({("tree 4x4x8, static cache", size, sample): 1.0 for size in (1, 4) for sample in (False, True)})


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, tiny_draft(target)


def batch(size: int, length: int = 12):
    """Random prompts, rows after the first left-padded by 1 or 2 positions."""
    ids = torch.randint(4, 256, (size, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for b in range(size):
        ids[b, : b % 3], mask[b, : b % 3] = 0, 0
    return ids, mask


@contextlib.contextmanager
def captured_rounds(draft, on: bool):
    """With ``on``: the draft's steps static (a compile config that asks for them), each round drafted by
    :func:`~hf_eagle3.core.draft_round.draft_round`, run uncompiled so that the counter sees every operation; ``"auto"``
    trees drafted every round (the random draft's would not pay)."""
    if not on:
        yield None
        return
    draft.generation_config.compile_config = CompileConfig(backend="eager", mode="reduce-overhead")
    ran = []

    def counted(*args, **kwargs):
        ran.append(1)
        return draft_round(*args, **kwargs)

    try:
        with mock.patch.object(type(draft), "step_call", lambda self, step: step), \
                mock.patch.object(drafter_module, "draft_round", counted), \
                mock.patch.object(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *args: True):
            yield ran
    finally:
        draft.generation_config.compile_config = None


def count(pair, path: str, size: int, sample: bool, new_tokens: int) -> HostSyncCounter:
    target, draft = pair
    ids, mask = batch(size)
    counter = HostSyncCounter(target, draft)
    torch.manual_seed(0)
    with captured_rounds(draft, "captured" in path) as ran, counter, torch.no_grad():
        counter.new_call()
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=new_tokens,
                        do_sample=sample, **PATHS[path])
    assert ran is None or ran or new_tokens < 16, "no round was drafted as a captured round"
    return counter


def marginal(pair, path: str, size: int, sample: bool, callers=("ours",)) -> tuple[float, HostSyncCounter]:
    """The syncs per round of ``callers`` (hf-eagle3 by default) between a 16- and a 32-token call (after a warm-up
    call), and the longer call's counter."""
    count(pair, path, size, sample, 4)
    short, long = (count(pair, path, size, sample, n) for n in (16, 32))
    ours = [sum(n for (who, _), n in c.counts.items() if who in callers) for c in (short, long)]
    assert long.rounds > short.rounds
    return (ours[1] - ours[0]) / (long.rounds - short.rounds), long


@pytest.mark.parametrize("path,size,sample", sorted(CEILINGS))
def test_syncs_per_round_stay_within_the_ceiling(pair, path, size, sample):
    per_round, counter = marginal(pair, path, size, sample)
    assert counter.rounds >= 16  # half the 32 tokens: enough rounds for a per-round count
    places = {k: v for k, v in counter.places.items() if k[0] == "ours"}
    assert per_round <= CEILINGS[(path, size, sample)] + 1e-9, places


@pytest.mark.parametrize("path", sorted(p for p in PATHS if "static" not in p or compat.ASSISTS_ON_STATIC_CACHE))
@pytest.mark.parametrize("size,sample", [(1, False), (1, True), (2, False), (2, True)])
def test_no_sync_inside_a_draft_forward(pair, path, size, sample):
    counter = count(pair, path, size, sample, 16)
    assert counter.rounds >= 8
    assert not counter.in_draft, dict(counter.in_draft)


def test_the_counter_sees_a_sync_added_to_a_draft_step(pair, monkeypatch):
    """Negative control: a draft forward that reads a value back is caught, and the greedy tree's count rises."""
    target, draft = pair
    forward = type(draft).forward

    def forward_with_sync(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out[0].flatten()[0].item()
        return out

    monkeypatch.setattr(type(draft), "forward", forward_with_sync)
    per_round, counter = marginal(pair, "tree 4x4x8", 1, False, callers=("ours", "other"))
    assert sum(counter.in_draft.values()) >= counter.rounds
    assert per_round > CEILINGS[("tree 4x4x8", 1, False)] + 1


@pytest.mark.parametrize("path,size", [("tree 4x4x8", 1), ("chain k=5", 4), ("tree 4x4x8, captured round", 4)])
def test_the_counter_sees_copies_to_the_device(pair, monkeypatch, path, size):
    """Negative control of the other direction: counted as pageable copies, the index tensors a round builds from
    host values (roots, accepted paths, the feed) would exceed the ceiling."""
    import host_syncs

    monkeypatch.setattr(host_syncs, "NON_BLOCKING", "nowhere")
    per_round, counter = marginal(pair, path, size, False)
    copies = sum(n for (who, _, op), n in counter.places.items() if who == "ours" and op in host_syncs.HOST_DATA)
    assert copies >= counter.rounds and per_round > CEILINGS[(path, size, False)], dict(counter.places)
