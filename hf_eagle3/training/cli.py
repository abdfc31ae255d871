"""``hf-eagle3 prepare``, ``train`` and ``evaluate``: data generation, draft training and scoring from the command
line."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..loading import load_target, parse_dtype
from .hardware import resolve_dtype


def default_device() -> str:
    """``cuda:{LOCAL_RANK}`` (one GPU per process under ``accelerate launch`` / ``torchrun``) when CUDA is there,
    else ``cpu``."""
    import os

    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def process_share(num_shards: int | None, shard_index: int | None) -> tuple[int, int]:
    """``(num_shards, shard_index)`` for ``prepare``: as given, else from ``WORLD_SIZE`` / ``RANK`` (set by
    ``accelerate launch`` and ``torchrun``), else ``(1, 0)``.

    Args:
        num_shards: ``--num-shards`` (``None``: from the environment).
        shard_index: ``--shard-index`` (``None``: from the environment).
    """
    import os

    n = num_shards if num_shards is not None else int(os.environ.get("WORLD_SIZE", 1))
    i = shard_index if shard_index is not None else int(os.environ.get("RANK", 0))
    return n, i


def parse_device_map(text: str | None):
    """``--device-map``: ``None``, a name ``from_pretrained`` knows (``"auto"``, ``"balanced"``, ...) or a JSON
    object of module name to device.

    Args:
        text: the option's value.
    """
    if text is None or not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--device-map {text}: not a JSON object ({err}).") from None


def cmd_prepare(args) -> None:
    """Regenerate responses to a prompt file with the target (resumable); prints the dtype chosen first. With
    ``--self-prompts N`` the target first writes N prompts of its own, which are then answered like the others.

    Args:
        args: the parsed ``prepare`` options.
    """
    from .prepare import prepare

    self_prompts = getattr(args, "self_prompts", 0) or 0
    if args.prompts is None and self_prompts <= 0:  # before the model is loaded
        raise SystemExit("prepare needs prompts: --prompts FILE (JSONL of {id, prompt}, or conversations), or "
                         "--self-prompts N to have the target write N prompts of its own.")
    if args.answers == "given" and args.features_dir is not None:  # before the model is loaded
        raise SystemExit("--answers given generates nothing, so --features-dir has nothing to capture: drop it and "
                         "let `train` compute the features.")
    if args.prompts is not None:  # a data source that cannot be read fails here, before the model is loaded
        from .conversations import read_conversations

        try:
            read_conversations(args.prompts, limit=1, split=args.split)
        except (ValueError, ImportError, FileNotFoundError) as err:
            raise SystemExit(str(err)) from None
    if self_prompts < 0:
        raise SystemExit(f"--self-prompts {self_prompts}: give a number of prompts >= 0.")
    num_shards, shard_index = process_share(args.num_shards, args.shard_index)
    if not 0 <= shard_index < num_shards:  # before the model is loaded
        raise SystemExit(f"--shard-index {shard_index} is outside 0..{num_shards - 1} (--num-shards {num_shards}).")
    self_file = None
    exclude = []
    if self_prompts > 0:
        from .self_prompts import count_prompts, read_exclude_prompts

        self_file = Path(args.self_prompts_file or Path(args.out) / "self_prompts.jsonl")
        if num_shards > 1 and count_prompts(self_file) < self_prompts:
            raise SystemExit(f"--self-prompts with {num_shards} processes: {self_file} holds fewer than "
                             f"{self_prompts} prompts, and only one process may write it. Run this command in one "
                             "process first (it writes the prompts and answers them; stop it once the prompts are "
                             "written if you like), then launch the processes with the same options.")
        if args.exclude_prompts:
            exclude = read_exclude_prompts(args.exclude_prompts)
    device_map = parse_device_map(args.device_map)
    if device_map is not None and args.device is not None:
        raise SystemExit(f"--device {args.device} and --device-map {args.device_map}: give one.")
    device = None if device_map is not None else args.device or default_device()
    dtype, line = resolve_dtype(args.dtype, device or default_device())
    print(line)
    model, tok = load_target(args.target, dtype, device=device, device_map=device_map)
    files = [args.prompts] if args.prompts is not None else []
    if self_file is not None:
        from .self_prompts import write_self_prompts

        write_self_prompts(model, tok, self_prompts, self_file, seed=args.seed, exclude_prompts=exclude,
                           temperature=args.self_prompt_temperature, batch_size=args.batch_size)
        files.append(self_file)
    for prompts in files:
        prepare(
            model,
            tok,
            prompts,
            args.out,
            max_prompts=args.max_prompts,
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            do_sample=args.do_sample,
            temperature=args.temperature,
            seed=args.seed,
            features_dir=args.features_dir,
            max_feature_prompt_tokens=args.max_feature_prompt_tokens,
            num_shards=num_shards,
            shard_index=shard_index,
            answers=args.answers if prompts == args.prompts else "regenerate",
            split=args.split,
        )


def cmd_train(args) -> None:
    """Vocabulary mapping -> feature cache -> TTT training -> save (native, plus flat / speculators exports).

    Args:
        args: the parsed ``train`` options.
    """
    import torch

    from .features import cache_features
    from .prepare import iter_records
    from .trainer import TrainConfig, draft_config_for_target, end_distributed, evaluate, init_draft, train
    from .vocab import build_vocab_mapping, count_tokens, coverage

    if not args.target_temperature > 0:  # before any record is read or feature computed
        raise SystemExit(f"--target-temperature {args.target_temperature}: give a temperature > 0 (1 = the target's "
                         "own distribution, the reference recipe; e.g. 0.5 sharpens it for greedy decoding).")
    select_by = args.select_by or ("holdout" if args.holdout_shards else "last")
    if args.accumulate < 1:  # before any record is read or feature computed
        raise SystemExit(f"--accumulate {args.accumulate}: give the batches per optimiser step, >= 1.")
    if select_by == "holdout" and args.holdout_shards < 1:
        raise SystemExit("--select-by holdout scores checkpoints on held-out shards: give --holdout-shards >= 1, or "
                         "--select-by last.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_records = list(iter_records(args.data))  # the vocabulary counts them all; --max-records cuts the feature pass
    records = all_records[: args.max_records] if args.max_records else all_records
    print(f"{len(records)} records from {args.data}" + (f" (of {len(all_records)}; the draft vocabulary counts them all)"
                                                       if len(records) < len(all_records) else ""))
    features_dir = Path(args.features_dir or out / "features")
    # Under `accelerate launch` / torchrun: the main process caches the features and builds the vocabulary, the
    # others wait and read them; training is data parallel; only the main process saves.
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    if not args.skip_features and state.is_main_process:
        device = args.device or default_device()
        dtype, line = resolve_dtype(args.feature_dtype, device, label="feature dtype")
        print(line)
        target, _ = load_target(args.target, dtype, device=device, tokenizer="none")
        from ..core.configuration_eagle3 import default_feature_layer_ids
        from ..core.feature_capture import find_decoder_layers

        layer_ids = default_feature_layer_ids(len(find_decoder_layers(target)))
        cache_features(target, records, features_dir, layer_ids, per_shard=args.per_shard, batch_size=args.feature_batch,
                       max_prompt_tokens=args.max_prompt_context, complete_shards_only=args.complete_shards_only)
        del target
    state.wait_for_everyone()
    if not (features_dir / "target_head.pt").exists():
        raise SystemExit(f"{features_dir} holds no features (no target_head.pt): drop --skip-features, or point "
                         "--features-dir at the directory `hf-eagle3 prepare --features-dir` wrote.")
    head = torch.load(features_dir / "target_head.pt", weights_only=False)
    torch.manual_seed(args.seed)  # before the draft is built: its new layers are drawn from torch's generator
    if args.init_draft:  # continue from a trained draft (its vocabulary mapping and layer ids win)
        from ..core.modeling_eagle3 import Eagle3DraftModel
        from .trainer import check_draft_matches_features

        draft = Eagle3DraftModel.from_pretrained(args.init_draft, dtype=torch.float32)
        check_draft_matches_features(draft, features_dir, head)  # before anything is written
        if args.rebuild_vocab:
            from .vocab import remap_draft_vocab

            counts = count_tokens(r["response_ids"] for r in all_records)
            for extra in args.vocab_data or []:
                counts.update(count_tokens(r["response_ids"] for r in iter_records(extra)))
            before = coverage(counts, draft.d2t.cpu())
            d2t, t2d = build_vocab_mapping(counts, args.draft_vocab_size, head["config"]["vocab_size"])
            rows = remap_draft_vocab(draft, d2t, t2d, head["lm_head"])
            print(f"draft vocab rebuilt from {sum(counts.values())} response tokens: covers {before:.4f} -> "
                  f"{coverage(counts, d2t):.4f} of them; {rows['kept']} rows kept, {rows['new']} from the target's"
                  + (" (through the map fitted on the kept rows)" if rows["mapped"] else ""))
    else:
        vocab_file = out / "vocab.pt"
        if not vocab_file.exists() and state.is_main_process:
            counts = count_tokens(r["response_ids"] for r in all_records)
            d2t, t2d = build_vocab_mapping(counts, args.draft_vocab_size, head["config"]["vocab_size"])
            torch.save((d2t, t2d), vocab_file)
            print(f"draft vocab {args.draft_vocab_size}: covers {coverage(counts, d2t):.4f} of response tokens")
        state.wait_for_everyone()
        d2t, t2d = torch.load(vocab_file)
        meta = features_dir / "meta.json"
        layer_ids = json.loads(meta.read_text()).get("layer_ids") if meta.exists() else None
        overrides = {"feature_layer_ids": list(layer_ids)} if layer_ids else {}  # the layers the features come from
        draft = init_draft(draft_config_for_target(head["config"], args.draft_vocab_size, **overrides), head, d2t, t2d)
    cfg = TrainConfig(
        ttt_length=args.ttt_length, lr=args.lr, epochs=args.epochs, batch_tokens=args.batch_tokens,
        warmup_steps=args.warmup_steps, max_prompt_context=args.max_prompt_context,
        prompt_loss_weight=args.prompt_loss_weight, target_temperature=args.target_temperature,
        mixed_precision=args.mixed_precision, save_every=args.save_every, max_steps=args.max_steps,
        max_minutes=args.max_minutes, holdout_shards=args.holdout_shards, seed=args.seed,
        select_by=select_by, accumulate=args.accumulate, fsdp=args.fsdp,
    )
    t0 = time.time()
    draft = train(draft, features_dir, out / "run", cfg)
    end_distributed()
    minutes = (time.time() - t0) / 60
    if not state.is_main_process:  # the main process holds the same weights and saves them
        return
    metrics = {}
    if args.holdout_shards:
        metrics = evaluate(draft, features_dir, ttt_length=args.ttt_length, holdout_shards=args.holdout_shards,
                           max_prompt_context=args.max_prompt_context)
    save_dir = Path(args.save_dir or out / "draft")
    dtype = parse_dtype(args.save_dtype)
    draft.to(dtype).save_pretrained(save_dir)
    (save_dir / "training_summary.json").write_text(json.dumps({
        "records": len(records), "train_minutes_this_run": minutes, "holdout": metrics,
        "selection": (json.loads((out / "run" / "selection.json").read_text())
                      if (out / "run" / "selection.json").exists() else {"selected": "last"}),
        "config": vars(args),
    }, indent=2, default=str))
    print(f"saved {save_dir}")
    print_metrics(metrics, "holdout")
    if args.export_flat or args.export_speculators:
        from ..checkpoints import export

        if args.export_flat:
            export.export_flat(draft, out / "export-flat")
        if args.export_speculators:
            export.export_speculators(draft, out / "export-speculators")


def print_metrics(metrics: dict, label: str) -> None:
    """Print what :func:`~hf_eagle3.training.trainer.evaluate` measured, a line per figure.

    Args:
        metrics: its result (``{}`` prints only the accuracy line, empty).
        label: which answers they were measured on (``"holdout"``, ``"all"``).
    """
    print(f"{label} per-step accuracy {[round(a, 3) for a in metrics.get('acc', [])]}")
    if "vocab_coverage" in metrics:
        print(f"{label} answer tokens in the draft vocabulary: {metrics['vocab_coverage']:.1%}")
    if "chain" in metrics:
        chain = metrics["chain"]
        print(f"{label} answers replayed as greedy chain decoding ({chain['k']} draft tokens a round): mean acceptance "
              f"length {chain['mean_acceptance_length']:.3f} over {chain['num_drafts']} rounds, per position "
              f"{[round(a, 3) for a in chain['acceptance_rate_per_position']]}")


def cmd_evaluate(args) -> None:
    """Score a draft on cached features: per-step accuracy and the replayed greedy chain acceptance.

    Args:
        args: the parsed ``evaluate`` options.
    """
    import torch

    from ..core.modeling_eagle3 import Eagle3DraftModel
    from .trainer import evaluate

    if args.k < 1 or args.ttt_length < 1:
        raise SystemExit(f"--k ({args.k}) and --ttt-length ({args.ttt_length}) must be at least 1.")
    if args.shards == "holdout" and args.holdout_shards < 1:
        raise SystemExit("--shards holdout needs --holdout-shards >= 1; use --shards all to score every shard.")
    if args.json_out and not Path(args.json_out).parent.is_dir():
        raise SystemExit(f"--json-out {args.json_out}: its directory does not exist.")
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = Eagle3DraftModel.from_pretrained(args.draft, dtype=torch.float32)
    shards = "all" if args.shards == "all" else None
    try:
        metrics = evaluate(draft, args.features_dir, shards=shards, ttt_length=args.ttt_length,
                           batch_tokens=args.batch_tokens, max_prompt_context=args.max_prompt_context,
                           holdout_shards=args.holdout_shards, chain_length=args.k)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(str(err)) from None
    print_metrics(metrics, args.shards)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"draft": args.draft, "features_dir": args.features_dir,
                                                   "shards": args.shards, **metrics}, indent=2))


DTYPES = ["auto", "float32", "bfloat16", "float16"]


def register(subparsers) -> None:
    """Add the ``prepare``, ``train`` and ``evaluate`` subcommands to an argparse ``subparsers``.

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
    p.set_defaults(func=cmd_prepare)

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
                   "weights (default: holdout when --holdout-shards >= 1, else last)")
    t.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved draft (default bfloat16)")
    t.add_argument("--export-flat", action="store_true",
                   help="also write the flat layout (SGLang, EAGLE reference) to OUT/export-flat (default: off)")
    t.add_argument("--export-speculators", action="store_true",
                   help="also write the speculators layout (vLLM) to OUT/export-speculators (default: off)")
    t.set_defaults(func=cmd_train)

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
    e.set_defaults(func=cmd_evaluate)


def main(argv=None) -> None:
    """Run ``prepare`` / ``train`` / ``evaluate`` without the package-wide CLI.

    Args:
        argv: command-line arguments without the program name (default ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser("hf-eagle3-train")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
