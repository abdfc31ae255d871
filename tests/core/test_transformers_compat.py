"""The Transformers releases the package runs on: the public drafter protocol where the release has it (the target's
features handed to the chain drafter, no hooks), the hooks where it does not, the supported range enforced at import,
hybrid targets (recurrent / linear-attention layers) and chains on a static cache."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import cached_draft, cached_target, random_prompt, tiny_draft, tiny_target
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_eagle3 import Eagle3CandidateGenerator
from hf_eagle3.core import transformers_compat as compat
from hf_eagle3.core.feature_capture import Eagle3FeatureCapture, Eagle3OutputFeatures
from hf_eagle3.core.generate_hook import use_drafting


class SpyGenerator(Eagle3CandidateGenerator):
    """Records what the chain drafter was built with and what each round received."""

    seen: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        SpyGenerator.seen.append(self)
        self.received = []

    def get_candidates(self, input_ids, model_outputs=None, **kwargs):
        self.received.append(model_outputs)
        return super().get_candidates(input_ids, model_outputs=model_outputs, **kwargs)


def _spy_generate(target, draft, ids, features=None, **kwargs):
    SpyGenerator.seen = []
    with use_drafting(chain=SpyGenerator, features=features):
        out = target.generate(ids, assistant_model=draft, do_sample=False, **kwargs)
    (generator,) = SpyGenerator.seen
    return out, generator


def test_chain_takes_the_release_feature_source():
    """On releases that select hidden states by index the chain uses the public protocol (no hooks); below, hooks."""
    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=3)
    out, generator = _spy_generate(target, draft, ids, max_new_tokens=12, num_assistant_tokens=3)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=12))
    if compat.SELECTS_HIDDEN_STATES:
        assert generator.requires_model_outputs is True
        assert isinstance(generator.capture, Eagle3OutputFeatures)
        layer_ids = sorted(draft.config.resolve_feature_layer_ids(target.config.num_hidden_layers))
        assert generator.model_kwargs_overrides == {"output_hidden_states": layer_ids}
        assert generator.received[0] is None  # before the prefill
        assert all(o is not None and o.hidden_states is not None for o in generator.received[1:])
        assert draft.last_stats.num_drafts > 0 and draft.last_stats.num_draft_tokens > 0
    else:
        assert generator.requires_model_outputs is False
        assert isinstance(generator.capture, Eagle3FeatureCapture)
        assert all(o is None for o in generator.received)
        with pytest.raises(ValueError, match="transformers>=5.25"):
            with use_drafting(features="outputs"):
                pass


@pytest.mark.skipif(not compat.SELECTS_HIDDEN_STATES, reason="the protocol path needs transformers>=5.25")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_outputs_and_hooks_give_the_same_rounds(arch):
    """Both feature sources feed the draft the same features: same tokens, same acceptance round by round."""
    target, draft = cached_target(arch), cached_draft(arch)
    ids = random_prompt(7, seed=4)
    reference = target.generate(ids, do_sample=False, max_new_tokens=20)
    results = {}
    for source in ("outputs", "hooks"):
        out, generator = _spy_generate(target, draft, ids, features=source, max_new_tokens=20, num_assistant_tokens=4)
        assert torch.equal(out, reference), source
        results[source] = generator.stats.to_dict()
    assert results["outputs"] == results["hooks"]


@pytest.mark.skipif(not compat.SELECTS_HIDDEN_STATES, reason="the protocol path needs transformers>=5.25")
def test_user_hidden_states_are_kept_on_the_protocol_path():
    """A call that asks for hidden states gets all of them (the drafter's selection does not narrow them)."""
    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=5)
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, output_hidden_states=True)
    out, generator = _spy_generate(target, draft, ids, **kwargs)
    assert generator.model_kwargs_overrides == {"output_hidden_states": True}
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, **kwargs).sequences)
    layers = target.config.num_hidden_layers + 1
    assert all(len(step) == layers and all(h is not None for h in step) for step in out.hidden_states)


# ------------------------------------------------------------------------------------ the hidden states read
def layer_inputs(target, ids) -> list:
    """The input of every decoder layer of ``target`` in one forward of ``ids``, taken by forward pre-hooks."""
    seen = {}

    def keep(i):
        def hook(module, args, kwargs):
            seen[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True)
               for i, layer in enumerate(target.model.layers)]
    try:
        with torch.no_grad():
            target(ids)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in range(len(target.model.layers))]


def check_hidden_state_meaning(target, ids, layer_ids) -> None:
    """
    What the package reads from a forward's outputs (``Eagle3OutputFeatures``), as ``AssertionError`` when a release
    means something else: ``outputs.hidden_states[i]`` is the input of decoder layer ``i`` (0: the embeddings) for
    ``output_hidden_states=True``, and, on releases that select hidden states, for the non-negative ids the package
    passes as ``output_hidden_states=[i, j, k]`` too, indexed by those ids (not packed), so that the features are
    the same as the hooks'.
    """
    n = target.config.num_hidden_layers
    inputs = layer_inputs(target, ids)
    with torch.no_grad():
        full = target(ids, output_hidden_states=True).hidden_states
    assert len(full) == n + 1, f"output_hidden_states=True gave {len(full)} states for {n} layers"
    for i in range(n):
        assert torch.equal(full[i], inputs[i]), f"output_hidden_states=True: state {i} is not the input of layer {i}"
    capture = Eagle3OutputFeatures(layer_ids, n)
    asked = capture.model_kwargs_overrides(GenerationConfig())["output_hidden_states"]
    if not compat.SELECTS_HIDDEN_STATES:
        assert asked is True or all(i >= 0 for i in asked)
        return
    assert asked == sorted(layer_ids) and all(i >= 0 for i in asked)  # never a negative id
    with torch.no_grad():
        selected = target(ids, output_hidden_states=asked)
    hidden = selected.hidden_states
    for i in asked:
        assert i < len(hidden) and hidden[i] is not None, f"output_hidden_states={asked}: no state at index {i}"
        assert torch.equal(hidden[i], inputs[i]), f"output_hidden_states={asked}: state {i} is not the input of layer {i}"
    capture.receive(selected)
    assert torch.equal(capture.features(), torch.cat([inputs[i] for i in sorted(layer_ids)], dim=-1))


@pytest.mark.parametrize("layer_ids", [[0, 2, 5], [1, 3, 4], [3, 4, 5]], ids=["embeddings", "middle", "last-layer"])
def test_hidden_state_i_is_the_input_of_decoder_layer_i(layer_ids):
    """Pins the meaning of ``output_hidden_states`` the package relies on (an open upstream change rewrites how the
    selected ids resolve and adds ``last_hidden_state``): fails loudly on a release where it changes."""
    check_hidden_state_meaning(cached_target("llama"), random_prompt(7, seed=12), layer_ids)


# Packing concerns only the selected states (releases that select them); a shift concerns every release.
CHANGED_MEANINGS = ["packed", "shifted"] if compat.SELECTS_HIDDEN_STATES else ["shifted"]


@pytest.mark.parametrize("change", CHANGED_MEANINGS)
def test_the_hidden_state_pin_catches_a_changed_meaning(monkeypatch, change):
    """Negative control of the pin: a release whose selected states came packed (state ``i`` of ``[i, j, k]`` at
    position 0, 1, 2) or shifted by one (the output of layer ``i`` at index ``i``) fails it."""
    target = tiny_target("llama")
    forward = target.model.forward

    def changed(*args, **kwargs):
        out = forward(*args, **kwargs)
        if out.hidden_states is not None and change == "packed":
            out.hidden_states = tuple(h for h in out.hidden_states if h is not None)
        elif out.hidden_states is not None:
            out.hidden_states = out.hidden_states[1:] + (out.hidden_states[-1],)
        return out

    monkeypatch.setattr(target.model, "forward", changed)
    with pytest.raises(AssertionError, match="is not the input of layer|no state at index"):
        check_hidden_state_meaning(target, random_prompt(7, seed=12), [1, 3, 4])


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_release_outside_the_range_warns_once():
    code = (
        "import warnings, transformers\n"
        "transformers.__version__ = '5.99.0'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import hf_eagle3\n"
        "    from hf_eagle3 import install_generate_hook\n    from hf_eagle3.core import transformers_compat\n"
        "    install_generate_hook(); transformers_compat.check_transformers()\n"
        "ours = [str(w.message) for w in caught if 'tested with transformers' in str(w.message)]\n"
        "print(len(ours)); print(ours[0] if ours else '')\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    count, message = result.stdout.strip().splitlines()[:2]
    assert count == "1"
    assert compat.SUPPORTED_RANGE in message and "5.99.0" in message


def test_release_inside_the_range_does_not_warn():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import hf_eagle3\n"
        "print(sum('tested with transformers' in str(w.message) for w in caught))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


@pytest.mark.parametrize("name", ["_assisted_decoding", "_get_candidate_generator"])
def test_missing_private_name_fails_at_import(name):
    code = (
        "from transformers.generation.utils import GenerationMixin\n"
        f"delattr(GenerationMixin, {name!r})\n"
        "import hf_eagle3\n"
    )
    result = _run(code)
    assert result.returncode != 0
    import transformers

    assert "ImportError" in result.stderr and f"GenerationMixin.{name}" in result.stderr
    assert transformers.__version__ in result.stderr and compat.SUPPORTED_RANGE in result.stderr


def test_private_surface_is_documented():
    """Every private name of the compatibility module appears in the docs' table, with its releases."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "transformers_versions.md").read_text()
    for entry in compat.PRIVATE_NAMES:
        assert f"`{entry.name}`" in doc and entry.releases in doc, entry.name
    assert compat.SUPPORTED_RANGE in doc


# ------------------------------------------------------------------------------------------------ hybrid targets
HYBRID = {
    "qwen3_next": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    "lfm2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, block_auto_adjust_ff_dim=False,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
}


def hybrid_target(kind: str, vocab_size: int = 256, seed: int = 0):
    """A tiny random hybrid target (recurrent / convolution layers beside attention) from a config Transformers
    ships, without EOS."""
    config = AutoConfig.for_model(kind, vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                                  **HYBRID[kind])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    return model


class CountForwards:
    """Counts the target's forwards (a forward pre-hook on the model itself)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.n += 1

    def remove(self):
        self.handle.remove()


@pytest.mark.parametrize("kind", sorted(HYBRID))
def test_hybrid_target_chain(kind):
    """Chains roll recurrent layers back (Transformers >= 5.25): identical to the target alone, every schedule;
    below 5.25 they are refused before any target forward."""
    target = hybrid_target(kind)
    draft = tiny_draft(target)
    ids = random_prompt(8, seed=6)
    if not compat.ROLLS_BACK_RECURRENT_STATES:
        counter = CountForwards(target)
        try:
            # ours names the release; some releases refuse stateful targets themselves first, as early
            with pytest.raises(ValueError, match="transformers>=5.25|not supported with stateful models"):
                target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=8)
        finally:
            counter.remove()
        assert counter.n == 0
        return
    reference = target.generate(ids, do_sample=False, max_new_tokens=24)
    for schedule, k in (("constant", 4), ("heuristic_transient", 2), ("auto", 4)):
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24,
                              num_assistant_tokens=k, num_assistant_tokens_schedule=schedule)
        assert torch.equal(out, reference), schedule
    # A draft that always matches: every round accepts everything, so the heuristic schedule would grow past the
    # recurrent history Transformers keeps; it stays at the initial length instead.
    SpyGenerator.seen = []
    with use_drafting(chain=SpyGenerator):
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24,
                              num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic_transient")
    assert torch.equal(out, reference)
    assert SpyGenerator.seen[0].num_drafting_tokens == 2 and SpyGenerator.seen[0].num_assistant_tokens <= 2


@pytest.mark.parametrize("kind", sorted(HYBRID))
@pytest.mark.parametrize("path", ["tree", "batch"])
def test_hybrid_target_trees_and_batches_are_refused_before_work(kind, path):
    target = hybrid_target(kind)
    draft = tiny_draft(target)
    if path == "tree":
        kwargs = dict(input_ids=random_prompt(8, seed=7), tree_total_tokens=8, tree_depth=3, tree_top_k=2)
        fix = "drop the tree_\\* settings"
    else:
        kwargs = dict(input_ids=torch.cat([random_prompt(8, seed=7), random_prompt(8, seed=8)]),
                      attention_mask=torch.ones(2, 8, dtype=torch.long))
        fix = "one row at a time"
    counter = CountForwards(target)
    try:
        with pytest.raises(ValueError, match=f"{fix}|not supported with stateful models"):
            target.generate(**kwargs, assistant_model=draft, do_sample=False, max_new_tokens=8)
    finally:
        counter.remove()
    assert counter.n == 0, "refused after a target forward"


# ------------------------------------------------------------------------------------------------ static cache
static_cache = pytest.mark.skipif(not compat.ASSISTS_ON_STATIC_CACHE,
                                  reason="assisted decoding on a static cache needs transformers>=5.24")


def test_static_cache_before_5_24_is_refused_before_work():
    """Releases before 5.24 refuse assisted decoding on a static cache themselves, before any target forward."""
    if compat.ASSISTS_ON_STATIC_CACHE:
        pytest.skip("transformers>=5.24 assists on a static cache (tested below)")
    target, draft = cached_target("llama"), cached_draft("llama")
    counter = CountForwards(target)
    try:
        with pytest.raises(ValueError, match="not supported with Static cache"):
            target.generate(random_prompt(6, seed=9), assistant_model=draft, do_sample=False, max_new_tokens=8,
                            cache_implementation="static")
    finally:
        counter.remove()
    assert counter.n == 0


@static_cache
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chain_on_a_static_cache(arch):
    target, draft = cached_target(arch), cached_draft(arch)
    ids = random_prompt(6, seed=9)
    reference = target.generate(ids, do_sample=False, max_new_tokens=16)
    for schedule in ("constant", "auto"):
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=16,
                              cache_implementation="static", num_assistant_tokens_schedule=schedule)
        assert torch.equal(out, reference), schedule
    assert draft.last_stats.num_target_forwards > 1


@static_cache
def test_static_sliding_cache_past_its_window_is_refused_before_work():
    """Gemma 3's static sliding layers (window 16) roll back while the static cache fits in the window; a cache past
    the window is refused before any target forward."""
    target = tiny_target("gemma3")
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    ids = random_prompt(6, seed=9)
    short = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=8,
                            cache_implementation="static")
    assert torch.equal(short, target.generate(ids, do_sample=False, max_new_tokens=8))
    counter = CountForwards(target)
    try:
        with pytest.raises(ValueError, match="drop cache_implementation"):
            target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24,
                            cache_implementation="static")
    finally:
        counter.remove()
    assert counter.n == 0


@static_cache
def test_chain_with_the_compiled_decode_forward(monkeypatch):
    """Transformers compiles the target's decode forward on a static cache: same output, the compiled call taken.
    (The ``eager`` backend traces the forward with dynamo without generating code, to keep the test short; the
    benchmark ``dev/bench_transformers_paths.py`` times inductor.)"""
    from transformers import CompileConfig

    target, draft = cached_target("llama"), cached_draft("llama")
    ids = random_prompt(6, seed=10)
    reference = target.generate(ids, do_sample=False, max_new_tokens=16)
    config = CompileConfig(backend="eager", fullgraph=False)
    config._compile_all_devices = True  # a CPU: Transformers compiles only on accelerators unless told so
    compiled = []
    original = type(target).get_compiled_call

    def spy(self, *args, **kwargs):
        compiled.append(True)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "get_compiled_call", spy)
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=16, num_assistant_tokens=3,
                          cache_implementation="static", compile_config=config)
    assert compiled, "the decode forward was not compiled"
    assert torch.equal(out, reference)
    assert draft.last_stats.num_drafts > 0


@pytest.mark.skipif(not compat.ROLLS_BACK_RECURRENT_STATES, reason="hybrid chains need transformers>=5.25")
def test_hybrid_target_chain_sampling_keeps_the_distribution():
    """Sampling with a hybrid target (LFM2: convolution states rolled back after each rejection) keeps the target's
    distribution, with a random draft (mostly rejections) and a target-like one (long accepted runs); the same test
    flags a generator that returns unprocessed candidate logits (the negative control)."""
    import copy

    from conftest import assisted_continuations, plain_continuations, token_p_values

    target = hybrid_target("lfm2", vocab_size=24)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)  # peaky, not degenerate: several likely tokens at each position
    draft = tiny_draft(target, 16)
    oracle = copy.deepcopy(target)
    target_ids = torch.arange(draft.config.draft_vocab_size) + draft.d2t
    prompt = torch.tensor([[5, 7, 9, 11]])
    sampling = dict(do_sample=True, max_new_tokens=4, temperature=0.7, top_k=8, top_p=0.9, num_assistant_tokens=2)
    plain = plain_continuations(target, prompt, 20000, **{k: v for k, v in sampling.items() if k != "num_assistant_tokens"})

    class TargetLike(Eagle3CandidateGenerator):
        """The draft's scores are the target's own logits over the draft vocabulary."""

        def _select(self, seq, draft_scores):
            with torch.no_grad():
                return super()._select(seq, oracle(seq).logits[:, -1, target_ids])

    class Unprocessed(TargetLike):
        """Bug: samples from the processed scores but returns the unprocessed ones as candidate logits."""

        def _select(self, seq, draft_scores):
            token, _ = super()._select(seq, draft_scores)
            with torch.no_grad():
                return token, self.d2t(seq, oracle(seq).logits[:, -1, target_ids].float())

    results = {}
    for name, generator in (("random", None), ("target_like", TargetLike), ("broken", Unprocessed)):
        with use_drafting(chain=generator):
            samples, accepted = assisted_continuations(target, draft, prompt, 400, 1000, **sampling)
        results[name] = (min(token_p_values(samples, plain).values()), accepted)
    assert results["random"][0] > 1e-3 / 3 and results["target_like"][0] > 1e-3 / 3, results
    assert results["target_like"][1] > 1.0, results  # long accepted runs: the roll-back of partial ones is exercised
    assert results["broken"][0] < 1e-3 / 3, results
