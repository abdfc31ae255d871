"""``hf-eagle3 bench --oracle``: acceptance forced to a profile (chains and trees) with the output still the target's,
the cost-model bound beside the measured speed-up, synthetic targets of published shapes, and the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hf_eagle3.bench.oracle import format_oracle_markdown, round_bound, run_oracle_bench
from hf_eagle3.bench.oracle_drafting import PROFILES, draw_acceptance, expected_tokens, parse_profile
from hf_eagle3.bench.synthetic import SYNTHETIC, synthetic_target
from hf_eagle3.cli import main
from hf_eagle3.core.cost_model import Eagle3Costs
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
