"""The benchmark's Python API on a tiny random target, the CLI's parsing, and the offline-inference example's checks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_draft, tiny_target

from hf_eagle3 import cli, loading
from hf_eagle3.bench import report as bench_report
from hf_eagle3.bench import run as bench
from hf_eagle3.bench import strategies as bench_strategies
from hf_eagle3.core import cost_model

REPO = Path(__file__).resolve().parents[2]


class ByteTokenizer:
    """UTF-8 bytes as token ids (fits the tiny models' 256-token vocabulary); no chat template."""

    chat_template = None

    def __call__(self, text, return_tensors=None, **kwargs):
        ids = [4 + b % 252 for b in text.encode("utf-8")]  # avoid the special ids 0-3
        return SimpleNamespace(input_ids=torch.tensor([ids]))


def write_prompts(path: Path) -> Path:
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["hello there, tell me a story", "second turn"]},
        {"question_id": 2, "category": "math", "turns": ["abc abc abc abc"]},
        {"question_id": 3, "category": "coding", "turns": ["unused third prompt"]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_load_prompts_mt_bench_layout(tmp_path):
    path = write_prompts(tmp_path / "question.jsonl")
    assert loading.load_prompts(path, 2) == ["hello there, tell me a story", "abc abc abc abc"]
    assert loading.load_prompts(None, 3) == loading.BUILTIN_PROMPTS[:3]


def test_run_bench_tiny(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    prompts = loading.load_prompts(write_prompts(tmp_path / "question.jsonl"), 2)
    out_dir = tmp_path / "out"
    report = bench.run_bench(target, draft, ByteTokenizer(), prompts, max_new_tokens=6, ks=(1, 2), temperature=0.8,
                             out_dir=out_dir, meta={"target": "tiny", "draft": "tiny"}, progress=False)

    assert report["greedy_identical"] is True
    assert report["greedy_mismatches"] == []
    assert list(report["target_forward_ms"]) == ["1", "2", "4", "8", "16", "32"]
    assert all(ms > 0 for ms in report["target_forward_ms"].values())
    names = [r["strategy"] for r in report["results"]]
    trees = [f"eagle3-tree k={a} d={b} n={c}" for a, b, c in bench_strategies.TREE_SHAPES]
    assert names == ["plain", "prompt-lookup", "eagle3-chain k=1", "eagle3-chain k=2", "eagle3-chain auto k<=2",
                     *trees] * 2
    per_mode = len(names) // 2
    assert [r["mode"] for r in report["results"]] == ["greedy"] * per_mode + ["sampled"] * per_mode
    for r in report["results"]:
        for key in ("tokens_per_s", "ms_per_token", "speedup", "seconds", "new_tokens", "k", "family"):
            assert key in r
        assert r["tokens_per_s"] > 0 and r["new_tokens"] > 0
        if r["family"] == "eagle3_chain":
            assert r["mean_acceptance_length"] >= 1.0
            assert len(r["acceptance_rate_per_position"]) == r["k"]
            assert r["stats"]["num_output_tokens"] == r["new_tokens"]
        elif r["family"] in ("eagle3_tree", "eagle3_auto"):
            assert r["mean_acceptance_length"] >= 1.0
            assert r["stats"]["num_output_tokens"] == r["new_tokens"]
            if r["family"] == "eagle3_auto":  # every target forward after a prefill drafted 1-2 tokens or nothing
                st = r["stats"]
                assert st["num_target_forwards"] == st["num_drafts"] + st["num_rounds_without_draft"] + len(prompts)
                assert len(st["drafted_per_position"]) <= 2
        else:
            assert r["mean_acceptance_length"] is None
    assert report["results"][0]["speedup"] == pytest.approx(1.0)
    assert report["settings"]["ks"] == [1, 2] and report["settings"]["modes"] == ["greedy", "sampled"]

    saved = json.loads((out_dir / "bench.json").read_text())
    assert saved["greedy_identical"] is True and len(saved["results"]) == len(names)
    markdown = (out_dir / "bench.md").read_text()
    assert "| mode | strategy |" in markdown and "eagle3-chain k=2" in markdown and "**yes**" in markdown
    assert "rounds drafted (mean k) / without draft" in markdown
    png = (out_dir / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_greedy_mismatch_is_reported():
    report = {
        "settings": {"num_prompts": 1, "max_new_tokens": 4, "temperature": 0, "torch_threads": 1,
                     "target_dtype": "torch.float32", "date": "today"},
        "results": [],
        "greedy_identical": False,
        "greedy_compared": {"prompts": 1, "strategies": ["x"]},
        "greedy_mismatches": [{"strategy": "x", "prompt_index": 0, "first_difference": 2}],
    }
    assert "**NO**" in bench_report.format_markdown(report)
    assert bench._first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert bench._first_difference([1, 2], [1, 2, 3]) == 2


def test_strategy_registry_is_extensible():
    @bench_strategies.register_strategy("test_family")
    def factory(ks, **options):
        return [bench_strategies.Strategy(name="test k=2", family="test_family", k=2)]

    try:
        strategies = bench_strategies.build_strategies([1, 5], families=["test_family"])
        assert [s.name for s in strategies] == ["plain", "test k=2"]
        all_names = [s.name for s in bench_strategies.build_strategies([4], prompt_lookup_num_tokens=3)]
        assert all_names[:3] == ["plain", "prompt-lookup", "eagle3-chain k=4"]
        with pytest.raises(ValueError, match="unknown strategies"):
            bench_strategies.build_strategies([1], families=["nope"])
    finally:
        del bench_strategies.STRATEGIES["test_family"]


def test_random_draft_fits_target():
    target = tiny_target("llama")
    draft = loading.random_draft_for(target)
    assert draft.config.vocab_size == draft.config.draft_vocab_size == 256
    assert draft.config.target_hidden_size == 64
    assert torch.equal(draft.d2t, torch.zeros(256, dtype=torch.long))
    ids = torch.tensor([[1, 5, 6, 7]])
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    eagle = target.generate(ids, assistant_model=draft, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, eagle)


def test_shipped_draft_path_is_in_repo():
    assert loading.shipped_draft_path() == REPO / "examples" / "drafts" / "smollm2-135m-eagle3"


def test_cli_parsing(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "demo" in text and "bench" in text

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "--ks", "2,4", "--temperature", "0"])
    assert args.quick and args.ks == "2,4" and args.temperature == 0.0 and args.func is cli._run_bench
    args = parser.parse_args(["demo", "--max-new-tokens", "8", "--num-assistant-tokens", "3"])
    assert args.max_new_tokens == 8 and args.num_assistant_tokens == 3 and args.func is cli._run_demo
    assert cli.main([]) == 2


def load_example():
    path = REPO / "examples" / "offline_inference_eagle3.py"
    spec = importlib.util.spec_from_file_location("offline_inference_eagle3", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_max_num_seqs(capsys):
    example = load_example()
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--max_num_seqs", "0"])
    assert exit_info.value.code == 2
    assert "--max_num_seqs 0: give at least 1" in capsys.readouterr().err
    args = example.parse_args(["--num_spec_tokens", "3", "--num_prompts", "4"])
    assert args.max_num_seqs == 1 and args.num_spec_tokens == 3 and args.num_prompts == 4
    assert example.parse_args(["--max_num_seqs", "4"]).max_num_seqs == 4


def test_target_forward_costs_restore_the_cache():
    """Each timed forward (the bench's cost line: cost_model.measure_target_seconds) extends the same context: every
    one sees the prompt's cache length, none the tokens of an earlier one."""
    target = tiny_target("llama")
    ids = torch.randint(0, target.config.vocab_size, (1, 7))
    seen = []

    def before(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((kwargs["hidden_states"].shape[1] if "hidden_states" in kwargs else args[0].shape[1],
                     cache.get_seq_length()))

    hook = target.model.layers[0].register_forward_pre_hook(before, with_kwargs=True)
    try:
        costs = cost_model.measure_target_seconds(target, ids, sizes=(1, 3), repeats=2)
    finally:
        hook.remove()
    assert sorted(costs) == [1, 3] and all(t > 0 for t in costs.values())
    assert seen[0] == (7, 0)  # the prompt
    assert sorted(seen[1:]) == [(1, 7)] * 3 + [(3, 7)] * 3  # a warm-up and 2 timed forwards per size


def test_parse_tree_shapes():
    assert bench_strategies.parse_tree_shapes("4x4x8, 2x3xAUTO") == ((4, 4, 8), (2, 3, "auto"))
    for bad in ["4x4", "4x4x8x1", "ax4x8", "0x4x8", "4x4x0", ","]:
        with pytest.raises(ValueError, match="tree shape|empty"):
            bench_strategies.parse_tree_shapes(bad)
    args = cli.build_parser().parse_args(["bench", "--tree-shapes", "2x2x3"])
    assert args.tree_shapes == "2x2x3"


def test_run_bench_custom_tree_shapes(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    report = bench.run_bench(target, draft, ByteTokenizer(), ["abc abc"], max_new_tokens=5, ks=(2,), temperature=0,
                             families=["eagle3_tree"], tree_shapes=((2, 2, 3), (2, 3, "auto")), progress=False,
                             cost_sizes=(1, 2), out_dir=tmp_path / "out")
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0  # "auto" rows plot too
    assert [r["strategy"] for r in report["results"]] == ["plain", "eagle3-tree k=2 d=2 n=3",
                                                          "eagle3-tree k=2 d=3 n=auto"]
    assert report["greedy_identical"] is True
    assert report["settings"]["tree_shapes"] == [[2, 2, 3], [2, 3, "auto"]]


def test_example_acceptance_by_category(tmp_path):
    from hf_eagle3 import Eagle3Stats

    example = load_example()
    data = tmp_path / "q.jsonl"
    data.write_text('{"category": "math", "turns": ["a"]}\n\n{"category": "coding", "turns": ["b"]}\n'
                    '{"turns": ["c"]}\n{"category": "math", "turns": ["d"]}\n')
    categories = example.load_categories(str(data))
    assert categories == ["math", "coding", None, "math"] and len(categories) == len(loading.load_prompts(str(data)))
    assert example.load_categories(None) == []
    one = Eagle3Stats(num_drafts=2, drafted_per_position=[2, 2], accepted_per_position=[2, 1])  # 1 + 3/2
    two = Eagle3Stats(num_drafts=2, drafted_per_position=[2, 1], accepted_per_position=[0, 0])  # 1
    three = Eagle3Stats(num_drafts=4, drafted_per_position=[4], accepted_per_position=[4])
    by = example.acceptance_by_category(categories, [one, three, two, two])
    assert list(by) == ["math", "coding"]
    math, n = by["math"]
    assert n == 2 and math.num_drafts == 4 and math.mean_acceptance_length == 1.75
    assert math.acceptance_rate_per_position == [0.5, 0.25]
    assert by["coding"][0].mean_acceptance_length == 2.0 and by["coding"][1] == 1


def test_batched_bench_tiny(tmp_path):
    """``bench --batch-sizes``: every strategy on the same left-padded batches, ratios to plain batched generate,
    rows compared with plain's; a mismatch is reported."""
    from hf_eagle3.bench import batched as bench_batched

    target = tiny_target("llama")
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    prompts = ["hello there", "abc abc abc abc abc", "a longer prompt than the others", "x"]
    report = bench_batched.run_batched_bench(target, draft, ByteTokenizer(), prompts, batch_sizes=(1, 2, 4),
                                             max_new_tokens=6, ks=(2,), tree_shapes=((2, 2, 3),), progress=False)
    assert report["greedy_identical"] and report["mismatches"] == []
    rows = report["results"]
    assert [r["batch_size"] for r in rows] == [1] * 4 + [2] * 4 + [4] * 4
    assert [r["strategy"] for r in rows[:4]] == ["plain", "eagle3-chain k=2", "eagle3-chain auto k<=2",
                                                 "eagle3-tree k=2 d=2 n=3"]
    assert all(r["new_tokens"] == 24 for r in rows)  # every row of every batch: 6 new tokens
    assert all(r["speedup"] == 1.0 for r in rows if r["strategy"] == "plain")
    assert all(r["mean_acceptance_length"] >= 1.0 for r in rows if r["strategy"] != "plain")
    paths = bench_batched.write_batched_outputs(report, tmp_path)
    assert "| 4 | eagle3-tree k=2 d=2 n=3 |" in Path(paths["markdown"]).read_text()

    ids, mask = bench_batched.left_padded([torch.tensor([[5, 6, 7]]), torch.tensor([[9]])], 0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert bench_batched.new_tokens(torch.tensor([[1, 2, 3, 3, 0]]), 1, {3}) == [[2, 3]]
    with pytest.raises(ValueError, match="raise --num-prompts"):
        bench_batched.run_batched_bench(target, draft, ByteTokenizer(), prompts[:1], batch_sizes=(2,),
                                        max_new_tokens=2, ks=(1,), progress=False)
    with pytest.raises(ValueError, match="at least once"):
        bench_batched.run_batched_bench(target, draft, ByteTokenizer(), prompts, batch_sizes=(2,), repeats=0,
                                        max_new_tokens=2, ks=(1,), progress=False)


def test_batched_bench_repeats_every_batch_and_pairs_the_calls(monkeypatch):
    """``--repeats 3``: every batch timed three times per strategy, in turn; the paired ratio is the median over the
    calls of each call's speed against the plain call of the same batch and repeat."""
    from hf_eagle3.bench import batched as bench_batched

    target = tiny_target("llama")
    target.generation_config.eos_token_id = None
    draft = tiny_draft(target)
    calls = []
    generate = type(target).generate
    monkeypatch.setattr(type(target), "generate", lambda self, ids, **kw: calls.append(
        (ids.shape[0], "assistant_model" in kw, kw["max_new_tokens"])) or generate(self, ids, **kw))
    clock = iter(range(10_000))
    monkeypatch.setattr(bench_batched.time, "perf_counter", lambda: float(next(clock)))  # every call: 1 s
    report = bench_batched.run_batched_bench(target, draft, ByteTokenizer(), ["ab", "abcd", "x", "yz"],
                                             batch_sizes=(2,), max_new_tokens=9, ks=(2,), families=["eagle3_chain"],
                                             repeats=3, progress=False)
    timed = [c for c in calls if c[2] == 9]  # the warm-up calls generate 8
    assert timed == [(2, False, 9), (2, True, 9)] * 6  # two batches, three repeats, plain then the chain in turn
    assert report["repeats"] == 3 and report["greedy_identical"]
    chain = next(r for r in report["results"] if r["strategy"] == "eagle3-chain k=2")
    assert chain["new_tokens"] == 2 * 9 * 2 * 3 and chain["paired_speedup"] == pytest.approx(1.0)
    with pytest.raises(SystemExit, match="--repeats"):
        cli.main(["bench", "--repeats", "2"])  # the batch-1 bench times each prompt once


def test_demo_exit_code_fails_on_a_float32_mismatch_only(monkeypatch):
    """`hf-eagle3 demo` fails when greedy outputs differ in float32 (the contract) but not in bfloat16, where
    multi-token forwards round differently and the demo explains the difference instead."""
    from hf_eagle3 import demo

    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--max-new-tokens", "8"])
    cases = [(True, True, 0), (False, True, 1), (False, False, 0), (None, True, 0)]
    for identical, exact, code in cases:
        monkeypatch.setattr(demo, "run_demo", lambda **kw: {"identical": identical, "exact_dtype": exact})
        assert demo.demo_command(args) == code, (identical, exact)


def test_bench_compiled_draft_rows_side_by_side(tmp_path, monkeypatch):
    """``--compile-draft``: every EAGLE-3 strategy also runs with compiled drafting steps, right after its eager twin,
    once per mode (dynamic and static steps), with the same output and acceptance (``aot_eager`` here: the eager
    kernels); the draft's config is restored."""
    from hf_eagle3.bench import batched as bench_batched
    from hf_eagle3.core.modeling_eagle3 import Eagle3DraftModel

    monkeypatch.setattr(bench_strategies, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    compiled_calls = []
    original = Eagle3DraftModel.step_call

    def spy(self, step):
        result = original(self, step)
        compiled_calls.append(result is not step)
        return result

    monkeypatch.setattr(Eagle3DraftModel, "step_call", spy)
    target = tiny_target("llama")
    draft = tiny_draft(target, 128)
    prompts = loading.load_prompts(write_prompts(tmp_path / "question.jsonl"), 2)
    report = bench.run_bench(target, draft, ByteTokenizer(), prompts, max_new_tokens=8, ks=(2,), temperature=0,
                             families=["eagle3_chain", "eagle3_tree"], tree_shapes=((2, 2, 3),), cost_sizes=(),
                             progress=False, compile_draft="default,reduce-overhead")
    names = [r["strategy"] for r in report["results"]]
    assert names == ["plain", "eagle3-chain k=2", "eagle3-chain k=2 compiled",
                     "eagle3-chain k=2 compiled reduce-overhead", "eagle3-tree k=2 d=2 n=3",
                     "eagle3-tree k=2 d=2 n=3 compiled", "eagle3-tree k=2 d=2 n=3 compiled reduce-overhead"]
    assert report["greedy_identical"] and report["settings"]["compile_draft"] == ["default", "reduce-overhead"]
    rows = {r["strategy"]: r for r in report["results"]}
    for name in ("eagle3-chain k=2", "eagle3-tree k=2 d=2 n=3"):
        assert rows[f"{name} compiled"]["stats"] == rows[name]["stats"]
        assert rows[f"{name} compiled reduce-overhead"]["stats"] == rows[name]["stats"]
    with pytest.raises(ValueError, match="unknown torch.compile mode"):
        bench_strategies.compile_modes("default,fast")
    assert True in compiled_calls and False in compiled_calls
    assert draft.generation_config.compile_config is None
    batched = bench_batched.run_batched_bench(target, draft, ByteTokenizer(), ["ab", "abcd"], batch_sizes=(2,),
                                              max_new_tokens=4, ks=(2,), families=["eagle3_chain"], progress=False,
                                              compile_draft=True)
    assert [r["strategy"] for r in batched["results"]] == ["plain", "eagle3-chain k=2", "eagle3-chain k=2 compiled"]
    assert batched["greedy_identical"]
