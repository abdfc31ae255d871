"""``hf-eagle3 prepare``, ``train`` and ``evaluate``: data generation, draft training and scoring from the command
line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..loading import load_target, parse_dtype
from .hardware import resolve_dtype
from .parsers import DTYPES, register  # noqa: F401  (the parsers, light; kept importable from here)


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
    print("loading the target ...", file=sys.stderr, flush=True)
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
    from accelerate import PartialState

    from .trainer import end_distributed, train

    select_by = _check_train_options(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_records, records = _read_records(args)
    features_dir = Path(args.features_dir or out / "features")
    # Under `accelerate launch` / torchrun: the main process caches the features and builds the vocabulary, the
    # others wait and read them; training is data parallel; only the main process saves.
    state = PartialState(cpu=not torch.cuda.is_available())
    if not args.skip_features and state.is_main_process:
        _cache_features(args, records, features_dir)
    state.wait_for_everyone()
    if not (features_dir / "target_head.pt").exists():
        raise SystemExit(f"{features_dir} holds no features (no target_head.pt): drop --skip-features, or point "
                         "--features-dir at the directory `hf-eagle3 prepare --features-dir` wrote.")
    head = torch.load(features_dir / "target_head.pt", weights_only=False)
    torch.manual_seed(args.seed)  # before the draft is built: its new layers are drawn from torch's generator
    if args.init_draft:  # continue from a trained draft (its vocabulary mapping and layer ids win)
        draft = _continued_draft(args, features_dir, head, all_records)
    else:
        draft = _new_draft(args, state, out, features_dir, head, all_records)
    if state.is_main_process:
        print("training ...", file=sys.stderr, flush=True)
    t0 = time.time()
    draft = train(draft, features_dir, out / "run", _train_config(args, select_by))
    end_distributed()
    minutes = (time.time() - t0) / 60
    if not state.is_main_process:  # the main process holds the same weights and saves them
        return
    _save_trained(args, draft, out, features_dir, len(records), minutes)


def _check_train_options(args) -> str:
    """Refuse options that cannot work, before any record is read or feature computed: the ``--select-by`` that
    applies."""
    if not args.target_temperature > 0:
        raise SystemExit(f"--target-temperature {args.target_temperature}: give a temperature > 0 (1 = the target's "
                         "own distribution, the reference recipe; e.g. 0.5 sharpens it for greedy decoding).")
    if args.lk_weight is not None and args.loss != "mixed":
        raise SystemExit(f"--lk-weight {args.lk_weight:g} weighs the acceptance term of --loss mixed; this run has "
                         f"--loss {args.loss}: drop --lk-weight, or pass --loss mixed.")
    if args.feature_layers is not None and args.init_draft:
        raise SystemExit(f"--feature-layers {args.feature_layers} sets the layers of a new draft; --init-draft "
                         "continues a draft that reads its own: drop one of them.")
    select_by = args.select_by or ("holdout" if args.holdout_shards or args.holdout_features else "last")
    if args.accumulate < 1:
        raise SystemExit(f"--accumulate {args.accumulate}: give the batches per optimiser step, >= 1.")
    if select_by == "holdout" and args.holdout_shards < 1 and not args.holdout_features:
        raise SystemExit("--select-by holdout scores checkpoints on held-out shards: give --holdout-shards >= 1 or "
                         "--holdout-features DIR, or --select-by last.")
    if args.holdout_features and not (Path(args.holdout_features) / "target_head.pt").exists():
        raise SystemExit(f"--holdout-features {args.holdout_features} holds no features (no target_head.pt): point it "
                         "at a directory `hf-eagle3 prepare --features-dir` wrote.")
    if (args.stop_gain > 0) != (args.stop_window > 0) or args.stop_gain < 0 or args.stop_window < 0:
        raise SystemExit(f"--stop-gain {args.stop_gain:g} --stop-window {args.stop_window:g}: early stopping needs "
                         "both > 0 (e.g. --stop-gain 0.03 --stop-window 120), or neither.")
    if args.stop_gain and select_by != "holdout":
        raise SystemExit("--stop-gain compares held-out scores, which --select-by last does not compute: drop "
                         "--select-by last, and give --holdout-shards >= 1 or --holdout-features DIR.")
    return select_by


def _read_records(args) -> tuple[list, list]:
    """Every record of ``--data`` (the vocabulary counts them all) and those the feature pass takes
    (``--max-records``)."""
    from .prepare import iter_records

    all_records = list(iter_records(args.data))
    records = all_records[: args.max_records] if args.max_records else all_records
    print(f"{len(records)} records from {args.data}" + (f" (of {len(all_records)}; the draft vocabulary counts them all)"
                                                       if len(records) < len(all_records) else ""))
    return all_records, records


def _cache_features(args, records: list, features_dir: Path) -> None:
    """The feature pass: load the target and cache its features of ``records`` in ``features_dir`` (resumable)."""
    from ..core.configuration_eagle3 import FEATURE_LAYERS, default_feature_layer_ids
    from ..core.feature_capture import find_decoder_layers
    from .features import cache_features

    device = args.device or default_device()
    dtype, line = resolve_dtype(args.feature_dtype, device, label="feature dtype")
    print(line)
    print("loading the target for the feature pass ...", file=sys.stderr, flush=True)
    target, _ = load_target(args.target, dtype, device=device, tokenizer="none")
    layer_ids = default_feature_layer_ids(len(find_decoder_layers(target)), args.feature_layers or FEATURE_LAYERS)
    cache_features(target, records, features_dir, layer_ids, per_shard=args.per_shard, batch_size=args.feature_batch,
                   max_prompt_tokens=args.max_prompt_context, complete_shards_only=args.complete_shards_only)


def _continued_draft(args, features_dir: Path, head: dict, all_records: list):
    """``--init-draft``: the trained draft to continue, checked against the features; with ``--rebuild-vocab`` its
    vocabulary rebuilt from the responses of ``--data`` and ``--vocab-data``."""
    import torch

    from ..core.modeling_eagle3 import Eagle3DraftModel
    from .prepare import iter_records
    from .trainer import check_draft_matches_features
    from .vocab import count_tokens, rebuild_draft_vocab

    draft = Eagle3DraftModel.from_pretrained(args.init_draft, dtype=torch.float32)
    check_draft_matches_features(draft, features_dir, head)  # before anything is written
    if args.rebuild_vocab:
        counts = count_tokens(r["response_ids"] for r in all_records)
        for extra in args.vocab_data or []:
            counts.update(count_tokens(r["response_ids"] for r in iter_records(extra)))
        print(rebuild_draft_vocab(draft, counts, args.draft_vocab_size, head["config"]["vocab_size"], head["lm_head"]))
    return draft


def _new_draft(args, state, out: Path, features_dir: Path, head: dict, all_records: list):
    """A new draft for the features' target and layers, its vocabulary the most frequent response tokens (built by
    the main process into ``OUT/vocab.pt`` once, read by every process)."""
    import torch

    from .trainer import draft_config_for_target, init_draft
    from .vocab import build_vocab_mapping, count_tokens, coverage

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
    if layer_ids and args.feature_layers is not None and len(layer_ids) != args.feature_layers:
        raise SystemExit(f"--feature-layers {args.feature_layers}: the features in {features_dir} were captured at "
                         f"{len(layer_ids)} layers ({layer_ids}). Give another --features-dir (or --out) for new "
                         "features, or drop --feature-layers.")
    overrides = {"feature_layer_ids": list(layer_ids)} if layer_ids else {}  # the layers the features come from
    return init_draft(draft_config_for_target(head["config"], args.draft_vocab_size, **overrides), head, d2t, t2d)


def _train_config(args, select_by: str):
    """The :class:`~hf_eagle3.training.trainer.TrainConfig` of the ``train`` options."""
    from .trainer import TrainConfig

    return TrainConfig(
        ttt_length=args.ttt_length, lr=args.lr, epochs=args.epochs, batch_tokens=args.batch_tokens,
        warmup_steps=args.warmup_steps, max_prompt_context=args.max_prompt_context,
        prompt_loss_weight=args.prompt_loss_weight, target_temperature=args.target_temperature,
        loss=args.loss, lk_weight=1.0 if args.lk_weight is None else args.lk_weight, freeze_head=args.freeze_head,
        mixed_precision=args.mixed_precision, save_every=args.save_every, max_steps=args.max_steps,
        max_minutes=args.max_minutes, holdout_shards=args.holdout_shards, seed=args.seed,
        holdout_features=args.holdout_features, stop_gain=args.stop_gain, stop_window=args.stop_window,
        select_by=select_by, accumulate=args.accumulate, fsdp=args.fsdp,
    )


def _save_trained(args, draft, out: Path, features_dir: Path, num_records: int, minutes: float) -> None:
    """Score the trained draft on the held-out set (``--holdout-features``, else the held-out shards), save it with
    its training summary, and export it as asked."""
    metrics = {}
    if args.holdout_shards or args.holdout_features:
        from .trainer import evaluate

        print("scoring the draft on the held-out shards ...", file=sys.stderr, flush=True)
        if args.holdout_features:
            metrics = evaluate(draft, args.holdout_features, shards="all", ttt_length=args.ttt_length,
                               max_prompt_context=args.max_prompt_context)
        else:
            metrics = evaluate(draft, features_dir, ttt_length=args.ttt_length, holdout_shards=args.holdout_shards,
                               max_prompt_context=args.max_prompt_context)
    save_dir = Path(args.save_dir or out / "draft")
    dtype = parse_dtype(args.save_dtype)
    draft.to(dtype).save_pretrained(save_dir)
    (save_dir / "training_summary.json").write_text(json.dumps({
        "records": num_records, "train_minutes_this_run": minutes, "holdout": metrics,
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
