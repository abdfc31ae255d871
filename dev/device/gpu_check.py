"""The GPU check of hf-eagle3's decoding: one run, within a time budget, writing one table.

Stages, in order of importance (each is skipped, and says so, when the budget left is too small for it):

1. ``identity``: float32 with TF32 off, random-weight targets of two architectures (Llama-3.2-1B and Qwen3-1.7B
   shapes): under the oracle (the seed's Llama-3.1-8B acceptance profile) chains k = 3 and 5, ``"auto"``, a tree and
   a tree with ``"auto"`` size, each compared token for token with plain ``generate``; then ragged left-padded
   batches of 2, 4 and 8 rows with a random draft (chain, ``"auto"``, tree) against plain batched ``generate``.
2. ``oracle_bf16``: bfloat16, a random-weight target of Llama-3.1-8B's shape (``decisive``: its greedy
   continuation survives bfloat16 rounding, see :func:`hf_eagle3.bench.synthetic.synthetic_target`) with a draft of the published draft's
   shape (draft vocabulary 32k), the oracle's speed-ups for chains k = 1..7, ``"auto"`` and three trees.
3. ``static_bf16``: the oracle stage on a static cache with the target's forward compiled (CUDA graphs), against plain
   ``generate`` compiled the same way (Transformers' own fast path): chains k = 3 and 5, ``"auto"``, two trees; then
   the two trees again with each drafting round captured whole (the draft's ``compile_config``).
4. ``batched_bf16``: the same target in bfloat16 on batches of 1, 2, 4 and 8 rows with a random draft (nothing is
   accepted): the decoding loop's cost per round against plain batched ``generate``.
5. ``compiled_bf16``: the oracle stage's target and draft, chains k = 3 and 5 and a tree, with the draft's steps eager,
   under ``torch.compile`` with dynamic shapes (``CompileConfig(mode="default")``) and as static steps captured as
   CUDA graphs (``CompileConfig(mode="reduce-overhead")``), side by side (a short call compiles / captures first).

Writes ``gpu_check.md`` and ``gpu_check.json`` to ``--out`` after every stage, so a run cut short keeps what it
finished. Exit code 1 when an output differs from plain ``generate``.

On a GPU:     python dev/device/gpu_check.py --out gpu_out --budget 420
On a CPU (the same code at toy size):  python dev/device/gpu_check.py --device cpu --small --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_eagle3.bench.batched import format_batched_markdown, run_batched_bench  # noqa: E402
from hf_eagle3.bench.oracle import format_oracle_markdown, run_oracle_bench  # noqa: E402
from hf_eagle3.bench.oracle_drafting import parse_profile  # noqa: E402
from hf_eagle3.bench.synthetic import synthetic_target  # noqa: E402
from hf_eagle3.loading import random_draft_for  # noqa: E402


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[torch.LongTensor]:
    """Random prompt ids ``[1, L]`` for each length in ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (1, n), generator=generator) for n in lengths]


class Check:
    """Runs the stages within a budget and writes the report after each."""

    def __init__(self, args):
        self.args, self.start = args, time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.report = {"environment": environment(), "stages": {}}
        self.markdown = ["# hf-eagle3 GPU check", "", "```", json.dumps(self.report["environment"], indent=1), "```", ""]
        self.identical = True

    def left(self) -> float:
        """Seconds of budget left."""
        return self.args.budget - (time.perf_counter() - self.start)

    def stage(self, name: str, needs: float, body):
        """Run ``body()`` (returning ``(json, markdown)``) when at least ``needs`` seconds are left."""
        if self.left() < needs:
            self.report["stages"][name] = {"skipped": f"{self.left():.0f} s left, needs {needs:.0f} s"}
            self.markdown += [f"## {name}", "", f"skipped: {self.left():.0f} s of budget left", ""]
        else:
            began = time.perf_counter()
            try:
                data, text = body()
                data["seconds"] = time.perf_counter() - began
                self.report["stages"][name] = data
                self.markdown += [f"## {name} ({data['seconds']:.0f} s)", "", text, ""]
            except Exception:
                error = traceback.format_exc()
                print(error, file=sys.stderr)
                self.report["stages"][name] = {"error": error}
                self.markdown += [f"## {name}", "", "```", error, "```", ""]
                self.identical = False
            free_memory()
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text("\n".join(self.markdown) + "\n")
        print(f"[{time.perf_counter() - self.start:.0f} s] {name} done", file=sys.stderr, flush=True)


def environment() -> dict:
    """Versions and the accelerator."""
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "gpu": gpu, "cuda": torch.version.cuda}


def free_memory():
    """Release cached GPU memory between stages."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def identity(args):
    """Stage 1: float32 token-for-token identity under the oracle and on ragged batches."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shapes = ["tiny"] if args.small else ["llama-3.2-1b", "qwen3-1.7b"]
    new = 16 if args.small else 48
    data, text = {}, []
    for shape in shapes:
        target = synthetic_target(shape, dtype=torch.float32, device=args.device)
        vocab = target.config.vocab_size
        draft = random_draft_for(target, draft_vocab_size=min(32000, vocab))
        prompts = random_prompts(vocab, [64, 96])
        with torch.no_grad():
            oracle = run_oracle_bench(target, draft, prompts, parse_profile("llama3-8b"), ks=(3, 5),
                                      max_new_tokens=new, tree_shapes=((4, 4, 8), (4, 5, "auto")))
            ragged = random_prompts(vocab, [40, 72, 56, 120, 88, 64, 100, 48], seed=1)
            batched = run_batched_bench(target, draft, None, ragged, batch_sizes=(2, 4, 8), max_new_tokens=new // 2,
                                        ks=(3,), tree_shapes=((4, 4, 8),), progress=False)
        ok = oracle["identical"] and batched["greedy_identical"]
        data[shape] = {"oracle_identical": oracle["identical"], "batched_identical": batched["greedy_identical"],
                       "mismatches": batched["mismatches"], "oracle": oracle, "batched": batched}
        text += [f"### {shape}: oracle identical {oracle['identical']}, batched identical "
                 f"{batched['greedy_identical']}", "", format_oracle_markdown(oracle), "",
                 format_batched_markdown(batched), ""]
        check.identical &= ok
        del target, draft
        free_memory()
    return data, "\n".join(text)


def oracle_bf16(args):
    """Stage 2: the oracle's speed-ups on a Llama-3.1-8B-shaped target in bfloat16."""
    shape = "tiny" if args.small else "llama-3.1-8b"
    target = synthetic_target(shape, dtype=torch.bfloat16, device=args.device, decisive=True)
    vocab = target.config.vocab_size
    draft = random_draft_for(target, draft_vocab_size=min(32000, vocab))
    prompts = random_prompts(vocab, [256] * (1 if args.small else args.oracle_prompts))
    with torch.no_grad():
        report = run_oracle_bench(target, draft, prompts, parse_profile("llama3-8b"),
                                  ks=tuple(int(k) for k in args.ks.split(",")),
                                  max_new_tokens=16 if args.small else args.oracle_new_tokens,
                                  tree_shapes=((4, 4, 8), (8, 6, 32), (4, 5, "auto")))
    check.identical &= report["identical"]
    return report, format_oracle_markdown(report)


def batched_bf16(args):
    """Stage 4: batches of 1-8 rows in bfloat16 with a random draft (the loop's cost per round), one batch per size."""
    shape = "tiny" if args.small else "llama-3.1-8b"
    target = synthetic_target(shape, dtype=torch.bfloat16, device=args.device, decisive=True)
    vocab = target.config.vocab_size
    draft = random_draft_for(target, draft_vocab_size=min(32000, vocab))
    prompts = random_prompts(vocab, [256 - 8 * i for i in range(8)], seed=2)
    reports = []
    for size in (int(b) for b in args.batch_sizes.split(",")):
        if check.left() < 20:
            break
        with torch.no_grad():
            reports.append(run_batched_bench(target, draft, None, prompts[:size], batch_sizes=(size,),
                                             max_new_tokens=16 if args.small else args.batch_new_tokens, ks=(3,),
                                             tree_shapes=((4, 4, 8),), progress=True))
    report = {"results": [r for rep in reports for r in rep["results"]],
              "greedy_identical": all(rep["greedy_identical"] for rep in reports),
              "mismatches": [m for rep in reports for m in rep["mismatches"]],
              "batch_sizes": [rep["batch_sizes"][0] for rep in reports]}
    plain_one = next(r["tokens_per_s"] for r in report["results"] if r["strategy"] == "plain")
    for r in report["results"]:
        r["speedup_vs_first_plain"] = r["tokens_per_s"] / plain_one
    check.identical &= report["greedy_identical"]
    return report, format_batched_markdown(report)


def static_bf16(args):
    """Stage 3: the oracle's stage on a static cache with the target's forward compiled (``reduce-overhead``: CUDA
    graphs), plain ``generate`` compiled the same way as the baseline; chains k = 3 and 5, ``"auto"``, a fixed tree
    and a tree of ``"auto"`` size (every strategy's first call, which compiles, untimed)."""
    from transformers import CompileConfig

    shape = "tiny" if args.small else "llama-3.1-8b"
    target = synthetic_target(shape, dtype=torch.bfloat16, device=args.device, decisive=True)
    vocab = target.config.vocab_size
    draft = random_draft_for(target, draft_vocab_size=min(32000, vocab))
    prompts = random_prompts(vocab, [256] * (1 if args.small else args.oracle_prompts))
    config = CompileConfig(mode="reduce-overhead" if args.device.startswith("cuda") else "default")
    config._compile_all_devices = True  # a CPU (the small run): Transformers compiles only on accelerators otherwise
    common = dict(max_new_tokens=16 if args.small else args.oracle_new_tokens,
                  generate_kwargs=dict(cache_implementation="static", compile_config=config))
    with torch.no_grad():
        report = run_oracle_bench(target, draft, prompts, parse_profile("llama3-8b"), ks=(3, 5),
                                  tree_shapes=((4, 4, 8), (4, 5, "auto")), **common)
        # The trees again with each drafting round captured whole (CUDA graphs on CUDA; static steps on a CPU).
        draft.generation_config.compile_config = config if args.device.startswith("cuda") else CompileConfig(
            dynamic=False)
        try:
            captured = run_oracle_bench(target, draft, prompts, parse_profile("llama3-8b"), ks=(), auto=False,
                                        tree_shapes=((4, 4, 8), (4, 5, "auto")), **common)
        finally:
            draft.generation_config.compile_config = None
    check.identical &= report["identical"] and captured["identical"]
    return {"draft eager": report, "draft captured": captured}, (
        "Plain `generate` below: static cache, compiled forward.\n\n### Draft eager\n\n"
        + format_oracle_markdown(report) + "\n\n### Each drafting round captured whole\n\n"
        + format_oracle_markdown(captured))


def compiled_bf16(args):
    """Stage 5: eager against compiled drafting steps (dynamic, and static in CUDA graphs) under the oracle, bfloat16,
    the same prompts."""
    from transformers import CompileConfig

    shape = "tiny" if args.small else "llama-3.1-8b"
    target = synthetic_target(shape, dtype=torch.bfloat16, device=args.device, decisive=True)
    vocab = target.config.vocab_size
    draft = random_draft_for(target, draft_vocab_size=min(32000, vocab))
    prompts = random_prompts(vocab, [256] * (1 if args.small else args.oracle_prompts), seed=3)
    new = 16 if args.small else args.oracle_new_tokens
    options = dict(ks=(3, 5), auto=False, tree_shapes=((4, 4, 8),), progress=False)
    reports = {}
    for name, config in (("eager", None), ("compiled", CompileConfig(mode="default")),
                         ("cuda graphs", CompileConfig(mode="reduce-overhead"))):
        draft.generation_config.compile_config = config
        with torch.no_grad():
            run_oracle_bench(target, draft, prompts[:1], parse_profile("llama3-8b"), max_new_tokens=8,
                             **options)  # compiles the steps (compiled) or warms up (eager)
            reports[name] = run_oracle_bench(target, draft, prompts, parse_profile("llama3-8b"), max_new_tokens=new,
                                             **options)
    draft.generation_config.compile_config = None
    check.identical &= all(r["identical"] for r in reports.values())
    text = "\n\n".join(f"### {name}\n\n{format_oracle_markdown(r)}" for name, r in reports.items())
    return reports, text


def main(argv=None) -> int:
    """Run the stages; exit code 1 when an output differs from plain ``generate`` or a stage failed."""
    global check
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench_out/gpu_check")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all stages (default 420)")
    parser.add_argument("--small", action="store_true", help="toy sizes (a CPU test of the script)")
    parser.add_argument("--oracle-prompts", type=int, default=2, help="prompts of the bf16 oracle stage (default 2)")
    parser.add_argument("--oracle-new-tokens", type=int, default=64, help="new tokens per oracle prompt (default 64)")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7", help="chain lengths of the bf16 oracle stage")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="batch sizes of the bf16 batched stage")
    parser.add_argument("--batch-new-tokens", type=int, default=48, help="new tokens per row, batched stage")
    parser.add_argument("--stages", default="identity,oracle_bf16,static_bf16,batched_bf16,compiled_bf16")
    args = parser.parse_args(argv)
    check = Check(args)
    needs = {"identity": 0, "oracle_bf16": 90, "static_bf16": 150, "batched_bf16": 40, "compiled_bf16": 120}
    bodies = {"identity": identity, "oracle_bf16": oracle_bf16, "static_bf16": static_bf16,
              "batched_bf16": batched_bf16, "compiled_bf16": compiled_bf16}
    for name in args.stages.split(","):
        check.stage(name, needs[name] if not args.small else 0, lambda: bodies[name](args))
    print((check.out / "gpu_check.md").read_text())
    return 0 if check.identical else 1


check: Check


if __name__ == "__main__":
    sys.exit(main())
