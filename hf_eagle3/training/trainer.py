"""Training-time test (TTT) training of EAGLE-3 drafts, on cached target features.

Recipe (REFERENCE §4): the draft is unrolled ``ttt_length`` steps per position. Step 0 reads ``fc(target features)``
at base position t with the embedding of token t+1; step k reads the pre-norm output of step k-1 at the same base
position with the embedding of token t+1+k, at position t+k, and attends causally to the step-0 keys plus the
same-base keys of steps 1..k (exactly what it sees at inference). Step k is trained against the target's
distribution at position t+1+k restricted to the draft vocabulary (soft cross-entropy), on response positions whose
target argmax is in the draft vocabulary, weighted 0.8**k.

The same code runs on one CPU and on one or many GPUs through ``accelerate``.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..configuration_eagle3 import Eagle3Config, default_feature_layer_ids
from ..modeling_eagle3 import Eagle3DraftModel
from .hardware import resolve_dtype


class ConcatKVCache:
    """A KV cache that concatenates (autograd-safe), with the interface the draft's attention uses."""

    def __init__(self):
        self.keys = None
        self.values = None

    def get_seq_length(self) -> int:
        """Number of cached positions."""
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, k, v):
        """Append ``k``/``v`` and return all keys/values."""
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values


class TTTAttention:
    """The attention pattern of the training-time test, computed in O(m^2 + k m) instead of O(k m^2).

    Passed as the draft's ``cache``: step 0 attends causally to its own keys; step s attends to the step-0 keys
    causally plus, at its own base position, the keys of steps 1..s. Equivalent to SDPA over the concatenated keys
    with :func:`ttt_attention_mask`.
    """

    def __init__(self):
        self.keys: list = []
        self.values: list = []

    def get_seq_length(self) -> int:
        """Number of steps' keys held (each of the full sequence length)."""
        return sum(k.shape[2] for k in self.keys)

    def attend(self, q, k, v):
        """Store this step's ``k``/``v`` ([B, kv_heads, m, D]) and attend ``q`` ([B, heads, m, D]) over all steps."""
        self.keys.append(k)
        self.values.append(v)
        groups = q.shape[1] // k.shape[1]

        def expand(x):
            return x.repeat_interleave(groups, dim=1) if groups > 1 else x

        scale = q.shape[-1] ** -0.5
        k0, v0 = expand(self.keys[0]), expand(self.values[0])
        m = q.shape[2]
        scores = (q @ k0.transpose(-1, -2)).float() * scale
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [((q * expand(kj)).sum(-1, keepdim=True)).float() * scale for kj in self.keys[1:]]
        weights = torch.cat([scores] + diag, dim=-1).softmax(-1).to(q.dtype)
        out = weights[..., :m] @ v0
        for j, vj in enumerate(self.values[1:]):
            out = out + weights[..., m + j : m + j + 1] * expand(vj)
        return out


def ttt_attention_mask(m: int, step: int, device=None) -> torch.Tensor:
    """Bool mask [m, (step + 1) * m] of TTT step ``step``: causal over step-0 keys, diagonal over steps 1..step."""
    causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    eye = torch.eye(m, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_forward(draft: Eagle3DraftModel, features: torch.Tensor, input_ids: torch.LongTensor, ttt_length: int = 7):
    """Unroll the draft ``ttt_length`` steps over every base position of a batch.

    Args:
        draft: the draft (bound to an embedding).
        features: captured target features [B, n, 3T].
        input_ids: tokens [B, n] (target vocabulary).
        ttt_length: unrolled steps.

    Returns:
        A list of ``ttt_length`` pre-norm hidden states [B, n - 1, H]; entry k at base position t is what the draft
        computes at inference on its (k+1)-th step after the real features up to t, fed tokens t+1 .. t+1+k.
    """
    b, n = input_ids.shape
    m = n - 1  # base positions t = 0..n-2 (token t+1 exists)
    hidden = draft.project_features(features[:, :m])
    tokens_all = F.pad(input_ids, (0, ttt_length + 1))
    cache = TTTAttention()
    base = torch.arange(m, device=input_ids.device)[None].expand(b, m)
    outs = []
    for k in range(ttt_length):
        out = draft(
            input_ids=tokens_all[:, 1 + k : 1 + k + m],
            hidden_states=hidden,
            position_ids=base + k,
            cache=cache,
            logits_to_keep=-1,
        )
        hidden = out.hidden_states
        outs.append(hidden)
    return outs


def ttt_loss(
    draft: Eagle3DraftModel,
    features: torch.Tensor,
    input_ids: torch.LongTensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_length: int = 7,
    step_decay: float = 0.8,
):
    """Compute the TTT loss of one batch.

    Args:
        draft: the draft being trained (bound to an embedding).
        features: captured target features [B, n, 3T].
        input_ids: tokens [B, n] (target vocabulary).
        target_logits: the target's logits restricted to the draft vocabulary [B, n, Vd]; position i predicts
            token i + 1.
        loss_mask: [B, n] float/bool weights; position i counts (with its weight) when it predicts a response token
            whose target argmax is in the draft vocabulary.
        ttt_length: unrolled draft steps.
        step_decay: step k is weighted ``step_decay ** k``.

    Returns:
        ``(loss, stats)``: the sum over steps (weighted ``step_decay ** k``) of each step's weighted mean soft
        cross-entropy over its counted positions, and per-step ``loss``, ``acc`` (draft argmax == target argmax,
        weighted alike) and ``count`` lists.
    """
    m = input_ids.shape[1] - 1
    pad = ttt_length + 1  # pad once so that every step reads a window [1 + k, 1 + k + m)
    probs_all = F.pad(target_logits.float().softmax(-1), (0, 0, 0, pad))
    argmax_all = F.pad(target_logits.argmax(-1), (0, pad))
    mask_all = F.pad(loss_mask.float(), (0, pad))
    total = features.new_zeros((), dtype=torch.float32)
    stats = {"loss": [], "acc": [], "count": []}
    for k, hidden in enumerate(ttt_forward(draft, features, input_ids, ttt_length)):
        window = slice(1 + k, 1 + k + m)
        sel = mask_all[:, window] > 0  # the LM head and the loss only where the position counts
        count = int(sel.sum())
        stats["count"].append(float(count))
        if count == 0:
            stats["loss"].append(0.0)
            stats["acc"].append(0.0)
            continue
        weight = mask_all[:, window][sel]
        logits = draft.compute_logits(hidden[sel]).float()
        per_pos = -(probs_all[:, window][sel] * logits.log_softmax(-1)).sum(-1)
        step_loss = (per_pos * weight).sum() / weight.sum()
        total = total + (step_decay**k) * step_loss
        with torch.no_grad():
            acc = ((logits.argmax(-1) == argmax_all[:, window][sel]).float() * weight).sum() / weight.sum()
        stats["loss"].append(float(step_loss.detach()))
        stats["acc"].append(float(acc))
    return total, stats


class TTTObjective(torch.nn.Module):
    """The TTT loss as a module: data-parallel wrappers (DDP through ``accelerate``) synchronise gradients only for
    work done inside their ``forward``, and the loss calls the draft ``ttt_length`` times plus its LM head.

    Args:
        draft: the draft being trained (bound to an embedding).
        ttt_length: unrolled draft steps.
    """

    def __init__(self, draft: Eagle3DraftModel, ttt_length: int):
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length

    def forward(self, features, input_ids, target_logits, loss_mask):
        """Return ``ttt_loss(draft, ...)``: the loss and the per-step statistics."""
        return ttt_loss(self.draft, features, input_ids, target_logits, loss_mask, self.ttt_length)


# ----------------------------------------------------------------------------------------------------- data
class FeatureShards:
    """Batches of cached features, read shard by shard (each shard shuffled), batched by a token budget.

    Args:
        root: directory written by :func:`hf_eagle3.training.features.cache_features`.
        batch_tokens: padded tokens per batch (at most).
        max_prompt_context: keep at most this many prompt tokens before each response.
        holdout_shards: the first shards are left out of training (for evaluation).
        seed: shuffling seed.
    """

    def __init__(self, root, batch_tokens: int = 4096, max_prompt_context: int = 256, holdout_shards: int = 0, seed: int = 0):
        self.root = Path(root)
        self.holdout_shards = holdout_shards
        self.batch_tokens = batch_tokens
        self.max_prompt_context = max_prompt_context
        self.seed = seed
        self.refresh()
        if not self.shards:
            raise FileNotFoundError(f"no feature shards in {root}: run `hf-eagle3 prepare` / cache_features first")

    def refresh(self) -> None:
        """Re-read the shard list (training picks up shards written meanwhile at the next epoch). The first
        ``holdout_shards`` shards are held out, so the held-out set stays the same while data grows."""
        shards = sorted(self.root.glob("shard-*.pt"))
        self.holdout, self.shards = shards[: self.holdout_shards], shards[self.holdout_shards :]

    def _trim(self, item):
        cut = max(0, item["prompt_len"] - self.max_prompt_context)
        return {
            "input_ids": item["input_ids"][cut:].long(),
            "features": item["features"][cut:],
            "last_hidden": item["last_hidden"][cut:],
            "target_argmax": item["target_argmax"][cut:].long(),
            "prompt_len": item["prompt_len"] - cut,
        }

    def batches(self, epoch: int, shards=None, mmap: bool = False):
        """Yield ``(shard_path, batch_index, items)`` for one epoch, in a deterministic shuffled order.

        Without ``shards``, the shard list is re-read after every shard, so shards written while training runs
        (data generation still going on) join the current pass.

        Args:
            epoch: seeds the order.
            shards: these shard paths only (default: the training shards, re-read as they grow).
            mmap: map the shards instead of reading them (tensors are read only when touched: cheap counting).
        """
        rng = random.Random(self.seed * 1000 + epoch)
        fixed = list(shards) if shards is not None else None
        done: set = set()
        while True:
            if fixed is None:
                self.refresh()
            pending = [s for s in (fixed if fixed is not None else self.shards) if s not in done]
            if not pending:
                return
            path = rng.choice(pending)
            done.add(path)
            items = [self._trim(x) for x in torch.load(path, weights_only=False, mmap=mmap)]
            items.sort(key=lambda x: len(x["input_ids"]))
            groups, cur = [], []
            for it in items:
                width = max([len(x["input_ids"]) for x in cur] + [len(it["input_ids"])])
                if cur and width * (len(cur) + 1) > self.batch_tokens:
                    groups.append(cur)
                    cur = []
                cur.append(it)
            if cur:
                groups.append(cur)
            rng.shuffle(groups)
            for bi, g in enumerate(groups):
                yield path, bi, g

    def num_batches(self, shards=None) -> int:
        """Count batches of one epoch (maps every shard once; only the token ids are read).

        Args:
            shards: these shard paths only (default: the training shards).
        """
        return sum(1 for _ in self.batches(0, shards, mmap=True))


def collate(items, t2d: torch.Tensor, lm_head_rows: torch.Tensor, prompt_loss_weight: float = 0.0):
    """Pad ``items`` and compute target logits over the draft vocabulary and the loss mask.

    The mask is 1 where a position predicts a response token whose target argmax is in the draft vocabulary (the
    reference recipe). ``prompt_loss_weight`` > 0 also counts prompt positions, with that weight: distillation on
    the prompt text, which is free (its features are cached anyway) and broadens scarce data.

    Returns:
        dict with ``features``, ``input_ids``, ``target_logits``, ``loss_mask``.
    """
    n = max(len(x["input_ids"]) for x in items)
    b = len(items)
    t = items[0]["features"].shape[-1]
    feats = torch.zeros(b, n, t, dtype=items[0]["features"].dtype)
    last = torch.zeros(b, n, items[0]["last_hidden"].shape[-1], dtype=items[0]["last_hidden"].dtype)
    ids = torch.zeros(b, n, dtype=torch.long)
    mask = torch.zeros(b, n)
    for r, x in enumerate(items):
        L = len(x["input_ids"])
        feats[r, :L], last[r, :L], ids[r, :L] = x["features"], x["last_hidden"], x["input_ids"]
        # position i predicts token i+1: count response tokens (i + 1 >= prompt_len) whose target argmax is drafted
        pos = torch.arange(L)
        drafted = (pos + 1 < L) & t2d[x["target_argmax"]]
        response = pos + 1 >= x["prompt_len"]
        mask[r, :L] = (drafted & response).float() + prompt_loss_weight * (drafted & ~response).float()
    logits = last.float() @ lm_head_rows.T
    return {"features": feats, "input_ids": ids, "target_logits": logits, "loss_mask": mask}


# ---------------------------------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    """Settings of :func:`train` (defaults follow the reference recipe, REFERENCE §4).

    Args:
        ttt_length: unrolled draft steps per position.
        lr: peak learning rate (AdamW, betas ``betas``).
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``.
        epochs: passes over the training shards.
        batch_tokens: padded tokens per batch.
        grad_clip: gradient-norm clip.
        max_prompt_context: prompt tokens kept before each response.
        prompt_loss_weight: weight of prompt positions in the loss (0 = the reference recipe: responses only).
        mixed_precision: ``"auto"`` (bf16 where the hardware computes it, else no autocast), ``"bf16"``,
            ``"fp16"`` or ``"no"`` (accelerate autocast).
        save_every: checkpoint every this many optimiser steps.
        log_every: log every this many steps.
        holdout_shards: shards kept out of training for evaluation (the first ones).
        max_steps: stop after this many steps (0 = no limit).
        max_minutes: stop (with a checkpoint) after this many minutes of training (0 = no limit).
        seed: random seed.
    """

    ttt_length: int = 7
    lr: float = 1e-4
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    epochs: int = 1
    batch_tokens: int = 4096
    grad_clip: float = 0.5
    max_prompt_context: int = 256
    prompt_loss_weight: float = 0.0
    mixed_precision: str = "auto"
    save_every: int = 100
    log_every: int = 10
    holdout_shards: int = 1
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
    draft-length setting is ``num_assistant_tokens_schedule="auto"`` (see docs/cost_model.md)."""
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
            draft.fc.weight[:, 2 * t :] = torch.eye(h)
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
    from accelerate import Accelerator
    from accelerate.utils import broadcast

    cfg = cfg or TrainConfig()
    head = check_draft_matches_features(draft, features_dir)  # before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    mixed_precision, precision_line = resolve_dtype(cfg.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu",
                                                    label="mixed precision", bf16="bf16", fallback="no")
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    embed = torch.nn.Embedding.from_pretrained(head["embed_tokens"], freeze=True)
    used = torch.arange(draft.config.draft_vocab_size) + draft.d2t.cpu()
    lm_rows = head["lm_head"][used]
    t2d = draft.t2d.cpu().bool()
    data = FeatureShards(features_dir, cfg.batch_tokens, cfg.max_prompt_context, cfg.holdout_shards, cfg.seed)
    world, rank, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    per_epoch = data.num_batches() // world  # optimiser steps per epoch, on the data there is now
    # with a time budget the schedule follows the clock (and data may still grow): no step total
    total_steps = 0 if cfg.max_minutes else per_epoch * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps) if total_steps else cfg.max_steps
    if main:
        log(precision_line)
        warning = schedule_warning(per_epoch, cfg)
        if warning:
            log(warning)
    if hasattr(draft, "embed_tokens"):  # the draft reads the target's (frozen) embedding during training
        draft.embed_tokens.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    clock = {"start": time.time(), "offset": 0.0, "now": 0.0}

    def elapsed() -> float:
        """Training seconds so far; with several processes, the main process's clock (one collective), so that
        every process uses the same learning rate and stops at the same step."""
        t = clock["offset"] + time.time() - clock["start"]
        if world > 1:
            t = float(broadcast(torch.tensor([t], dtype=torch.float64, device=accelerator.device))[0])
        return t

    def progress(s: int) -> float:
        # with a time budget the schedule follows the clock, so that it ends decayed whatever the speed
        if cfg.max_minutes:
            return clock["now"] / (cfg.max_minutes * 60)
        return (s - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, progress(s), cfg))
    step, start_epoch, skip = 0, 0, 0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, start_epoch, skip = state["step"], state["epoch"], state["batches_done"]
        clock["offset"] = clock["now"] = state.get("elapsed", 0.0)
        if main:
            log(f"resumed from {ckpt} at step {step} (epoch {start_epoch}, batch {skip})")
    draft.train()
    model, opt = accelerator.prepare(TTTObjective(draft, cfg.ttt_length), opt)
    unwrapped = accelerator.unwrap_model(model).draft
    embed = embed.to(accelerator.device)
    unwrapped._target_embedding = (embed,)
    if main:
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    t0 = clock["start"] = time.time()
    tokens_seen = 0

    def save(epoch, batches_done):
        if main:  # one writer; every process holds the same weights
            tmp = out / "checkpoint.tmp"
            torch.save(
                {
                    "model": unwrapped.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "batches_done": batches_done,
                    "elapsed": clock["now"],
                },
                tmp,
            )
            tmp.replace(ckpt)
        accelerator.wait_for_everyone()

    def rounds(epoch):
        """This process's batches: each round of ``world`` consecutive batches gives one to every process; an
        incomplete last round is left out (every process must take the same number of optimiser steps)."""
        pending = []
        for bi, (_, _, items) in enumerate(data.batches(epoch)):
            pending.append(items)
            if len(pending) == world:
                yield bi + 1, pending[rank]
                pending = []

    ended = None
    with open(out / "log.jsonl", "a") if main else contextlib.nullcontext() as logf:
        for epoch in range(start_epoch, cfg.epochs):
            for batches_done, items in rounds(epoch):
                if epoch == start_epoch and batches_done <= skip:
                    continue
                batch = collate(items, t2d, lm_rows, cfg.prompt_loss_weight)
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                with accelerator.autocast():
                    loss, stats = model(batch["features"], batch["input_ids"], batch["target_logits"], batch["loss_mask"])
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                clock["now"] = elapsed()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                tokens_seen += int(batch["loss_mask"].sum())
                if step % cfg.log_every == 0 or step == 1:
                    tokens = tokens_seen
                    if world > 1:  # every process logs at the same steps: a collective is safe here
                        tokens = int(accelerator.reduce(torch.tensor(tokens_seen, device=accelerator.device), "sum"))
                    rec = {
                        "step": step,
                        "epoch": epoch,
                        "loss": float(loss.detach()),
                        "acc": [round(a, 4) for a in stats["acc"]],
                        "lr": sched.get_last_lr()[0],
                        "tokens": tokens,
                        "minutes": round((time.time() - t0) / 60, 2),
                    }
                    if main:
                        logf.write(json.dumps(rec) + "\n")
                        logf.flush()
                        log(f"step {step}/{total_steps or '?'} loss {rec['loss']:.4f} acc {rec['acc']} "
                            f"lr {rec['lr']:.2e} {rec['minutes']:.1f} min")
                if step % cfg.save_every == 0:
                    save(epoch, batches_done)
                if cfg.max_steps and step >= cfg.max_steps:
                    ended = f"max steps reached (--max-steps {cfg.max_steps}, in epoch {epoch + 1} of {cfg.epochs})"
                elif cfg.max_minutes and clock["now"] > cfg.max_minutes * 60:
                    ended = (f"time budget reached (--max-minutes {cfg.max_minutes:g}, {step} step(s), in epoch "
                             f"{epoch + 1} of {cfg.epochs})")
                if ended:
                    save(epoch, batches_done)
                    break
            if ended:
                break
            skip = 0
            save(epoch + 1, 0)
    if main:
        if ended is None:
            ended = f"epochs done ({cfg.epochs} epoch(s), {step} step(s))"
            if cfg.max_minutes:
                ended += (f", {clock['now'] / 60:.1f} of the {cfg.max_minutes:g} minutes of --max-minutes used: "
                          "raise --epochs to train longer")
        log(f"training ended: {ended}")
    accelerator.wait_for_everyone()  # no process leaves (and tears down) while another is still in a collective
    final = unwrapped.cpu().eval()
    final._target_embedding = None
    return final


def end_distributed() -> None:
    """Leave the process group of a multi-process run cleanly (after a barrier): a process that exits with it still
    up can abort in the communication threads' destructors. Nothing to do in a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from accelerate import PartialState

        PartialState().wait_for_everyone()
        PartialState().destroy_process_group()


@torch.no_grad()
def evaluate(draft: Eagle3DraftModel, features_dir, shards=None, ttt_length: int = 7, batch_tokens: int = 4096,
             max_prompt_context: int = 256) -> dict:
    """Per-step accuracy of ``draft`` on feature shards (default: the held-out first shard).

    Returns:
        ``{"acc": [...], "loss": [...], "count": ...}`` averaged over counted positions.
    """
    head = check_draft_matches_features(draft, features_dir)
    embed = torch.nn.Embedding.from_pretrained(head["embed_tokens"], freeze=True)
    draft._target_embedding = (embed,)
    used = torch.arange(draft.config.draft_vocab_size) + draft.d2t.cpu()
    data = FeatureShards(features_dir, batch_tokens, max_prompt_context, holdout_shards=1)
    shards = shards if shards is not None else data.holdout
    acc = [0.0] * ttt_length
    los = [0.0] * ttt_length
    cnt = [0.0] * ttt_length
    for _, _, items in data.batches(0, shards):
        batch = collate(items, draft.t2d.bool(), head["lm_head"][used])
        _, stats = ttt_loss(draft, batch["features"], batch["input_ids"], batch["target_logits"], batch["loss_mask"], ttt_length)
        for k in range(ttt_length):
            acc[k] += stats["acc"][k] * stats["count"][k]
            los[k] += stats["loss"][k] * stats["count"][k]
            cnt[k] += stats["count"][k]
    draft._target_embedding = None
    return {"acc": [a / max(c, 1) for a, c in zip(acc, cnt)], "loss": [l / max(c, 1) for l, c in zip(los, cnt)], "count": cnt[0]}
