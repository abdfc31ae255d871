"""Compiled drafting: with ``draft.generation_config.compile_config`` set, the drafting steps (a chain's next token, a
tree's next level, for one sequence and for a batch) run under ``torch.compile`` and draft exactly what the eager
steps draft.

Each path is run twice on the same prompt, eager and compiled (``aot_eager``: dynamo's graph capture without a code
generator, numerically the eager kernels), and what the drafter proposes every round is recorded outside the compiled
region: the proposals must be identical, the output identical to the target alone, and compiled graphs must have run.
A longer call after a shorter one compiles nothing new. Every check runs with both kinds of compiled steps: dynamic
(``mode=None``: shapes that grow with the cache) and static (``mode="reduce-overhead"``, the mode that captures CUDA
graphs: preallocated caches read over their full capacity, positions as device tensors), for which one graph serves
every step of a call and the cache buffers keep their addresses from call to call. Sampled calls with the same seed
give the same tokens (the acceptance rule reads the compiled draft's probabilities). Inductor (the default backend,
which generates C++ on a CPU) runs under ``slow``. ``dynamic=True`` with a mode that captures CUDA graphs is refused
for a CUDA draft, with the fix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import endless_pair, random_prompt, tiny_draft
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_eagle3.core import candidate_generator, decoding_loop, draft_length_policy, tree_policy
from hf_eagle3.core import drafter as drafter_module
from hf_eagle3.core.draft_cache import Eagle3RowCache
from hf_eagle3.core.draft_state import Eagle3DraftState
from hf_eagle3.core.draft_steps import batch_tree_level, chain_step
from hf_eagle3.core.modeling_eagle3 import Eagle3DraftModel, check_step_compile, wants_static_steps

CAPTURE = CompileConfig(backend="aot_eager", mode=None, fullgraph=True)  # fullgraph: a graph break fails the test
# Static steps: the mode that captures CUDA graphs on a CUDA device (aot_eager ignores the mode itself).
STATIC = CompileConfig(backend="aot_eager", mode="reduce-overhead", fullgraph=True)
CONFIGS = {"dynamic": CAPTURE, "static": STATIC}
EAGER_STEPS = (chain_step, batch_tree_level)
PATHS = {
    "chain": dict(num_assistant_tokens=4, num_assistant_tokens_schedule="constant"),
    "chain auto": dict(num_assistant_tokens=4, num_assistant_tokens_schedule="auto"),
    "tree": dict(tree_top_k=3, tree_depth=4, tree_total_tokens=8),
    "tree auto": dict(tree_top_k=3, tree_depth=4, tree_total_tokens="auto"),
}


@pytest.fixture(scope="module")
def pair():
    return endless_pair()


@pytest.fixture
def proposals(monkeypatch):
    """Record, per round, what the drafters propose (chain candidates, a tree's tokens and parents, every row's tree
    in a batch), outside the compiled steps."""
    seen = []

    def record(owner, name, take):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            seen.append(take(result))
            return result

        monkeypatch.setattr(owner, name, wrapped)

    record(candidate_generator.Eagle3CandidateGenerator, "get_candidates", lambda r: r[0].tolist())
    record(drafter_module.Eagle3Drafter, "draft_round",
           lambda drafted: [(t.tokens.tolist(), t.parents.tolist()) for t in drafted.trees])
    record(Eagle3DraftModel, "step_call", lambda step: ("step", step in EAGER_STEPS))
    return seen


@pytest.fixture
def scripted_auto(monkeypatch):
    """``"auto"`` decisions from a script instead of timings (which differ between an eager and a compiled run):
    draft lengths 3, 0, 4, 1, ... and tree sizes 5, 8, 2, ..., a tree every round, every level expanded."""
    def script(values):
        def next_value(self, *args, **kwargs):  # counted per policy: each call starts the script again
            self.scripted_calls = getattr(self, "scripted_calls", -1) + 1
            value = values[self.scripted_calls % len(values)]
            return min(value, args[0]) if args and isinstance(args[0], int) else value

        return next_value

    monkeypatch.setattr(draft_length_policy.Eagle3DraftLengthPolicy, "choose", script([3, 0, 4, 1, 2]))
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "choose", script([5, 8, 2, 7]))
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *batch: True)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "levels", lambda self, frontier, most: most)
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "first_nodes", lambda self, most: min(tree_policy.AUTO_FIRST, most))
    # Every round observed, as in the eager run (a round that compiles a graph is otherwise left out of what the
    # budget learns, which changes which of the scripted choices it asks for).
    monkeypatch.setattr(decoding_loop, "compiled_graphs", lambda: 0)


def captured_buckets(drafters) -> set:
    """The buckets of the latest call's captured rounds (empty when no round was captured: chains at one row run in
    Transformers' loop, with per-step graphs)."""
    captured = [d for d in drafters if d.whole_round is not None]
    return set(captured[-1].buckets) if captured else set()


def run(target, draft, ids, config, proposals, **kwargs):
    """One ``generate`` call with ``config`` as the draft's compile config; returns the output, the proposals and the
    number of graphs compiled during the call, after checking that the drafting steps ran compiled (or eager)."""
    draft.generation_config.compile_config = config
    proposals.clear()
    counters.clear()
    try:
        out = target.generate(ids, do_sample=False, assistant_model=draft, **kwargs)
    finally:
        draft.generation_config.compile_config = None
    steps = [eager for kind, eager in (p for p in proposals if isinstance(p, tuple) and p[0] == "step")]
    assert steps and all(eager == (config is None) for eager in steps)
    drafts = [p for p in proposals if not (isinstance(p, tuple) and p[0] == "step")]
    return out, drafts, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("path", list(PATHS))
def test_compiled_steps_draft_what_eager_steps_draft(pair, proposals, scripted_auto, drafters, path, kind):
    target, draft = pair
    ids = random_prompt(9, seed=3)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    eager, eager_drafts, eager_graphs = run(target, draft, ids, None, proposals, max_new_tokens=24, **PATHS[path])
    compiled, compiled_drafts, _ = run(target, draft, ids, CONFIGS[kind], proposals, max_new_tokens=24,
                                       **PATHS[path])
    assert eager_graphs == 0
    assert torch.equal(eager, plain) and torch.equal(compiled, plain)
    assert len(eager_drafts) >= 5
    assert compiled_drafts == eager_drafts
    # A longer call reuses the graphs: nothing is compiled per length (static: the same capacity bucket; a captured
    # round, which a static tree runs, compiles only for the shape buckets the shorter call did not use).
    used = captured_buckets(drafters)
    longer, _, more = run(target, draft, ids, CONFIGS[kind], proposals, max_new_tokens=48, **PATHS[path])
    assert torch.equal(longer, target.generate(ids, do_sample=False, max_new_tokens=48))
    assert more == len(captured_buckets(drafters) - used)


def test_compiled_steps_run(pair):
    """The compiled path is taken: with dynamo's caches emptied, the call compiles the chain step's graphs."""
    target, draft = pair
    torch.compiler.reset()
    draft.generation_config.compile_config = CAPTURE
    counters.clear()
    try:
        out = target.generate(random_prompt(7, seed=4), do_sample=False, max_new_tokens=12, assistant_model=draft,
                              num_assistant_tokens=3)
    finally:
        draft.generation_config.compile_config = None
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(out, target.generate(random_prompt(7, seed=4), do_sample=False, max_new_tokens=12))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("path", ["chain", "tree"])
def test_batched_compiled_steps_draft_what_eager_steps_draft(pair, proposals, path, kind):
    target, draft = pair
    ids = torch.randint(4, 256, (3, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # ragged rows (left padding)
    mask[2, :6] = 0
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    eager, eager_drafts, _ = run(target, draft, ids, None, proposals, attention_mask=mask, max_new_tokens=20,
                                 **PATHS[path])
    compiled, compiled_drafts, _ = run(target, draft, ids, CONFIGS[kind], proposals, attention_mask=mask,
                                       max_new_tokens=20, **PATHS[path])
    assert torch.equal(eager, plain) and torch.equal(compiled, plain)
    assert len(eager_drafts) >= 5
    assert compiled_drafts == eager_drafts


@pytest.mark.parametrize("path", ["chain", "tree", "batched tree"])
def test_sampled_compiled_drafting_gives_the_eager_tokens(pair, path):
    """Same seed, same tokens: the acceptance rule reads the compiled draft's probabilities, equal to the eager ones
    (static steps: a tree's rounds, one row or a batch, captured whole). The eager paths' distributions are tested in
    ``test_sampling_distribution.py``."""
    target, draft = pair
    ids, extra = random_prompt(8, seed=6), {}
    if path == "batched tree":
        ids = torch.randint(4, 256, (3, 9), generator=torch.Generator().manual_seed(7))
        extra = {"attention_mask": torch.ones_like(ids)}
        extra["attention_mask"][2, :4] = 0
    outs = []
    for config in (None, CAPTURE, STATIC):
        draft.generation_config.compile_config = config
        torch.manual_seed(11)
        try:
            outs.append(target.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=24,
                                        assistant_model=draft, **extra, **PATHS[path.split()[-1]]))
        finally:
            draft.generation_config.compile_config = None
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_disable_compile_and_no_config_run_eager(pair):
    _, draft = pair
    assert draft.step_call(chain_step) is chain_step
    draft.generation_config.compile_config = CAPTURE
    draft.generation_config.disable_compile = True
    try:
        assert draft.step_call(chain_step) is chain_step
        draft.generation_config.disable_compile = False
        compiled = draft.step_call(chain_step)
        assert compiled is not chain_step and draft.step_call(chain_step) is compiled  # kept per config
    finally:
        draft.generation_config.compile_config = None
        draft.generation_config.disable_compile = None


@pytest.mark.parametrize("path", ["chain", "tree"])
def test_static_steps_compile_once_and_keep_their_buffers(pair, drafters, path):
    """Static steps: one graph serves every step of a call (positions grow, shapes do not, no Python number is baked
    in), and a second call reuses the first one's cache buffers (the same addresses, which CUDA graphs replay). A tree
    (the package's loop) runs each round as one captured region: one graph per shape bucket it uses (the feed's
    width, and the depth, which shrinks in the last rounds), none for a bucket used before."""
    target, draft = pair
    ids = random_prompt(9, seed=8)
    torch.compiler.reset()
    draft.static_kv_buffers.clear()
    draft.generation_config.compile_config = STATIC
    try:
        counters.clear()
        first = target.generate(ids, do_sample=False, max_new_tokens=40, assistant_model=draft, **PATHS[path])
        used = captured_buckets(drafters) or {"the chain step"}
        assert counters["stats"]["unique_graphs"] == len(used)
        assert len(used) <= 2 + PATHS[path].get("tree_depth", 0)  # the prompt's feed; the depths with theirs
        assert len(draft.static_kv_buffers) == 1
        buffers = [t.data_ptr() for t in next(iter(draft.static_kv_buffers.values()))]
        counters.clear()
        second = target.generate(random_prompt(12, seed=9), do_sample=False, max_new_tokens=30,
                                 assistant_model=draft, **PATHS[path])
        assert counters["stats"]["unique_graphs"] == len(captured_buckets(drafters) - used)
        assert [t.data_ptr() for t in next(iter(draft.static_kv_buffers.values()))] == buffers
        assert len(draft.static_kv_buffers) == 1
    finally:
        draft.generation_config.compile_config = None
    assert torch.equal(first, target.generate(ids, do_sample=False, max_new_tokens=40))
    assert torch.equal(second, target.generate(random_prompt(12, seed=9), do_sample=False, max_new_tokens=30))


@pytest.mark.parametrize("path", ["chain", "tree", "batched chain"])
def test_static_steps_of_a_sliding_window_draft(pair, proposals, path):
    """A sliding-window draft (window 4, shorter than the prompt): static steps' full-capacity masks keep the window,
    so they draft what the eager steps draft."""
    target, _ = pair
    draft = tiny_draft(target, 128, draft_sliding_window=4, seed=6)
    ids = random_prompt(9, seed=10)
    kwargs = dict(max_new_tokens=20, **PATHS["tree" if path == "tree" else "chain"])
    if path == "batched chain":
        ids = torch.randint(4, 256, (2, 9), generator=torch.Generator().manual_seed(6))
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["attention_mask"][1, :3] = 0
    eager, eager_drafts, _ = run(target, draft, ids, None, proposals, **kwargs)
    static, static_drafts, _ = run(target, draft, ids, STATIC, proposals, **kwargs)
    assert torch.equal(static, eager) and len(eager_drafts) >= 4
    assert static_drafts == eager_drafts


def test_which_configs_make_static_steps_and_which_are_refused():
    assert wants_static_steps(CompileConfig())  # Transformers' default: "reduce-overhead", dynamic unset
    assert wants_static_steps(CompileConfig(mode="max-autotune"))
    assert wants_static_steps(CompileConfig(mode="default", dynamic=False))
    assert not wants_static_steps(CompileConfig(mode="default"))
    assert not wants_static_steps(CompileConfig(mode="max-autotune-no-cudagraphs"))
    assert not wants_static_steps(CompileConfig(mode="reduce-overhead", dynamic=True))
    for mode in ("reduce-overhead", "max-autotune"):
        check_step_compile(CompileConfig(mode=mode), torch.device("cuda"))  # static steps: captured once
        with pytest.raises(ValueError, match="Leave dynamic unset"):
            check_step_compile(CompileConfig(mode=mode, dynamic=True), torch.device("cuda"))
        check_step_compile(CompileConfig(mode=mode, dynamic=True), torch.device("cpu"))  # no CUDA graphs on a CPU
    check_step_compile(CompileConfig(mode="default", dynamic=True), torch.device("cuda"))


def test_static_cache_refuses_to_grow_and_needs_a_capacity(pair):
    _, draft = pair
    cache = Eagle3RowCache(1, 8, static_buffers={})
    with pytest.raises(RuntimeError, match="cannot hold"):
        cache.place_shared(7, torch.ones(1, 1, 2, 9, dtype=torch.bool))
    draft.generation_config.compile_config = STATIC
    try:
        with pytest.raises(ValueError, match="capacity"):
            Eagle3DraftState(draft)
        assert Eagle3DraftState(draft, capacity=300).cache.capacity == 512  # its size bucket
    finally:
        draft.generation_config.compile_config = None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inductor_compiled_drafting_is_lossless(pair, proposals, mode):
    """The default backend (C++ code generated for the CPU), dynamic and static steps: output identical to the target
    alone, and the drafts agree with the eager ones (inductor may round differently, so near-ties may rarely flip)."""
    target, draft = pair
    ids = random_prompt(9, seed=7)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    for path in ("chain", "tree"):
        _, eager_drafts, _ = run(target, draft, ids, None, proposals, max_new_tokens=24, **PATHS[path])
        out, drafts, graphs = run(target, draft, ids, CompileConfig(mode=mode), proposals, max_new_tokens=24,
                                  **PATHS[path])
        assert torch.equal(out, plain)
        assert graphs >= 1
        agree = sum(a == b for a, b in zip(drafts, eager_drafts)) / len(eager_drafts)
        assert len(drafts) == len(eager_drafts) and agree >= 0.9
