"""The parsers of ``hf-eagle3 prepare``, ``train`` and ``evaluate`` (the commands: :mod:`hf_eagle3.training.cli`).

Light on purpose: building them imports neither torch nor Transformers, so that ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import math

from hf_eagle3.cli import lazy_command

DTYPES = ["auto", "float32", "bfloat16", "float16"]
LOSS_KINDS = ("ce", "lk", "mixed")  # hf_eagle3.training.ttt.LOSS_KINDS (not imported: it imports torch)


def _at_least_three(text: str) -> int:
    """argparse type: an integer >= 3 (target layers an EAGLE-3 draft reads: ``configuration_eagle3.FEATURE_LAYERS``,
    not imported: it imports Transformers)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 3:
        raise argparse.ArgumentTypeError(f"{text!r}: an EAGLE-3 draft reads at least 3 target layers")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text}: give a finite number > 0")
    return value


def add_prepare_parser(subparsers):
    """Add the ``prepare`` subcommand.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    p = subparsers.add_parser(
        "prepare",
        help="regenerate training responses with the target (resumable)",
        description="Answer the prompts of a JSONL file with the target itself (its chat template, greedy by "
        "default) and store the token ids under --out; a rerun skips the prompts already answered. With "
        "--self-prompts N the target first writes N prompts of its own. With "
        "--features-dir it also writes the draft's training features during generation.",
    )
    p.add_argument("--target", default=None, help="Hub id or local path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=None,
                   help="the data: .jsonl / .json of {id, prompt}, OpenAI {messages: [{role, content}]}, ShareGPT "
                   "{conversations: [{from, value}]} or {turns: [...]}, or a `datasets` folder or Hub name (needs "
                   "hf-eagle3[data]); every user turn is answered; required unless --self-prompts is given "
                   "(default: none)")
    p.add_argument("--split", default="train", help="split of a `datasets` folder or Hub dataset (default train)")
    p.add_argument("--answers", default="regenerate", choices=["regenerate", "given"],
                   help="regenerate: the target answers every user turn (the recipe); given: use the data's own "
                   "assistant turns as they are (off-policy answers lower acceptance; warns) (default regenerate)")
    p.add_argument("--out", required=True, help="directory of the responses-*.jsonl files (created; resumed)")
    p.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip prompts longer than this after templating (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (default 256)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call (default 32)")
    p.add_argument("--do-sample", action="store_true", help="sample the responses (default: greedy)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature with --do-sample (default 0.7)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="dtype of the target (default auto: bfloat16 on GPUs and CPUs with bf16 hardware, "
                   "float32 elsewhere)")
    p.add_argument("--features-dir", default=None,
                   help="also write the training features, captured during generation (saves `train` the feature "
                   "pass: give it --features-dir DIR --skip-features; default: none written)")
    p.add_argument("--max-feature-prompt-tokens", type=int, default=256,
                   help="prompt positions kept per record in the feature shards (default 256)")
    p.add_argument("--device", default=None, help="where the target runs (default: cuda:LOCAL_RANK if CUDA, else cpu)")
    p.add_argument("--device-map", default=None,
                   help="spread a target too large for one device over several: auto, balanced, sequential, or a "
                   "JSON object of module name to device (from_pretrained's device_map; excludes --device; with "
                   "torchrun give each process its own devices with CUDA_VISIBLE_DEVICES) (default: one device)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="first have the target write N prompts of its own (Magpie: its chat template up to a user "
                   "turn, sampled with --seed; degenerate, duplicate and --exclude-prompts-overlapping ones dropped), "
                   "then answer them like --prompts (default 0: none)")
    p.add_argument("--self-prompts-file", default=None,
                   help="JSONL the self-written prompts go to; a rerun continues it (default: OUT/self_prompts.jsonl)")
    p.add_argument("--exclude-prompts", default=None,
                   help="JSONL of evaluation prompts ({turns: [...]} or {prompt}) no self-written prompt may equal "
                   "or share a 50-character span with; pass your MT-bench question.jsonl when you measure on MT-bench "
                   "(default: none)")
    p.add_argument("--self-prompt-temperature", type=float, default=1.0,
                   help="sampling temperature of the self-written prompts (default 1.0)")
    p.add_argument("--num-shards", type=int, default=None,
                   help="processes sharing the prompts (default: $WORLD_SIZE, set by accelerate launch / torchrun; 1)")
    p.add_argument("--shard-index", type=int, default=None,
                   help="this process's share, 0..num-shards-1 (default: $RANK; 0)")
    p.set_defaults(func=lazy_command("hf_eagle3.training.cli", "cmd_prepare"))
    return p


def add_train_parser(subparsers):
    """Add the ``train`` subcommand.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    t = subparsers.add_parser(
        "train",
        help="train an EAGLE-3 draft (training-time test) on prepared data",
        description="Cache the target's features for the responses under --data, build the draft vocabulary, "
        "train a draft with the training-time test and save it under --out (every step resumable). Training ends "
        "after --epochs, --max-steps or --max-minutes, whichever comes first, and says which.",
    )
    t.add_argument("--target", default=None,
                   help="target of the feature pass, Hub id or local path (default: SmolLM2-135M-Instruct)")
    t.add_argument("--data", required=True, help="directory written by `hf-eagle3 prepare`")
    t.add_argument("--out", required=True, help="run directory: vocab.pt, features/, run/ (checkpoints), draft/")
    t.add_argument("--save-dir", default=None, help="where the trained draft is saved (default: OUT/draft)")
    t.add_argument("--features-dir", default=None,
                   help="feature shards, read and written (default: OUT/features)")
    t.add_argument("--skip-features", action="store_true",
                   help="features are already cached (by prepare --features-dir): no feature pass (default: run it)")
    t.add_argument("--complete-shards-only", action="store_true",
                   help="leave a last, partial feature shard unwritten, for data still growing (default: write it)")
    t.add_argument("--max-records", type=int, default=0,
                   help="cache features for the first N records only (default 0: all); the draft vocabulary is "
                        "counted over all of --data either way")
    t.add_argument("--per-shard", type=int, default=128, help="records per feature shard (default 128)")
    t.add_argument("--feature-batch", type=int, default=8,
                   help="sequences per target forward in the feature pass (default 8)")
    t.add_argument("--feature-dtype", default="auto", choices=DTYPES,
                   help="dtype of the target in the feature pass (default auto: bfloat16 on GPUs and CPUs with bf16 "
                   "hardware, float32 elsewhere)")
    t.add_argument("--device", default=None,
                   help="where the target runs for the feature pass (default: cuda:LOCAL_RANK if CUDA, else cpu)")
    t.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="draft vocabulary: the most frequent response tokens (default 8192)")
    t.add_argument("--rebuild-vocab", action="store_true",
                   help="with --init-draft: rebuild the draft vocabulary (--draft-vocab-size tokens) from the "
                        "responses of --data and --vocab-data, keeping the trained rows of tokens it already had "
                        "(default: keep the init draft's vocabulary)")
    t.add_argument("--vocab-data", nargs="*", default=None,
                   help="more response directories (of `prepare`) whose tokens count for --rebuild-vocab "
                        "(default: none, --data only)")
    t.add_argument("--init-draft", default=None,
                   help="start from this trained draft instead of a new one (default: a new draft)")
    t.add_argument("--ttt-length", type=int, default=7, help="draft steps unrolled per position (default 7)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default 0.001)")
    t.add_argument("--epochs", type=int, default=1, help="passes over the training shards (default 1)")
    t.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch (default 4096)")
    t.add_argument("--warmup-steps", type=int, default=50,
                   help="linear warm-up steps before the cosine decay (default 50)")
    t.add_argument("--max-prompt-context", type=int, default=256,
                   help="prompt tokens kept before each response (default 256)")
    t.add_argument("--prompt-loss-weight", type=float, default=0.0,
                   help="also train on prompt positions with this weight (default 0: responses only, the reference)")
    t.add_argument("--target-temperature", type=float, default=1.0,
                   help="temperature of the target's distribution used as soft labels (default 1: the reference; "
                        "below 1 sharpens it towards the argmax that greedy decoding accepts)")
    t.add_argument("--loss", default="ce", choices=list(LOSS_KINDS),
                   help="training objective per position and draft step: ce = soft cross-entropy against the target's "
                        "distribution (the reference); lk = the acceptance term 1 - sum_x min(p(x), q(x)) (the "
                        "rejection probability of speculative sampling, LK losses, arXiv 2602.23881) alone; mixed = "
                        "ce + --lk-weight x lk (default ce)")
    t.add_argument("--lk-weight", type=_positive_float, default=None,
                   help="with --loss mixed: weight of the acceptance term (default 1.0)")
    t.add_argument("--feature-layers", type=_at_least_three, default=None,
                   help="target layers a new draft reads (default 3, EAGLE-3's [2, N // 2, N - 3]; more are spread "
                        "evenly from layer 2 to N - 3). SGLang, vLLM and OpenVINO GenAI read exactly 3: a draft on "
                        "more exports only natively (--format native, --remote-code)")
    t.add_argument("--freeze-head", action="store_true",
                   help="keep the draft's lm_head as it starts (the target's rows of the draft vocabulary, or "
                        "--init-draft's) and train the layer and fc only; with --draft-vocab-size set to the target's "
                        "vocabulary size, the target's own head (a frozen full-vocabulary head)")
    t.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16", "no"],
                   help="autocast of training (default auto: bf16 on GPUs and CPUs with bf16 hardware, no elsewhere)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the draft's new layers, of the shard and batch order and of torch while training "
                        "(default 0): two runs with one seed give the same draft; a run that continues a draft for "
                        "part of a pass sees other shards first with a new seed")
    t.add_argument("--save-every", type=int, default=100, help="checkpoint every N optimiser steps (default 100)")
    t.add_argument("--max-steps", type=int, default=0, help="stop after N optimiser steps (default 0: no limit)")
    t.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop after this many minutes of training; the schedule follows the clock (default 0: no "
                   "limit; --epochs still ends training first if it comes first)")
    t.add_argument("--holdout-shards", type=int, default=1,
                   help="first feature shards kept out of training to measure accuracy (default 1)")
    t.add_argument("--holdout-features", default=None,
                   help="a features directory of the same target (hf-eagle3 prepare --features-dir) whose every shard "
                   "is the held-out set checkpoints are scored on, instead of the first --holdout-shards: with "
                   "--init-draft, answers to prompts that draft never trained on (default: none)")
    t.add_argument("--stop-gain", type=float, default=0.0,
                   help="early stopping, with --stop-window: end training at the first checkpoint where the last "
                   "--stop-window minutes added less than this held-out acceptance length (the weights at the start "
                   "are scored too); the best checkpoint is saved (default 0: none)")
    t.add_argument("--stop-window", type=float, default=0.0,
                   help="minutes of training --stop-gain looks back over (default 0: none)")
    t.add_argument("--accumulate", type=int, default=1,
                   help="batches per process per optimiser step (gradient accumulation; default 1): N processes "
                   "take N x this many batches a step, so one GPU with --accumulate 8 follows an 8-GPU run's curve")
    t.add_argument("--fsdp", action="store_true",
                   help="under torchrun / accelerate launch: shard the draft's weights, gradients and optimiser "
                   "state over the processes (FSDP) instead of replicating them (DDP), for drafts (a large vocabulary "
                   "head) or optimiser states that do not fit on one device (default: DDP)")
    t.add_argument("--select-by", default=None, choices=["holdout", "last"],
                   help="which weights are saved: holdout = the checkpoint (every --save-every steps and at the end) "
                   "with the highest replayed greedy chain acceptance (k=5) on the held-out shards, last = the last "
                   "weights (default: holdout when --holdout-shards >= 1 or --holdout-features is given, else last)")
    t.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved draft (default bfloat16)")
    t.add_argument("--export-flat", action="store_true",
                   help="also write the flat layout (SGLang, EAGLE reference) to OUT/export-flat (default: off)")
    t.add_argument("--export-speculators", action="store_true",
                   help="also write the speculators layout (vLLM) to OUT/export-speculators (default: off)")
    t.set_defaults(func=lazy_command("hf_eagle3.training.cli", "cmd_train"))
    return t


def add_evaluate_parser(subparsers):
    """Add the ``evaluate`` subcommand.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    e = subparsers.add_parser(
        "evaluate",
        help="score a draft on cached features: per-step accuracy and replayed chain acceptance",
        description="Run the draft teacher-forced over feature shards (written by `train`, or by `prepare "
        "--features-dir` on answers to your own prompts) and report its per-step accuracy against the target's "
        "argmax and the mean acceptance length greedy chain decoding would reach on those answers, replayed from "
        "one pass instead of decoding. The replay is exact where the answers are the target's greedy ones.",
    )
    e.add_argument("--draft", required=True, help="the draft: a directory or Hub id any Eagle3DraftModel loads")
    e.add_argument("--features-dir", required=True, help="feature shards (shard-*.pt, target_head.pt, meta.json)")
    e.add_argument("--shards", default="holdout", choices=["holdout", "all"],
                   help="score the first --holdout-shards shards (those training leaves out) or every shard "
                   "(default holdout)")
    e.add_argument("--holdout-shards", type=int, default=1, help="leading shards held out in training (default 1)")
    e.add_argument("--k", type=int, default=5, help="draft tokens per round of the replayed chain (default 5)")
    e.add_argument("--ttt-length", type=int, default=5, help="draft steps whose accuracy is reported (default 5)")
    e.add_argument("--max-prompt-context", type=int, default=256,
                   help="prompt tokens kept before each answer (default 256)")
    e.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch (default 4096)")
    e.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's choice)")
    e.add_argument("--json-out", default=None, help="also write the figures to this JSON file (default: none)")
    e.set_defaults(func=lazy_command("hf_eagle3.training.cli", "cmd_evaluate"))
    return e


def register(subparsers) -> None:
    """Add the ``prepare``, ``train`` and ``evaluate`` subcommands to an argparse ``subparsers``.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    add_prepare_parser(subparsers)
    add_train_parser(subparsers)
    add_evaluate_parser(subparsers)
