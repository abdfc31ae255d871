"""``hf-eagle3 bench --oracle``: acceptance forced to a profile (chains and trees) with the output still the target's,
the cost-model bound beside the measured speed-up, synthetic targets of published shapes, and the CLI."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch
from conftest import known_costs
from transformers import CompileConfig

from hf_eagle3.bench.oracle import format_oracle_markdown, round_bound, run_oracle_bench
from hf_eagle3.bench.oracle_drafting import (
    FLOOR,
    OFF_PATH,
    PROFILES,
    draw_acceptance,
    expected_tokens,
    parse_profile,
    profile_path_logp,
    profile_rescore,
    ranked_path,
)
from hf_eagle3.bench.synthetic import SYNTHETIC, synthetic_target
from hf_eagle3.cli import main
from hf_eagle3.core import tree_policy
from hf_eagle3.core.cost_model import Eagle3Costs
from hf_eagle3.core.tree_candidates import candidate_ranking, ranking_key, select_trees
from hf_eagle3.loading import random_draft_for


def test_parse_profile():
    assert parse_profile("llama3-8b") == PROFILES["llama3-8b"]
    assert parse_profile("0.8,0.5,0.1") == (0.8, 0.5, 0.1)
    rates = parse_profile("0.5")
    assert rates[:3] == (0.5, 0.25, 0.125) and len(rates) == 16
    for bad in ("0.2,0.5", "1.5", "fast", ""):
        with pytest.raises(ValueError, match="--oracle"):
            parse_profile(bad)


def test_draws_follow_the_profile():
    rng, profile = random.Random(0), (0.8, 0.5, 0.2)
    draws = [draw_acceptance(rng, profile) for _ in range(20000)]
    for i, p in enumerate(profile, start=1):
        assert sum(d >= i for d in draws) / len(draws) == pytest.approx(p, abs=0.015)
    assert sum(draws) / len(draws) + 1 == pytest.approx(expected_tokens(profile, 3), abs=0.03)


def test_bound_is_the_cost_model():
    costs = Eagle3Costs(target={1: 1.0, 8: 1.0}, draft_feed={1: 0.0}, draft_step=0.0)
    assert round_bound(costs, (1.0,) * 4, k=4) == pytest.approx(5.0)  # free drafting and verification
    costs = Eagle3Costs(target={1: 1.0, 2: 2.0}, draft_feed={1: 0.5}, draft_step=0.5)
    assert round_bound(costs, (0.5,), k=1) == pytest.approx(1.5 / 2.5)


class _SameIds:
    """Draft ids as target ids."""

    @staticmethod
    def map_tokens(ids):
        return ids


def profile_scores(parents: list, depths: list, profile) -> tuple[list, list]:
    """
    The reference for :func:`profile_rescore`, written plainly for one row: scores for a round's tree candidates that
    carry ``profile``. The main path is the ancestry of the first candidate of
    the deepest level (so it reaches every level); its node at depth ``d`` gets the path probability that the profile
    accepts at least ``d`` tokens, ``profile[d - 1]`` (at least :data:`FLOOR`, never above its parent's). Every other
    node gets :data:`OFF_PATH` times the smaller of its parent's path probability and the main path's last node's. So a
    child never scores above its parent, every main-path node ranks above every other node (a tree of the ``total`` best
    candidates holds the main path as deep as ``total`` and the levels allow), and the best path probabilities
    (``candidate_ranking``, what ``tree_total_tokens="auto"`` sizes trees from) are the profile's.

    Args:
        parents (`list[int]`): [M] each candidate's parent (candidate numbers 1..M in level order, 0 = the root).
        depths (`list[int]`): [M] each candidate's depth (>= 1).
        profile (`tuple[float]`): per-position acceptance.

    Returns:
        ``(scores, main)``: the candidates' cumulative log-probabilities (`list[float]` [M]), and the main path's
        candidate numbers from depth 1 down (`list[int]`).
    """
    main, node = [], 1 + max(range(len(depths)), key=lambda i: (depths[i], -i))
    while node:
        main.append(node)
        node = parents[node - 1]
    main.reverse()
    scores, score = [0.0] * len(depths), 0.0
    for depth, node in enumerate(main, start=1):
        rate = profile[depth - 1] if depth <= len(profile) else 0.0
        score = min(score, math.log(max(rate, FLOOR)))
        scores[node - 1] = score
    on_main, off = set(main), math.log(OFF_PATH)
    for i, parent in enumerate(parents):  # level order: a parent is scored before its children
        if i + 1 not in on_main:
            scores[i] = min(scores[parent - 1] if parent else 0.0, score) + off
    return scores, main


# Candidates of 2 levels of top_k 2 and a third: level 1 is 1, 2; level 2 the children 3, 4 of 1 and 5, 6 of 2; the
# frontier kept 4 and 5, whose children are 7, 8 and 9, 10 (candidate 3, the first child of the first candidate, has
# none).
PARENTS = [0, 0, 1, 1, 2, 2, 4, 4, 5, 5]
DEPTHS = [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("profile", [(0.9, 0.8), (1.0, 1.0, 1.0), (0.0,)])
def test_profile_scores_carry_the_profile_along_a_full_depth_path(profile):
    scores, main = profile_scores(PARENTS, DEPTHS, profile)
    assert main == [1, 4, 7]  # the first deepest candidate's ancestry: every level
    rates = [profile[d - 1] if d <= len(profile) else 0.0 for d in (1, 2, 3)]
    assert [math.exp(scores[c - 1]) for c in main] == pytest.approx([max(r, FLOOR) for r in rates])
    on_main = [scores[c - 1] for c in main]
    assert all(b <= a for a, b in zip(on_main, on_main[1:]))  # non-increasing along the main path
    off_main = [scores[i] for i in range(len(PARENTS)) if i + 1 not in main]
    assert max(off_main) < min(on_main)
    key = ranking_key(torch.tensor(scores), torch.tensor(DEPTHS)).tolist()
    for i, parent in enumerate(PARENTS):
        if parent:
            assert key[i] < key[parent - 1] and scores[i] <= scores[parent - 1]  # children rank below parents
    assert ranked_path(PARENTS, scores) == main
    # The selected trees hold the main path as deep as their size allows; the ranking sees the profile.
    candidates = (torch.tensor([scores]), torch.arange(10)[None], torch.tensor([PARENTS]), torch.tensor(DEPTHS), 3)
    for total, depth in ((1, 1), (2, 2), (3, 3), (6, 3)):
        tree = select_trees(candidates, torch.tensor([99]), total, _SameIds())[0]
        path = ranked_path(tree.parents.tolist()[1:], tree.scores.tolist())
        assert tree.tokens[path].tolist() == [c - 1 for c in main[:depth]] and int(tree.depths.max()) == depth
    probs = candidate_ranking(candidates)[0].tolist()
    assert probs[:3] == pytest.approx(sorted((max(r, FLOOR) for r in rates), reverse=True))


@pytest.mark.parametrize("seed", range(3))
def test_profile_rescore_is_the_reference_for_every_row(seed):
    """The tensor version (what the oracle runs, also inside a captured round) scores each row of random candidates
    as the plain reference does."""
    g = torch.Generator().manual_seed(seed)
    k, levels, rows = 3, 4, 2
    first = [1] + [1 + k + i * k * k for i in range(levels)]
    parents = torch.cat([torch.zeros(rows, k, dtype=torch.long)]
                        + [torch.randint(first[i], first[i + 1], (rows, k * k), generator=g) for i in range(levels - 1)],
                        dim=1)
    depths = torch.cat([torch.full((k,), 1)] + [torch.full((k * k,), i + 2) for i in range(levels - 1)])
    profile = (0.9, 0.6, 0.0)  # a zero rate, and fewer rates than levels: the floor
    scores = torch.rand(rows, parents.shape[1], generator=g).log()
    new = profile_rescore((scores, None, parents, depths, levels), torch.tensor(profile_path_logp(profile, levels)))[0]
    for b in range(rows):
        assert new[b].tolist() == pytest.approx(profile_scores(parents[b].tolist(), depths.tolist(), profile)[0])


@pytest.fixture(scope="module")
def tiny():
    target = synthetic_target("tiny", seed=0)
    draft = random_draft_for(target, draft_vocab_size=256)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (1, n), generator=gen) for n in (9, 14)]
    return target, draft, prompts


@pytest.mark.parametrize("profile,per_round", [("perfect", 4.0), ("none", 1.0)])
def test_oracle_forces_acceptance_and_keeps_the_output(tiny, profile, per_round):
    target, draft, prompts = tiny
    report = run_oracle_bench(target, draft, prompts, PROFILES[profile], ks=(3,), max_new_tokens=25,
                              tree_shapes=((2, 3, 4),), progress=False)
    assert report["identical"]
    rows = {r["strategy"]: r for r in report["rows"]}
    chain = rows["chain k=3"]
    # 24 tokens after the prefill's: perfect = 6 rounds of 4 tokens; none = 24 rounds of 1.
    assert chain["tokens_per_round"] == pytest.approx(per_round)
    assert chain["mean_acceptance_length"] == pytest.approx(per_round)
    tree = rows["tree 2x3x4"]
    assert tree["tokens_per_round"] >= 1.0 and (profile == "perfect") == (tree["tokens_per_round"] > 1.5)
    for r in rows.values():
        assert r["round_ms"] == pytest.approx(r["draft_ms"] + r["verify_ms"] + r["bookkeeping_ms"])
    assert "bound" in chain and "bound" not in rows["auto k<=3"]
    text = format_oracle_markdown(report)
    assert "cost-model bound" in text and "limited by" in text


@pytest.mark.parametrize("drafting", ["steps", "captured"])
def test_oracle_trees_follow_the_profile_to_full_depth(monkeypatch, drafters, drafting):
    """Trees of a fixed shape reach their full depth (a random draft's own scores kept them about 2 deep), tree
    ``"auto"`` sizes its trees from the profile's probabilities (a random draft's made it draft one node), and the
    output stays the target's; drafting step by step, or each round captured whole (static drafting steps, the
    candidates rescored inside the region)."""
    target = synthetic_target("tiny", seed=0)
    draft = random_draft_for(target, draft_vocab_size=256)
    if drafting == "captured":
        draft.generation_config.compile_config = CompileConfig(backend="aot_eager", mode="reduce-overhead",
                                                               fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (1, n), generator=gen) for n in (12, 20)]
    # A tree every round (whether trees pay on this machine is not what is tested), priced from known costs, and a
    # target forward that costs more than a draft level (3 ms more whatever its width, as a large target's would).
    monkeypatch.setattr(tree_policy.TreeSizeChooser, "draft_this_round", lambda self, *args: True)
    known_costs(target, draft)
    slow = target.register_forward_pre_hook(lambda module, args: time.sleep(0.003))
    try:
        report = run_oracle_bench(target, draft, prompts, (0.9, 0.8, 0.7, 0.6), ks=(), max_new_tokens=32,
                                  auto=False, tree_shapes=((4, 5, 16), (4, 5, "auto")), progress=False)
    finally:
        slow.remove()
    assert report["identical"]
    assert any(d.buckets for d in drafters) == (drafting == "captured")
    rows = {r["strategy"]: r for r in report["rows"]}
    fixed, auto = rows["tree 4x5x16"], rows["tree 4x5xauto"]
    assert fixed["mean_tree_depth"] >= 4.0  # 5 but where the end of the output left less room
    assert fixed["stats"]["mean_draft_length"] == pytest.approx(fixed["mean_tree_depth"])  # what the loop verified
    assert fixed["tokens_per_round"] > 3.0  # the profile's 1 + 0.9 + 0.8 + 0.7 + 0.6 = 4.0 tokens a round
    drafted = auto["stats"]["drafted_per_position"] + [0, 0, 0]  # per depth, the rounds whose tree reached it
    assert drafted[2] > 0.75 * drafted[0]  # trees at least 3 deep in most rounds
    assert auto["mean_tree_depth"] >= 3.5 and auto["tokens_per_round"] > 3.0


def test_synthetic_shapes_are_published_ones():
    assert SYNTHETIC["llama-3.1-8b"][1]["hidden_size"] == 4096 and SYNTHETIC["llama-3.1-8b"][1]["vocab_size"] == 128256
    assert SYNTHETIC["qwen3-8b"][1]["num_hidden_layers"] == 36
    with pytest.raises(ValueError, match="--synthetic"):
        synthetic_target("gpt-5")


def test_cli_oracle_writes_the_report(tmp_path, capsys):
    code = main(["bench", "--oracle", "0.7", "--synthetic", "tiny", "--num-prompts", "1", "--max-new-tokens", "12",
                 "--ks", "1,2", "--prompt-tokens", "8", "--draft-vocab-size", "128", "--tree-shapes", "2x2x3",
                 "--out-dir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "oracle.json").read_text())
    assert [r["strategy"] for r in report["rows"]] == ["plain", "chain k=1", "chain k=2", "auto k<=2", "tree 2x2x3"]
    assert "measured / bound" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--oracle"):
        main(["bench", "--synthetic", "tiny", "--out-dir", str(tmp_path)])


def test_decisive_synthetic_target_keeps_the_oracle_on_path_in_bfloat16():
    """In bfloat16 the oracle's reference (one-token forwards) must stay the path that verification takes: the
    decisive target decodes exactly as plain ``generate`` and accepts what the same target accepts in float32."""
    per_round = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = synthetic_target("tiny", dtype=dtype, decisive=True)
        draft = random_draft_for(target, draft_vocab_size=256)
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 512, (1, 48), generator=generator) for _ in range(2)]
        report = run_oracle_bench(target, draft, prompts, PROFILES["llama3-8b"], ks=(3,), max_new_tokens=64,
                                  auto=False, tree_shapes=(), progress=False)
        assert report["identical"], dtype
        per_round[dtype] = report["rows"][1]["tokens_per_round"]
    assert per_round[torch.bfloat16] == per_round[torch.float32] > 1.5
