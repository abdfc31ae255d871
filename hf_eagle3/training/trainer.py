"""Training of EAGLE-3 drafts on cached target features: the loop (:func:`train`), its settings and evaluation.

The objective (the training-time test) is :mod:`hf_eagle3.training.ttt`; the cached features and their batches are
:mod:`hf_eagle3.training.features`. The same code runs on one CPU and on one or many GPUs through ``accelerate``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.configuration_eagle3 import Eagle3Config, default_feature_layer_ids
from ..core.modeling_eagle3 import Eagle3DraftModel
from .features import FeatureShards, collate
from .hardware import resolve_dtype
from .parallel import DataParallel
from .replay import replay_chain_acceptance
from .ttt import LOSS_KINDS, TTTObjective, ttt_loss


@dataclass
class TrainConfig:
    """Settings of :func:`train` (defaults follow the reference recipe, REFERENCE §4).

    Args:
        ttt_length: unrolled draft steps per position.
        lr: peak learning rate (AdamW, betas ``betas``). 1e-3, ten times the published recipes' 1e-4 (which train
            hundreds of thousands of answers): at equal steps on a held-out split (docs/training.md, "Compared with
            speculators' trainer") it accepts more than 3e-4 and 1e-4 do; held-out selection keeps the best checkpoint.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``.
        epochs: passes over the training shards.
        batch_tokens: padded tokens per batch.
        grad_clip: gradient-norm clip.
        max_prompt_context: prompt tokens kept before each response.
        prompt_loss_weight: weight of prompt positions in the loss (0 = the reference recipe: responses only).
        target_temperature: temperature of the soft labels (1 = the reference recipe; below 1 sharpens them towards
            the target's argmax, see :func:`~hf_eagle3.training.ttt.ttt_loss`).
        loss: the objective: ``"ce"`` (soft cross-entropy, the reference recipe), ``"lk"`` (the acceptance term
            ``1 - sum_x min(p(x), q(x))`` alone) or ``"mixed"`` (cross-entropy + ``lk_weight`` x that term); see
            :func:`~hf_eagle3.training.ttt.acceptance_loss`.
        lk_weight: weight of the acceptance term with ``loss="mixed"``. 1 by default: the two terms' gradients with
            respect to the draft's logits are of one size (each at most 1 per logit in absolute value), and LK-lambda
            (arXiv 2602.23881) weighs TV against KL by ``(1 - lambda) / lambda``, from about 0.8 at an overlap of 0.2 to
            about 3.5 at 0.5: 1 sits at the cautious end of that range. No ablation here has tuned it.
        freeze_head: keep the draft's ``lm_head`` as it starts (the target's own rows of the draft vocabulary, or
            those of ``--init-draft``), untrained: with a draft vocabulary as large as the target's, the draft
            predicts through the target's own head (a frozen full-vocabulary head, as DeepSpec's EAGLE-3 recipe
            does), and its trainable weights are the layer and ``fc`` alone.
        mixed_precision: ``"auto"`` (bf16 where the hardware computes it, else no autocast), ``"bf16"``,
            ``"fp16"`` or ``"no"`` (accelerate autocast).
        save_every: checkpoint every this many optimiser steps.
        log_every: log every this many steps.
        accumulate: batches per process per optimiser step (gradient accumulation): with N processes one optimiser
            step takes ``N * accumulate`` batches, so one process with ``accumulate=N`` follows the same curve.
        fsdp: with several processes, shard the draft's weights, gradients and optimiser state over them (FSDP)
            instead of replicating them (DDP); see :mod:`~hf_eagle3.training.parallel`.
        holdout_shards: shards kept out of training for evaluation (the first ones).
        holdout_features: a features directory (of the same target and layers) whose every shard is the held-out set
            that checkpoints are scored on, instead of the first ``holdout_shards`` of the training features: for a
            draft that continues from trained weights, answers to prompts it never trained on (its own training
            data's shards are not held out from it). ``holdout_shards`` still leaves those training shards out.
        select_by: which weights :func:`train` returns: ``"holdout"`` (the checkpoint whose replayed greedy chain
            acceptance on the held-out set is highest, scored at every checkpoint; the default) or ``"last"``.
        stop_gain, stop_window: early stopping (both > 0, or both 0 for none; needs ``select_by="holdout"``): the run
            ends at the first checkpoint whose best held-out score so far exceeds the best score of the checkpoints
            at least ``stop_window`` training minutes older by less than ``stop_gain`` (acceptance length). The
            weights at the start are scored too (step 0), so the first comparison is against them. Drafts over-train:
            held-out acceptance peaks and falls while the training loss still falls.
        select_chain_length: draft tokens per round of that replayed chain.
        max_steps: stop after this many steps (0 = no limit).
        max_minutes: stop (with a checkpoint) after this many minutes of training (0 = no limit).
        seed: random seed.
    """

    ttt_length: int = 7
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    epochs: int = 1
    batch_tokens: int = 4096
    grad_clip: float = 0.5
    max_prompt_context: int = 256
    prompt_loss_weight: float = 0.0
    target_temperature: float = 1.0
    loss: str = "ce"
    lk_weight: float = 1.0
    freeze_head: bool = False
    mixed_precision: str = "auto"
    save_every: int = 100
    log_every: int = 10
    accumulate: int = 1
    fsdp: bool = False
    holdout_shards: int = 1
    holdout_features: str | None = None
    select_by: str = "holdout"
    stop_gain: float = 0.0
    stop_window: float = 0.0
    select_chain_length: int = 5
    max_steps: int = 0
    max_minutes: float = 0.0
    seed: int = 0
    extra: dict = field(default_factory=dict)


def draft_config_for_target(head_config: dict, draft_vocab_size: int, **overrides) -> Eagle3Config:
    """An :class:`Eagle3Config` shaped like one layer of the target described by ``head_config``."""
    n = head_config["num_hidden_layers"]
    kwargs = dict(
        vocab_size=head_config["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        hidden_size=head_config["hidden_size"],
        intermediate_size=head_config["intermediate_size"],
        num_attention_heads=head_config["num_attention_heads"],
        num_key_value_heads=head_config["num_key_value_heads"],
        head_dim=head_config["head_dim"],
        rms_norm_eps=head_config["rms_norm_eps"],
        max_position_embeddings=head_config["max_position_embeddings"],
        target_hidden_size=head_config["hidden_size"],
        feature_layer_ids=default_feature_layer_ids(n),
        target_model_type=head_config.get("model_type"),
        target_name_or_path=head_config.get("name_or_path"),
    )
    kwargs.update(overrides)
    return Eagle3Config(**kwargs)


def init_draft(config: Eagle3Config, head: dict, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3DraftModel:
    """A new draft for training: random layer, ``lm_head`` initialised from the target's rows of the draft
    vocabulary, ``fc`` initialised to pass the highest captured feature through, vocabulary mapping set. Its saved
    draft-length setting is ``num_assistant_tokens_schedule="auto"`` (see docs/cost_model.md). The layer is drawn
    from torch's generator: seed it first (``torch.manual_seed``, as ``hf-eagle3 train --seed`` does) for the same
    draft every run.

    Args:
        config: the draft's configuration (:func:`draft_config_for_target`).
        head: the target head of the features (``target_head.pt``: ``lm_head`` rows are copied from it).
        d2t: draft-to-target vocabulary offsets.
        t2d: target-to-draft membership mask.
    """
    draft = Eagle3DraftModel(config)
    draft.generation_config.num_assistant_tokens_schedule = "auto"
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        used = torch.arange(config.draft_vocab_size) + d2t
        draft.lm_head.weight.copy_(head["lm_head"][used])
        t, h = config.target_hidden_size, config.hidden_size
        if t == h:
            draft.fc.weight.zero_()
            draft.fc.weight[:, (config.num_feature_layers - 1) * t :] = torch.eye(h)
    return draft


def _lr_factor(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up over ``cfg.warmup_steps``, then cosine decay to ``cfg.min_lr_ratio`` as ``progress`` -> 1."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(0.0, progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_warning(steps_per_epoch: int, cfg: TrainConfig) -> str | None:
    """A warning naming what to change when the data is too small for the schedule, else ``None``.

    Too small: at most one optimiser step per epoch, or fewer steps in all (epochs, capped by ``max_steps``) than
    warm-up steps (the learning rate would never reach its peak).

    Args:
        steps_per_epoch: optimiser steps of one epoch over the data there is.
        cfg: the schedule.
    """
    planned = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        planned = min(planned, cfg.max_steps)
    problems = []
    if steps_per_epoch <= 1:
        problems.append(f"{steps_per_epoch} optimiser step(s) per epoch")
    if planned < cfg.warmup_steps:
        problems.append(f"{planned} step(s) in all ({cfg.epochs} epoch(s)), fewer than the {cfg.warmup_steps} "
                        "warm-up steps: the learning rate never reaches its peak")
    if not problems:
        return None
    budget = " (--max-minutes does not add epochs: training ends at the last one)" if cfg.max_minutes else ""
    return (f"warning: the data is small for this schedule: {'; '.join(problems)}. Add data, lower --batch-tokens "
            f"(now {cfg.batch_tokens}), raise --epochs (now {cfg.epochs}){budget} or lower --warmup-steps "
            f"(now {cfg.warmup_steps}).")


def check_draft_matches_features(draft: Eagle3DraftModel, features_dir, head: dict | None = None) -> dict:
    """Raise a ``ValueError`` naming the fix when ``draft`` cannot be trained on the features in ``features_dir``;
    return the target head (``target_head.pt``) otherwise.

    A draft trained on features of other layers than its ``feature_layer_ids`` would train without error and then
    read the wrong layers at inference, so the layer ids are checked as well as the sizes.

    Args:
        draft: the draft to train.
        features_dir: directory from :func:`~hf_eagle3.training.features.cache_features` or
            ``prepare(..., features_dir=)`` (``target_head.pt``, ``meta.json``).
        head: ``target_head.pt`` already loaded (read from ``features_dir`` when not given).
    """
    root = Path(features_dir)
    if not (root / "target_head.pt").exists():
        raise FileNotFoundError(f"{root} has no target_head.pt: write the features with `hf-eagle3 prepare "
                                "--features-dir` or cache_features first.")
    head = head if head is not None else torch.load(root / "target_head.pt", weights_only=False)
    tc, c = head["config"], draft.config
    problems = []
    if tc["vocab_size"] != c.vocab_size:
        problems.append(f"target vocabulary {tc['vocab_size']} != draft vocab_size {c.vocab_size}")
    if tc["hidden_size"] != c.target_hidden_size:
        problems.append(f"target hidden size {tc['hidden_size']} != draft target_hidden_size {c.target_hidden_size}")
    meta = root / "meta.json"
    if meta.exists():
        feature_ids = json.loads(meta.read_text()).get("layer_ids")
        draft_ids = c.feature_layer_ids or default_feature_layer_ids(tc["num_hidden_layers"])
        if feature_ids is not None and list(feature_ids) != list(draft_ids):
            problems.append(f"features captured at target layers {list(feature_ids)} but the draft reads layers "
                            f"{list(draft_ids)} (feature_layer_ids)")
    if problems:
        raise ValueError(
            f"The draft does not match the features in {root} ({tc.get('name_or_path') or tc.get('model_type')}): "
            + "; ".join(problems) + ". Train a new draft for this target (omit --init-draft), set the draft's "
            "feature_layer_ids to the features' layer ids, or write features for the draft's target and layers."
        )
    return head


def train(draft: Eagle3DraftModel, features_dir, out_dir, cfg: TrainConfig | None = None, log=print):
    """Train ``draft`` on the feature shards in ``features_dir``; checkpoints (and resume) in ``out_dir``.

    The target's embedding (frozen) comes from ``features_dir/target_head.pt``. A rerun with the same
    ``out_dir`` resumes from ``out_dir/checkpoint.pt`` (model, optimiser, schedule and data position).

    A rerun on a finished run (its checkpoint is at the end that ``cfg`` sets: ``epochs``, ``max_steps`` or
    ``max_minutes``) trains nothing: it says so, naming the setting to raise, and returns the run's weights. A resumed
    run's ``log.jsonl`` holds each step once (the records past the checkpoint are dropped and written again).

    Launched on several processes (``accelerate launch --num_processes N``, ``torchrun``), every process reads the
    same shuffled batch order and takes one batch of each round of N (data parallel: one optimiser step = N batches),
    the main process's clock drives the schedule and the time budget everywhere, and only the main process writes
    checkpoints and the log. Resume with the same number of processes.

    Args:
        draft: a draft from :func:`init_draft` (or loaded).
        features_dir: directory from :func:`cache_features`.
        out_dir: checkpoints, ``log.jsonl`` and the final ``save_pretrained`` output (``out_dir/final``).
        cfg: :class:`TrainConfig`.
        log: where to print progress lines.

    Returns:
        The trained draft (unwrapped, on CPU).
    """
    cfg = cfg or TrainConfig()
    _check_config(cfg)
    head = check_draft_matches_features(draft, features_dir)  # before anything is written
    data = FeatureShards(features_dir, cfg.batch_tokens, cfg.max_prompt_context, cfg.holdout_shards, cfg.seed)
    heldout = held_out_set(draft, data, head, cfg)
    if not data.shards:
        raise ValueError(f"all {len(data.holdout)} feature shard(s) in {features_dir} are held out (holdout_shards="
                         f"{cfg.holdout_shards}): nothing is left to train on. Lower --holdout-shards or write more "
                         "features.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    run = _TrainingRun(draft, data, out, cfg, head, log, heldout)
    run.resume()
    run.start()
    run.train_epochs()
    run.say_why_it_ended()
    return run.final_draft()


def held_out_set(draft: Eagle3DraftModel, data: FeatureShards, head: dict, cfg: TrainConfig) -> tuple:
    """The set checkpoints are scored on: ``(shards' reader, shard paths)``, from ``cfg.holdout_features`` (checked
    against the draft and against the training features' target) or else the training features' held-out shards.

    Args:
        draft: the draft to train.
        data: the training features.
        head: the training features' ``target_head.pt``.
        cfg: the settings.
    """
    if not cfg.holdout_features:
        return data, data.holdout
    other = check_draft_matches_features(draft, cfg.holdout_features)
    if other["config"] != head["config"] or not torch.equal(other["embed_tokens"], head["embed_tokens"]):
        raise ValueError(f"{cfg.holdout_features} holds features of another target than {data.root} (its config or "
                         "embedding differs): write the held-out features with the training features' target.")
    heldout = FeatureShards(cfg.holdout_features, cfg.batch_tokens, cfg.max_prompt_context)
    return heldout, heldout.shards


def _check_config(cfg: TrainConfig) -> None:
    """Refuse settings :func:`train` cannot honour."""
    if cfg.select_by not in ("holdout", "last"):
        raise ValueError(f"select_by={cfg.select_by!r}: use 'holdout' (the best checkpoint on the held-out shards) "
                         "or 'last'.")
    if cfg.select_by == "holdout" and ((cfg.holdout_shards < 1 and not cfg.holdout_features)
                                       or cfg.select_chain_length < 1):
        raise ValueError(f"select_by='holdout' scores checkpoints on held-out shards with a replayed chain: it needs "
                         f"holdout_shards >= 1 (now {cfg.holdout_shards}) or holdout_features, and "
                         f"select_chain_length >= 1 (now {cfg.select_chain_length}); or pass select_by='last' "
                         "(--select-by last).")
    if (cfg.stop_gain > 0) != (cfg.stop_window > 0) or cfg.stop_gain < 0 or cfg.stop_window < 0:
        raise ValueError(f"stop_gain={cfg.stop_gain:g}, stop_window={cfg.stop_window:g}: early stopping needs both > 0 "
                         "(--stop-gain 0.03 --stop-window 120: stop when 120 minutes of training add less than 0.03 "
                         "held-out acceptance length), or both 0 for none.")
    if cfg.stop_gain and cfg.select_by != "holdout":
        raise ValueError("stop_gain / stop_window compare held-out scores, which select_by='last' does not compute: "
                         "pass select_by='holdout' (--select-by holdout) with held-out shards or holdout_features.")
    if cfg.loss not in LOSS_KINDS:
        raise ValueError(f"loss={cfg.loss!r}: use one of {', '.join(LOSS_KINDS)} (ce = soft cross-entropy, the "
                         "reference; lk = the acceptance term 1 - sum min(p, q); mixed = ce + lk_weight x lk).")
    if cfg.loss == "mixed" and not (0 < cfg.lk_weight < float("inf")):
        raise ValueError(f"lk_weight={cfg.lk_weight}: give a finite weight > 0 for loss='mixed' (loss='ce' trains "
                         "without the acceptance term).")
    if not (isinstance(cfg.accumulate, int) and cfg.accumulate >= 1):
        raise ValueError(f"accumulate={cfg.accumulate}: give the number of batches per optimiser step, >= 1.")


class _TrainingRun:
    """One call of :func:`train`, phase by phase: set up (accelerate, the frozen target head, the optimiser and its
    schedule), :meth:`resume`, :meth:`start`, :meth:`train_epochs`, :meth:`say_why_it_ended`, :meth:`final_draft`.

    Args:
        draft: the draft to train.
        data: the feature shards.
        out: the run directory (checkpoints, ``log.jsonl``).
        cfg: the settings.
        head: the target's head (``target_head.pt``: its embedding and ``lm_head``).
        log: where progress lines go.
        heldout: the held-out set, ``(shards' reader, shard paths)`` (:func:`held_out_set`).
    """

    def __init__(self, draft: Eagle3DraftModel, data: FeatureShards, out: Path, cfg: TrainConfig, head: dict, log,
                 heldout: tuple):
        from accelerate import Accelerator

        self.draft, self.data, self.out, self.cfg, self.log, self.heldout = draft, data, out, cfg, log, heldout
        mixed_precision, precision_line = resolve_dtype(
            cfg.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu", label="mixed precision", bf16="bf16",
            fallback="no")
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
        self.embed = torch.nn.Embedding.from_pretrained(head["embed_tokens"], freeze=True)
        used = torch.arange(draft.config.draft_vocab_size) + draft.d2t.cpu()
        self.lm_rows = head["lm_head"][used]
        self.t2d = draft.t2d.cpu().bool()
        acc = self.accelerator
        self.world, self.rank, self.main = acc.num_processes, acc.process_index, acc.is_main_process
        self.per_step = self.world * cfg.accumulate  # batches per optimiser step, over all processes
        self.per_epoch = data.num_batches() // self.per_step  # optimiser steps per epoch, on the data there is now
        # with a time budget the schedule follows the clock (and data may still grow): no step total
        self.total_steps = 0 if cfg.max_minutes else self.per_epoch * cfg.epochs
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps) if self.total_steps else cfg.max_steps
        if self.main:
            self._log_setup(precision_line)
        if hasattr(draft, "embed_tokens"):  # the draft reads the target's (frozen) embedding during training
            draft.embed_tokens.requires_grad_(False)
        draft.lm_head.requires_grad_(not cfg.freeze_head)
        draft.train()
        objective = TTTObjective(draft, cfg.ttt_length, cfg.target_temperature, cfg.loss, cfg.lk_weight)
        self.parallel = DataParallel(acc, objective,
                                     lambda params: torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas),
                                                                      weight_decay=cfg.weight_decay),
                                     fsdp=cfg.fsdp)
        self.clock = {"start": time.time(), "offset": 0.0, "now": 0.0}
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.parallel.optimizer,
                                                       lambda s: _lr_factor(s, self.progress(s), cfg))
        self.step, self.start_epoch, self.skip = 0, 0, 0
        self.finished = None  # (why, the option that continues) when the checkpoint is a run's end
        self.stalled = None  # why early stopping ends the run, once it does
        self.ckpt = out / "checkpoint.pt"
        self.ended = None
        self.logf = None

    def _log_setup(self, precision_line: str) -> None:
        """The main process's opening lines: the precision, and warnings about the setup."""
        self.log(precision_line)
        self.log(f"loss: {_loss_line(self.cfg)}")
        if self.cfg.freeze_head:
            self.log("head: frozen (lm_head keeps the rows it starts with; the layer and fc are trained)")
        if self.cfg.fsdp and self.world == 1:
            self.log("--fsdp with one process: nothing to shard, training as usual (launch several processes with "
                     "torchrun --nproc-per-node N to shard)")
        warning = schedule_warning(self.per_epoch, self.cfg)
        if warning:
            self.log(warning)

    def elapsed(self) -> float:
        """Training seconds so far; with several processes, the main process's clock (one collective), so that
        every process uses the same learning rate and stops at the same step."""
        from accelerate.utils import broadcast

        t = self.clock["offset"] + time.time() - self.clock["start"]
        if self.world > 1:
            t = float(broadcast(torch.tensor([t], dtype=torch.float64, device=self.accelerator.device))[0])
        return t

    def progress(self, s: int) -> float:
        """How far the schedule is at step ``s``: with a time budget it follows the clock, so that it ends decayed
        whatever the speed."""
        if self.cfg.max_minutes:
            return self.clock["now"] / (self.cfg.max_minutes * 60)
        return (s - self.cfg.warmup_steps) / max(1, self.total_steps - self.cfg.warmup_steps)

    def _objective(self) -> dict:
        """The loss a checkpoint was trained with (stored with it, so that a resume with another one says so)."""
        return {"loss": self.cfg.loss, "lk_weight": self.cfg.lk_weight if self.cfg.loss == "mixed" else None}

    def _layout(self) -> dict:
        """What a checkpoint must match to be resumed: processes, accumulation and sharding."""
        return {"processes": self.world, "accumulate": self.cfg.accumulate, "fsdp": self.parallel.sharded,
                "freeze_head": self.cfg.freeze_head}

    def resume(self) -> None:
        """Continue from the run directory's checkpoint, if there is one (a finished run trains nothing)."""
        if not self.ckpt.exists():
            return
        state = torch.load(self.ckpt, weights_only=False)
        layout = self._layout()
        saved = state.get("layout", {"processes": self.world, "accumulate": 1, "fsdp": False})
        saved = {**saved, "freeze_head": saved.get("freeze_head", False)}  # checkpoints older than --freeze-head
        if saved != layout:  # the optimiser's state holds what was trained: the head's too, or not
            raise ValueError(f"{self.ckpt} was written by a run with {saved}; this one has {layout}. Resume with the "
                             "same number of processes, --accumulate, --fsdp and --freeze-head, or start in a new "
                             "--out.")
        self.parallel.load(state["model"], state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.start_epoch, self.skip = state["step"], state["epoch"], state["batches_done"]
        self.clock["offset"] = self.clock["now"] = state.get("elapsed", 0.0)
        stopped = None
        if self.cfg.stop_gain:  # early stopping's verdict on the scores logged up to the checkpoint
            history = [(m, score) for step, m, score in _logged_scores(self.out / "log.jsonl") if step <= self.step]
            stopped = stall_reason(history, self.clock["now"] / 60, self.cfg.stop_gain, self.cfg.stop_window)
        self.finished = _finished(self.step, self.start_epoch, self.clock["now"], self.cfg, stopped)
        before = state.get("objective", {"loss": "ce", "lk_weight": None})  # checkpoints older than --loss: ce
        if self.main and not self.finished and before != self._objective():
            # like --lr or --target-temperature, the loss may change on a resume (e.g. ce, then lk from its weights);
            # say so, since the logged loss changes meaning at this step
            self.log(f"the checkpoint (step {self.step}) was trained with {_loss_line(before)}; training continues "
                     f"with {_loss_line(self.cfg)}: the logged loss changes meaning from step {self.step + 1}")
        if self.main and self.finished:
            self.log(f"{self.out} holds a finished run ({self.finished[0]}, step {self.step}): nothing is trained, its "
                     f"weights are returned as they are. To train further raise {self.finished[1]}, or start in a new "
                     "--out.")
        elif self.main:
            self.log(f"resumed from {self.ckpt} at step {self.step} (epoch {self.start_epoch}, batch {self.skip})")

    def start(self) -> None:
        """Put the frozen embedding in place, record the settings, and start the clock and the selection."""
        self.embed = self.embed.to(self.accelerator.device)
        self.parallel.draft._target_embedding = (self.embed,)
        if self.main and not self.finished:
            (self.out / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=2, default=str))
            _drop_logged_steps_after(self.out / "log.jsonl", self.step)  # the steps after the checkpoint run again
        self.t0 = self.clock["start"] = time.time()
        self.tokens_seen = 0
        self.selection = (_Selection(self.out, self.heldout, self.cfg, self.draft, self.embed)
                          if self.cfg.select_by == "holdout" and self.main else None)

    def _write_log(self, record: dict) -> None:
        """Append ``record`` to ``log.jsonl`` (the main process's open file)."""
        self.logf.write(json.dumps(record) + "\n")
        self.logf.flush()

    def save(self, epoch: int, batches_done: int) -> None:
        """Checkpoint (the main process writes; every process takes part in the collectives), then score it for the
        selection and early stopping."""
        model_state, optimizer_state = self.parallel.model_state(), self.parallel.optimizer_state()  # FSDP collectives
        if self.main:  # one writer; every process holds the same weights
            tmp = self.out / "checkpoint.tmp"
            torch.save(
                {
                    "model": model_state,
                    "optimizer": optimizer_state,
                    "layout": self._layout(),
                    "objective": self._objective(),
                    "scheduler": self.sched.state_dict(),
                    "step": self.step,
                    "epoch": epoch,
                    "batches_done": batches_done,
                    "elapsed": self.clock["now"],
                },
                tmp,
            )
            tmp.replace(self.ckpt)
            self._score(model_state)
        if self.cfg.stop_gain and self.world > 1:  # every process ends at the same step
            from accelerate.utils import broadcast_object_list

            self.stalled = broadcast_object_list([self.stalled])[0]
        self.accelerator.wait_for_everyone()

    def _score(self, weights: dict) -> None:
        """The main process's held-out score of ``weights`` at this step (logged with the training minutes), and
        the early-stopping verdict."""
        if self.selection is None:
            return
        minutes = self.clock["now"] / 60
        score = self.selection.score(weights, self.step, minutes)
        if score is not None:
            self._write_log({"step": self.step, "holdout_acceptance_length": round(score, 4),
                             "training_minutes": round(minutes, 3)})
        if self.cfg.stop_gain and self.stalled is None:
            self.stalled = stall_reason(self.selection.history, minutes, self.cfg.stop_gain, self.cfg.stop_window)

    def rounds(self, epoch: int):
        """This process's batches of each optimiser step: a round of ``world * accumulate`` consecutive batches
        gives process r batches r, r + world, ...; an incomplete last round is left out (every process must take
        the same number of optimiser steps)."""
        pending = []
        for bi, (_, _, items) in enumerate(self.data.batches(epoch)):
            pending.append(items)
            if len(pending) == self.per_step:
                yield bi + 1, pending[self.rank::self.world]
                pending = []

    def train_epochs(self) -> None:
        """The training loop: an optimiser step per round, a log line every ``log_every`` steps, a checkpoint every
        ``save_every`` steps, at each epoch's end and where training ends."""
        with open(self.out / "log.jsonl", "a") if self.main else contextlib.nullcontext() as self.logf:
            if self.cfg.stop_gain and self.step == 0 and not self.finished:  # the start, early stopping's first mark
                weights = self.parallel.model_state()  # a collective under FSDP
                if self.main:
                    self._score(weights)
            for epoch in range(self.start_epoch, self.cfg.epochs if not self.finished else self.start_epoch):
                for batches_done, micro in self.rounds(epoch):
                    if epoch == self.start_epoch and batches_done <= self.skip:
                        continue
                    loss, accs = self.optimiser_step(micro)
                    if self.step % self.cfg.log_every == 0 or self.step == 1:
                        self.log_step(epoch, loss, accs)
                    if self.step % self.cfg.save_every == 0:
                        self.save(epoch, batches_done)
                    self.ended = self._end_reason(epoch)
                    if self.ended:
                        self.save(epoch, batches_done)
                        break
                if self.ended:
                    break
                self.skip = 0
                self.save(epoch + 1, 0)
                if self.stalled:
                    self.ended = self.stalled
                    break

    def optimiser_step(self, micro: list) -> tuple[torch.Tensor, list]:
        """One optimiser step over this process's batches ``micro`` (gradients accumulated): the mean loss and, per
        batch, its per-step accuracies and overlaps (``[acc, overlap]``)."""
        losses, accs = [], []
        device = self.accelerator.device
        for j, items in enumerate(micro):
            batch = collate(items, self.t2d, self.lm_rows, self.cfg.prompt_loss_weight)
            batch = {k: v.to(device) for k, v in batch.items()}
            with self.parallel.no_sync(skip=j < len(micro) - 1):
                with self.accelerator.autocast():
                    loss, stats = self.parallel.model(batch["features"], batch["input_ids"], batch["target_logits"],
                                                      batch["loss_mask"])
                self.accelerator.backward(loss / len(micro))
            losses.append(loss.detach().float())
            accs.append([stats["acc"], stats["overlap"]])
            self.tokens_seen += int(batch["loss_mask"].sum())
        loss = torch.stack(losses).mean()
        self.parallel.clip_grad_norm_(self.cfg.grad_clip)
        self.clock["now"] = self.elapsed()
        opt = self.parallel.step_optimizer
        opt.step()
        self.sched.step()
        opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss, accs

    def log_step(self, epoch: int, loss: torch.Tensor, accs: list) -> None:
        """Log the step (every process takes part in the reductions; the main process writes)."""
        tokens = self.tokens_seen
        acc = torch.tensor(accs, dtype=torch.float64).mean(0)  # [acc, overlap] x steps, one reduction
        accelerator = self.accelerator
        if self.world > 1:  # every process logs at the same steps: a collective is safe here
            tokens = int(accelerator.reduce(torch.tensor(self.tokens_seen, device=accelerator.device), "sum"))
            loss = accelerator.reduce(loss, "mean")  # the step's loss over every process's batches
            acc = accelerator.reduce(acc.to(accelerator.device), "mean").cpu()
        rec = {
            "step": self.step,
            "epoch": epoch,
            "loss": float(loss),
            "acc": [round(float(a), 4) for a in acc[0]],
            "overlap": [round(float(a), 4) for a in acc[1]],
            "loss_kind": self.cfg.loss,
            "lr": self.sched.get_last_lr()[0],
            "tokens": tokens,
            "minutes": round((time.time() - self.t0) / 60, 2),
        }
        if self.main:
            self._write_log(rec)
            self.log(f"step {self.step}/{self.total_steps or '?'} loss {rec['loss']:.4f} acc {rec['acc']} "
                     f"lr {rec['lr']:.2e} {rec['minutes']:.1f} min")

    def _end_reason(self, epoch: int) -> str | None:
        """Why training ends after this step (early stopping, ``--max-steps``, ``--max-minutes``), else ``None``."""
        cfg = self.cfg
        if self.stalled:
            return self.stalled
        if cfg.max_steps and self.step >= cfg.max_steps:
            return f"max steps reached (--max-steps {cfg.max_steps}, in epoch {epoch + 1} of {cfg.epochs})"
        if cfg.max_minutes and self.clock["now"] > cfg.max_minutes * 60:
            return (f"time budget reached (--max-minutes {cfg.max_minutes:g}, {self.step} step(s), in epoch "
                    f"{epoch + 1} of {cfg.epochs})")
        return None

    def say_why_it_ended(self) -> None:
        """Log what ended training (the main process, when it trained)."""
        if not self.main or self.finished:
            return
        if self.ended is None:
            self.ended = f"epochs done ({self.cfg.epochs} epoch(s), {self.step} step(s))"
            if self.cfg.max_minutes:
                self.ended += (f", {self.clock['now'] / 60:.1f} of the {self.cfg.max_minutes:g} minutes of "
                               "--max-minutes used: raise --epochs to train longer")
        self.log(f"training ended: {self.ended}")

    def final_draft(self) -> Eagle3DraftModel:
        """The draft to return: the selected weights (or the last ones) in a plain module, on CPU, in eval mode."""
        self.accelerator.wait_for_everyone()  # no process leaves (and tears down) while another is in a collective
        weights = self.parallel.model_state()  # the last weights, on every process (a collective under FSDP)
        log_path = self.out / "log.jsonl"
        if self.finished and self.selection is not None and self.step not in _scored_steps(log_path):
            minutes = self.clock["now"] / 60  # a kill between the last checkpoint and its score
            score = self.selection.score(weights, self.step, minutes)
            if score is not None:
                with open(log_path, "a") as logf:
                    logf.write(json.dumps({"step": self.step, "holdout_acceptance_length": round(score, 4),
                                           "training_minutes": round(minutes, 3)}) + "\n")
        weights, replaced = self._selected_weights(weights)
        draft, parallel = self.draft, self.parallel
        final = type(draft)(draft.config) if parallel.sharded else parallel.draft  # a plain module, not a sharded one
        final.generation_config = draft.generation_config
        if parallel.sharded or replaced:  # else the module holds them already
            final.load_state_dict({k: v.detach().cpu() for k, v in weights.items()})
        final = final.cpu().eval()
        final._target_embedding = None
        return final

    def _selected_weights(self, weights: dict) -> tuple[dict, bool]:
        """With ``select_by="holdout"``, the weights the main process chose, on every process: ``(weights, whether
        they are not the trained module's own)``."""
        if self.cfg.select_by != "holdout":
            return weights, False
        from accelerate.utils import broadcast

        device = self.accelerator.device
        changed = torch.tensor([0], device=device)
        if self.selection is not None:
            message, chosen = self.selection.choose(self.step)
            self.log(message)
            if chosen is not None:
                weights, changed[0] = chosen, 1
        replaced = bool(int(broadcast(changed)[0]) if self.world > 1 else int(changed[0]))
        if self.world > 1 and replaced:
            weights = {k: v.to(device).contiguous() for k, v in weights.items()}
            for tensor in weights.values():
                torch.distributed.broadcast(tensor, src=0)
        return weights, replaced


def _loss_line(objective) -> str:
    """The loss of a :class:`TrainConfig` (or of a checkpoint's ``objective``) in words, for the log."""
    get = objective.get if isinstance(objective, dict) else lambda name: getattr(objective, name)
    kind = get("loss")
    if kind == "lk":
        return "lk (the acceptance term 1 - sum min(p, q) alone)"
    if kind == "mixed":
        return f"mixed (soft cross-entropy + {get('lk_weight'):g} x the acceptance term 1 - sum min(p, q))"
    return f"{kind} (soft cross-entropy)"


def _finished(step: int, epoch: int, seconds: float, cfg: TrainConfig, stopped: str | None = None
              ) -> tuple[str, str] | None:
    """Whether a checkpoint at ``step``, ``epoch`` and ``seconds`` of training (ended by early stopping when
    ``stopped`` says why) is the end of a run with ``cfg``: ``(why, the options that train further)``, else
    ``None``."""
    ends = []
    if stopped and cfg.stop_gain:
        ends.append((stopped, "--stop-window (or pass --stop-gain 0)"))
    if epoch >= cfg.epochs:
        ends.append((f"epochs done (--epochs {cfg.epochs})", "--epochs"))
    if cfg.max_steps and step >= cfg.max_steps:
        ends.append((f"max steps reached (--max-steps {cfg.max_steps})", "--max-steps"))
    if cfg.max_minutes and seconds > cfg.max_minutes * 60:
        ends.append((f"time budget reached (--max-minutes {cfg.max_minutes:g})", "--max-minutes"))
    if not ends:
        return None
    return " and ".join(why for why, _ in ends), " and ".join(option for _, option in ends)


def _scored_steps(path: Path) -> set[int]:
    """The steps whose held-out score ``path`` (``log.jsonl``) holds."""
    steps = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "holdout_acceptance_length" in record:
            steps.add(record.get("step"))
    return steps


def _logged_scores(path: Path) -> list[tuple[int, float, float]]:
    """``(step, training minutes, held-out score)`` of every scored checkpoint ``path`` (``log.jsonl``) records with
    its minutes."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "holdout_acceptance_length" in record and "training_minutes" in record:
            out.append((record["step"], float(record["training_minutes"]), float(record["holdout_acceptance_length"])))
    return out


def stall_reason(history: list[tuple[float, float]], now: float, gain: float, window: float) -> str | None:
    """Early stopping's verdict at ``now`` training minutes: why the run ends, or ``None`` while it goes on.

    It ends when the best held-out score so far exceeds the best score of the checkpoints at least ``window``
    minutes older by less than ``gain``; while no checkpoint is that old it goes on.

    Args:
        history: ``(training minutes, held-out score)`` of every checkpoint scored up to ``now``.
        now: training minutes at the latest checkpoint.
        gain: the least held-out acceptance length a window must add (``--stop-gain``).
        window: minutes of training looked back over (``--stop-window``).
    """
    older = [score for minutes, score in history if minutes <= now - window]
    if not older:
        return None
    best, before = max(score for _, score in history), max(older)
    if best - before >= gain:
        return None
    return (f"early stop: the last {window:g} minutes of training added {best - before:+.3f} held-out acceptance "
            f"length (best {best:.3f}), less than --stop-gain {gain:g}")


def _drop_logged_steps_after(path: Path, step: int) -> None:
    """Remove the records of ``path`` (``log.jsonl``) past ``step``, and any line a kill cut, so that a run resumed
    at ``step`` logs each step once."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step):
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


class _Selection:
    """The checkpoint :func:`train` returns with ``select_by="holdout"``: every checkpoint is scored by the mean
    acceptance length greedy chain decoding would reach on the held-out shards' answers (replayed, see
    :mod:`~hf_eagle3.training.replay`), and the best one's weights are kept in ``out/best.pt`` (which survives a
    resume). Only the main process keeps one.

    Early stopping (:func:`stall_reason`) reads the scores with the training minutes they were reached at
    (``history``, this run's and, after a resume, those ``log.jsonl`` holds).

    Args:
        out: the run directory.
        heldout: the held-out set, ``(shards' reader, shard paths)`` (:func:`held_out_set`).
        cfg: the run's settings (``select_chain_length``, ``batch_tokens``).
        draft: the draft being trained (its config builds the scorer).
        embed: the target's embedding, on the scorer's device.
    """

    def __init__(self, out: Path, heldout: tuple, cfg: TrainConfig, draft: Eagle3DraftModel, embed):
        self.path = out / "best.pt"
        self.reader, self.shards = heldout
        self.scorer = type(draft)(draft.config).to(embed.weight.device).eval()  # plain weights, whatever the layout
        self.scorer._target_embedding = (embed,)
        self.k, self.batch_tokens = cfg.select_chain_length, cfg.batch_tokens
        self.best = torch.load(self.path, weights_only=False) if self.path.exists() else None
        self.scored = {}  # step -> score, this run
        # (training minutes, score) of every scored checkpoint, this run's and those logged before a resume
        self.history = [(minutes, score) for _, minutes, score in _logged_scores(out / "log.jsonl")]

    def score(self, weights: dict, step: int, minutes: float = 0.0) -> float | None:
        """Score the draft's ``weights`` (a full state dict, at ``step``, after ``minutes`` of training) and keep
        them if they are the best so far; ``None`` if this step was scored already."""
        if step in self.scored or (self.best is not None and self.best["step"] == step):
            return None
        self.scorer.load_state_dict(weights)
        items = self.reader.records(self.shards)  # read when scored: held-out features can be large
        score = replay_chain_acceptance(self.scorer, items, self.k, self.batch_tokens).mean_acceptance_length
        self.scored[step] = score
        self.history.append((minutes, score))
        if self.best is None or score > self.best["score"]:
            self.best = {"step": step, "score": score,
                         "model": {k: v.detach().cpu().clone() for k, v in weights.items()}}
            tmp = self.path.with_suffix(".tmp")
            torch.save(self.best, tmp)
            tmp.replace(self.path)
        return score

    def choose(self, step: int) -> tuple[str, dict | None]:
        """What was chosen (a line to log) and the chosen weights, or ``None`` where they are the last ones (those
        at ``step``)."""
        if self.best is None:
            return "select_by holdout: no checkpoint was scored; the last weights are returned", None
        last = self.scored.get(step)
        chosen = self.best["step"]
        written = self.path.parent / "selection.json"
        if last is None and self.best["step"] == step:
            last = self.best["score"]
        elif last is None and written.exists():  # a finished run's rerun scores nothing: keep the score it wrote
            before = json.loads(written.read_text())
            last = before.get("last_score") if before.get("last_step") == step else None
        (self.path.parent / "selection.json").write_text(json.dumps(
            {"selected_step": chosen, "selected_score": self.best["score"], "last_step": step, "last_score": last,
             "metric": f"held-out mean acceptance length, greedy chain of {self.k}"}, indent=2))
        return (f"selected the checkpoint of step {chosen} (held-out mean acceptance length {self.best['score']:.3f}"
                + (f"; last step {step}: {last:.3f})" if last is not None else ")")), \
            (self.best["model"] if chosen != step else None)


def end_distributed() -> None:
    """Leave the process group of a multi-process run cleanly (after a barrier): a process that exits with it still
    up can abort in the communication threads' destructors. Nothing to do in a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from accelerate import PartialState

        PartialState().wait_for_everyone()
        PartialState().destroy_process_group()


@torch.no_grad()
def evaluate(draft: Eagle3DraftModel, features_dir, shards=None, ttt_length: int = 7, batch_tokens: int = 4096,
             max_prompt_context: int = 256, holdout_shards: int = 1, chain_length: int = 5) -> dict:
    """Per-step accuracy of ``draft`` on feature shards (default: the held-out shards), and the acceptance length
    greedy chain decoding would reach on their answers (:func:`~hf_eagle3.training.replay.replay_chain_acceptance`).

    Args:
        draft: the draft to evaluate.
        features_dir: the feature shards' directory.
        shards: these shard paths, or ``"all"`` for every shard in ``features_dir`` (default: the first
            ``holdout_shards``, which training leaves out).
        ttt_length: unrolled steps whose accuracy is reported.
        batch_tokens: padded tokens per batch.
        max_prompt_context: prompt tokens kept before each answer, as in training.
        holdout_shards: how many leading shards are held out.
        chain_length: draft tokens per round of the replayed chain (0: no replay).

    Returns:
        ``{"acc": [...], "loss": [...], "count": ...}`` averaged over counted positions; ``"vocab_coverage"``, the
        share of answer positions whose target argmax is in the draft vocabulary (the others are never accepted
        and not counted in ``acc``: a low coverage calls for a larger ``--draft-vocab-size``); and ``"chain"`` (the
        replay's :meth:`~hf_eagle3.core.stats.Eagle3Stats.to_dict`, with ``"k"``: ``chain_length``) when ``chain_length``
        > 0.
    """
    head = check_draft_matches_features(draft, features_dir)
    data = FeatureShards(features_dir, batch_tokens, max_prompt_context, holdout_shards=holdout_shards)
    if shards is None and not data.holdout:
        raise ValueError(f"nothing to evaluate in {features_dir}: holdout_shards is 0 and no shards were given "
                         "(pass holdout_shards >= 1, shards=[...] or shards=\"all\").")
    shards = data.holdout + data.shards if shards == "all" else data.holdout if shards is None else shards
    embed = torch.nn.Embedding.from_pretrained(head["embed_tokens"], freeze=True)
    draft._target_embedding = (embed,)
    used = torch.arange(draft.config.draft_vocab_size) + draft.d2t.cpu()
    acc = [0.0] * ttt_length
    los = [0.0] * ttt_length
    cnt = [0.0] * ttt_length
    answer_positions = covered = 0
    for _, _, items in data.batches(0, shards):
        batch = collate(items, draft.t2d.bool(), head["lm_head"][used])
        answer_positions += sum(len(x["input_ids"]) - x["prompt_len"] for x in items)
        covered += int(batch["loss_mask"].sum())  # answer positions whose target argmax the draft vocabulary holds
        _, stats = ttt_loss(draft, batch["features"], batch["input_ids"], batch["target_logits"], batch["loss_mask"], ttt_length)
        for k in range(ttt_length):
            acc[k] += stats["acc"][k] * stats["count"][k]
            los[k] += stats["loss"][k] * stats["count"][k]
            cnt[k] += stats["count"][k]
    out = {"acc": [a / max(c, 1) for a, c in zip(acc, cnt)], "loss": [l / max(c, 1) for l, c in zip(los, cnt)], "count": cnt[0],
           "vocab_coverage": covered / max(answer_positions, 1)}
    if chain_length:
        replay = replay_chain_acceptance(draft, data.records(shards), chain_length, batch_tokens)
        out["chain"] = {"k": chain_length, **replay.to_dict()}
    draft._target_embedding = None
    return out
