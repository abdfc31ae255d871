"""Trees and batches on a static target cache (``cache_implementation="static"``), eager and compiled.

The package's loop keeps every round's shapes fixed on a static cache: the batch keeps its size (finished rows stay as
padding), the nodes are padded to a bucket's width and the attention mask spans the cache's capacity; a compiled
forward (Transformers' own ``compile_config``) then compiles once per bucket. Checked here: greedy identity with
plain ``generate`` (random drafts, drafts that are mostly accepted, so the accepted paths are gathered, and ragged
batches whose rows finish at different rounds), the sampled distribution (with its negative control), zero graph
breaks and one graph per bucket in the compiled forward, the commit's kernels independent of the number of layers,
and the refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import (
    break_tree_sampling,
    cached_draft,
    cached_target,
    plain_continuations,
    random_prompt,
    sampling_models,
    tiny_draft,
    tiny_target,
    token_p_values,
)
from test_batched_decoding import OracleDrafter, padded_batch
from test_target_cache import _Ops
from test_tree_decoding import oracle
from transformers import CompileConfig, StaticCache

from hf_eagle3.core import decoding_loop, draft_cache
from hf_eagle3.core import transformers_compat as compat
from hf_eagle3.core.generate_hook import use_drafting
from hf_eagle3.core.target_cache import NODE_BUCKETS, StaticPool

pytestmark = pytest.mark.skipif(not compat.ASSISTS_ON_STATIC_CACHE,
                                reason="Transformers refuses assisted decoding on a static cache before 5.24 "
                                       "(tests/test_transformers_compat.py checks that refusal)")

STATIC = dict(cache_implementation="static")
TREES = [dict(tree_top_k=2, tree_depth=3, tree_total_tokens=6), dict(tree_top_k=4, tree_depth=4,
                                                                      tree_total_tokens="auto")]
CHAIN = dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant")


def compiled(fullgraph: bool = True) -> CompileConfig:
    """A compile config that Transformers honours on a CPU (dynamo traces with the ``eager`` backend: no code
    generated, the graphs and their breaks are real)."""
    config = CompileConfig(backend="eager", fullgraph=fullgraph, dynamic=False)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_trees_on_a_static_cache_equal_plain_generate(arch):
    target, draft = cached_target(arch), cached_draft(arch)
    ids = random_prompt(7, seed=4)
    reference = target.generate(ids, do_sample=False, max_new_tokens=24)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=24, **STATIC), reference)
    for shape in TREES:
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24, **STATIC, **shape)
        assert torch.equal(out, reference), shape
        assert draft.last_stats.num_target_forwards == 24 - draft.last_stats.num_accepted_tokens


@pytest.mark.parametrize("shape", [(2, 5, 10), (1, 6, 6)])
def test_accepted_paths_are_gathered_in_the_static_cache(shape):
    """A draft that is mostly right: the accepted nodes are rarely contiguous, so keeping the wrong entries of the
    static cache would change the output; the cache returned holds what plain ``generate``'s holds."""
    target = cached_target("llama")
    ids = random_prompt(21, seed=7)
    reference = target.generate(ids, do_sample=False, max_new_tokens=30)
    draft = oracle(tiny_draft(target, seed=3), reference[0].tolist(), second_every=10**9 if shape[0] == 1 else 2)
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=30, return_dict_in_generate=True,
                          tree_top_k=shape[0], tree_depth=shape[1], tree_total_tokens=shape[2], **STATIC)
    assert torch.equal(out.sequences, reference)
    assert draft.last_stats.mean_acceptance_length > 0.7 * (shape[1] + 1), draft.last_stats.to_dict()
    cache = out.past_key_values
    assert isinstance(cache, StaticCache)
    plain = target.generate(ids, do_sample=False, max_new_tokens=30, return_dict_in_generate=True).past_key_values
    length = plain.get_seq_length()
    for mine, theirs in zip(cache.layers, plain.layers):
        assert int(mine.cumulative_length) == length
        torch.testing.assert_close(mine.keys[:, :, :length], theirs.keys)
        torch.testing.assert_close(mine.values[:, :, :length], theirs.values)


@pytest.mark.parametrize("settings", [CHAIN, TREES[0]], ids=["chain", "tree"])
def test_batches_on_a_static_cache_keep_every_row_exact(settings):
    target, draft = cached_target("llama"), cached_draft("llama")
    ids, mask = padded_batch((3, 12, 7, 1), seed=2)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=11)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=11, assistant_model=draft,
                          **STATIC, **settings)
    assert torch.equal(out, reference)
    assert all(s.num_output_tokens == 11 for s in draft.last_batch_stats)


class TakingTurns(OracleDrafter):
    """Rows take turns at drafting right (all of the round's tokens, then none): the cache grows by the longest path
    every round while each row grows half as fast, so holes pile up."""

    def right(self, row: int, fed: int, reference: list, depth: int) -> int:
        self.calls = getattr(self, "calls", 0) + 1
        return depth if (self.calls // len(self.history) + row) % 2 == 0 else 0


@pytest.mark.parametrize("settings", [CHAIN, dict(tree_top_k=3, tree_depth=4, tree_total_tokens=8)],
                         ids=["chain", "tree"])
def test_ragged_rows_finish_apart_and_stay_as_padding(settings, monkeypatch):
    """Rows accept different numbers of tokens each round (holes, compaction once the capacity fills) and finish at
    different rounds; the target's forwards keep the call's batch size throughout."""
    target, draft = cached_target("llama"), cached_draft("llama")
    ids, mask = padded_batch((4, 13, 8, 2, 10), seed=7)
    # An end-of-sequence token that ends some rows early, at different lengths.
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=60)[:, ids.shape[1]:].tolist()
    eos = next(t for t in free[1][5:] if sum(t in row for row in free) in (2, 3))
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=60, eos_token_id=eos,
                                pad_token_id=0)
    TakingTurns.references = [[t for t, m in zip(row, mk) if m] + row[len(mk):]
                              for row, mk in zip(reference.tolist(), mask.tolist())]
    monkeypatch.setattr(draft_cache, "static_capacity", lambda columns: columns)  # no room to spare: compactions
    monkeypatch.setattr(decoding_loop, "COMPACT_SLACK", 0)
    compactions, gather_rows = [], StaticPool.gather_rows
    monkeypatch.setattr(StaticPool, "gather_rows",
                        lambda self, index, start: (compactions.append(start == 0), gather_rows(self, index, start)))
    widths = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                              with_kwargs=True)
    try:
        with use_drafting(drafter=TakingTurns):
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False,
                                  max_new_tokens=60, eos_token_id=eos, pad_token_id=0, **STATIC, **settings)
    finally:
        handle.remove()
    assert torch.equal(out, reference)
    rounds = [s.num_target_forwards for s in draft.last_batch_stats]
    assert len(set(rounds)) > 1, rounds  # the rows finished at different rounds
    assert any(compactions), "the holes never filled the capacity"
    assert {w[0] for w in widths} == {5}, widths  # no forward dropped a finished row
    assert {w[1] for w in widths[1:]} <= {*NODE_BUCKETS, 9}, widths  # the buckets, and the tree's own 8 + 1


def test_compiled_rounds_have_no_graph_break_and_one_graph_per_bucket():
    """256 new tokens of tree ``"auto"`` (sizes change every round), and a batch of 3, compiled after plain decoding
    and a chain compiled theirs: no graph break, a graph for each (bucket, batch size) used and no more (past torch's
    default limit of 8 graphs for the forward, which ``fullgraph=True`` turns into an error), the output equals plain
    ``generate``'s."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # graphs of other tests' models count towards dynamo's limit of graphs per function
    torch._dynamo.config.recompile_limit = 8  # torch's default (a compiled round raises it)
    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=3)
    # Plain decoding and Transformers' chain compile their graphs of the same forward first, as in a user's process
    # (the chain's features come from hooks before Transformers 5.25, which break its graph: not fullgraph there).
    reference = target.generate(ids, do_sample=False, max_new_tokens=24)
    for kwargs in ({}, dict(assistant_model=draft, **CHAIN)):
        out = target.generate(ids, do_sample=False, max_new_tokens=24, compile_config=compiled(
            fullgraph=compat.SELECTS_HIDDEN_STATES or not kwargs), **STATIC, **kwargs)
        assert torch.equal(out, reference)
    for batch, shape, new in ((ids, TREES[1], 256), (torch.cat([ids, random_prompt(6, seed=5), ids]), TREES[0], 48)):
        reference = target.generate(batch, do_sample=False, max_new_tokens=new)
        counters.clear()
        out = target.generate(batch, assistant_model=draft, do_sample=False, max_new_tokens=new,
                              compile_config=compiled(), **STATIC, **shape)
        assert torch.equal(out, reference)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert 1 <= counters["stats"]["unique_graphs"] <= len(NODE_BUCKETS) + 1, dict(counters["stats"])
    # The same call again (a fixed tree: the same buckets) compiles nothing new.
    counters.clear()
    target.generate(batch, assistant_model=draft, do_sample=False, max_new_tokens=new, compile_config=compiled(),
                    **STATIC, **shape)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])


def test_compiled_rounds_with_hook_features_take_them_from_outputs():
    """Features from hooks (Transformers 5.24's default) cannot tell threads apart inside a compiled forward: the
    compiled rounds take them from the forwards' hidden states, with no graph break and the same output."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target, draft = cached_target("qwen3"), cached_draft("qwen3")
    ids = random_prompt(9, seed=6)
    reference = target.generate(ids, do_sample=False, max_new_tokens=40)
    counters.clear()
    with use_drafting(features="hooks"):
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=40,
                              compile_config=compiled(), **STATIC, **TREES[0])
    assert torch.equal(out, reference)
    assert not counters["graph_break"], dict(counters["graph_break"])
    layers = target.model.layers
    assert all(not layer._forward_pre_hooks for layer in layers)


SAMPLING = dict(do_sample=True, max_new_tokens=4, temperature=1.5, top_k=10, top_p=0.8)
WIDE = dict(tree_top_k=10, tree_depth=2, tree_total_tokens=20)  # its children carry much of the target's mass


@functools.lru_cache(maxsize=None)
def plain_samples() -> list:
    """20000 continuations sampled from the target alone (one batched call)."""
    target, _ = sampling_models()
    return plain_continuations(target, torch.tensor([[5, 7, 9, 11]]), 20000, **SAMPLING)


def static_samples(settings: dict, seed: int) -> list:
    """500 continuations of one prompt sampled on a static cache, 4 rows a call (each row samples on its own)."""
    target, draft = sampling_models()
    prompt = torch.tensor([[5, 7, 9, 11]])
    samples = []
    for i in range(125):
        torch.manual_seed(seed + i)
        out = target.generate(prompt.repeat(4, 1), assistant_model=draft, **SAMPLING, **STATIC, **settings)
        samples += out[:, prompt.shape[1]:].tolist()
    return samples


@pytest.mark.parametrize("settings", [WIDE, CHAIN], ids=["tree", "chain"])
def test_sampling_on_a_static_cache_keeps_the_target_distribution(settings):
    p = token_p_values(static_samples(settings, seed=7000), plain_samples())
    assert min(p.values()) > 1e-3 / 2, p


def test_negative_control_on_a_static_cache(monkeypatch):
    break_tree_sampling(monkeypatch)
    p = token_p_values(static_samples(WIDE, seed=5000), plain_samples())
    assert min(p.values()) < 1e-3 / 2, p


def _static_cache(num_layers: int, rows: int = 2, length: int = 6, capacity: int = 32, seed: int = 0):
    """A static cache of ``num_layers`` layers after a prefill of ``length`` entries, pooled."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2, hidden_size=8)
    cache = StaticCache(config=config, max_cache_len=capacity)
    generator = torch.Generator().manual_seed(seed)
    for i in range(num_layers):
        cache.update(torch.randn(rows, 2, length, 4, generator=generator),
                     torch.randn(rows, 2, length, 4, generator=generator), i)
    return cache, StaticPool(cache, length)


def test_static_commit_kernels_do_not_depend_on_the_layers():
    counts = {}
    for num_layers in (2, 7):
        cache, pool = _static_cache(num_layers)
        generator = torch.Generator().manual_seed(1)
        for i in range(num_layers):
            cache.update(torch.randn(2, 2, 8, 4, generator=generator), torch.randn(2, 2, 8, 4, generator=generator), i)
        pool.wrote(8)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        index = torch.tensor([[0, 2, 5], [0, 1, 7]])
        with _Ops() as ops:
            pool.gather_rows(index, 6)
        counts[num_layers] = len(ops.ops)
        for layer, (keys, values) in zip(cache.layers, before):
            for b in range(2):
                assert torch.equal(layer.keys[b, :, 6:9], keys[b, :, 6 + index[b]])
                assert torch.equal(layer.values[b, :, 6:9], values[b, :, 6 + index[b]])
            assert int(layer.cumulative_length) == 9
        with _Ops() as ops:
            pool.set_length(9)
        assert len(ops.ops) == 1  # one fill for every layer's length
    assert counts[2] == counts[7] <= 5, counts  # the index and its offset, its expansion, one gather, one copy, the fill


def test_sliding_window_layers_on_a_static_cache_are_refused_before_work():
    target = tiny_target("gemma3")
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    calls = []
    handle = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="attend fully.*drop cache_implementation"):
            target.generate(random_prompt(6), assistant_model=draft, do_sample=False, max_new_tokens=8, **STATIC,
                            **TREES[0])
    finally:
        handle.remove()
    assert not calls


def test_compiled_rounds_refuse_a_layers_path_before_work(monkeypatch):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    monkeypatch.setattr(draft.config, "target_layers_path", "model.layers")
    calls = []
    handle = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="target_layers_path.*disable_compile"):
            target.generate(random_prompt(6), assistant_model=draft, do_sample=False, max_new_tokens=8,
                            compile_config=compiled(), **STATIC, **TREES[0])
    finally:
        handle.remove()
    assert not calls


def test_a_round_that_compiles_is_not_timed(monkeypatch):
    """The first round of each (rows, width, cache capacity) compiles its graph: its seconds are the compiler's, so
    the budget of tree ``"auto"`` does not learn them as the round's cost; every later round is observed."""
    from hf_eagle3.core.budget import TreeBudget

    torch._dynamo.reset()
    target = tiny_target("llama", seed=11)
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    observed, widths = [], []
    observe = TreeBudget.observe
    monkeypatch.setattr(TreeBudget, "observe", lambda self, outcome: (observed.append(outcome.nodes),
                                                                      observe(self, outcome)))
    bucket = decoding_loop.node_bucket
    monkeypatch.setattr(decoding_loop, "node_bucket",
                        lambda nodes, widest: widths.append(bucket(nodes, widest)) or widths[-1])
    for new in (40, 200):  # the second call needs a larger cache: every width compiles again for its capacity
        observed.clear(), widths.clear()
        target.generate(random_prompt(6, seed=2), assistant_model=draft, do_sample=False, max_new_tokens=new,
                        compile_config=compiled(), **STATIC, **TREES[1])
        rounds = widths[1:]  # the first is the call's capacity
        assert len(observed) == len(rounds) - len(set(rounds)) > 0, (new, observed, rounds)
