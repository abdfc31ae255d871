"""The target's features for draft training: cached in resumable shards (:func:`cache_features`), read back as
token-budget batches (:class:`FeatureShards`, :func:`collate`).

For every training sequence (prompt + regenerated response) one target forward gives, per position: the three
captured hidden states (the draft's input, captured with the same hooks as at inference), the final (post-norm)
hidden state (the target's logits over the draft vocabulary are recomputed from it at training time) and the
target's argmax token (for the loss mask). Shard ``i`` holds records ``[i * per_shard, (i + 1) * per_shard)`` of
the input order, so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from ..core.feature_capture import Eagle3FeatureCapture, find_decoder_layers


def save_target_head(target, out_dir: str | os.PathLike) -> Path:
    """Store what training needs of the target besides features: its input embedding, LM head and dimensions."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = target.config.get_text_config()
    head = {
        "embed_tokens": target.get_input_embeddings().weight.detach().float().cpu().clone(),
        "lm_head": target.get_output_embeddings().weight.detach().float().cpu().clone(),
        "config": {
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": getattr(text, "intermediate_size", 4 * text.hidden_size),
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "max_position_embeddings": getattr(text, "max_position_embeddings", 2048),
            "num_hidden_layers": len(find_decoder_layers(target)),
            "model_type": text.model_type,
            "name_or_path": getattr(target, "name_or_path", None),
        },
    }
    tmp = out / f"target_head.{os.getpid()}.tmp"  # several processes may write it at once: replace atomically
    torch.save(head, tmp)
    tmp.replace(out / "target_head.pt")
    return out / "target_head.pt"


@torch.no_grad()
def cache_features(
    target,
    records: list[dict],
    out_dir: str | os.PathLike,
    layer_ids: list[int],
    *,
    per_shard: int = 128,
    batch_size: int = 8,
    max_length: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    max_prompt_tokens: int | None = None,
    complete_shards_only: bool = False,
    progress: bool = True,
) -> list[Path]:
    """Run ``target`` over ``records`` and write feature shards to ``out_dir`` (skipping shards already written).

    Args:
        target: the target model (any decoder whose layers :func:`find_decoder_layers` finds).
        records: ``{"prompt_ids", "response_ids"}`` dicts (from :mod:`hf_eagle3.training.prepare`).
        out_dir: output directory (``shard-*.pt``, ``target_head.pt``, ``meta.json``).
        layer_ids: the draft's capture indices (input of layer i; three in EAGLE-3, or more).
        per_shard: records per shard.
        batch_size: sequences per target forward (right padded).
        max_length: sequences are cut to this many tokens.
        dtype: storage dtype of the features.
        max_prompt_tokens: keep only the last this-many prompt tokens of each record (saves target compute).
        complete_shards_only: leave a last, partial shard unwritten (for data that is still growing).
        progress: show a progress bar.

    Returns:
        The shard paths, in order.
    """
    out = Path(out_dir)
    meta = out / "meta.json"
    if meta.exists() and any(out.glob("shard-*.pt")):
        written = json.loads(meta.read_text()).get("layer_ids")
        if written is not None and list(written) != list(layer_ids):
            raise ValueError(f"{out} holds features of target layers {written}; this pass captures {list(layer_ids)}. "
                             "Give another --features-dir (or --out), or keep the layers the features have.")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "target_head.pt").exists():
        save_target_head(target, out)
    (out / "meta.json").write_text(json.dumps({"layer_ids": list(layer_ids), "num_records": len(records)}))
    base = target.base_model
    device = next(target.parameters()).device
    lm_head = target.get_output_embeddings()
    if max_prompt_tokens is not None:
        records = [dict(r, prompt_ids=r["prompt_ids"][-max_prompt_tokens:]) for r in records]
    n_shards = len(records) // per_shard if complete_shards_only else (len(records) + per_shard - 1) // per_shard
    shards = [out / f"shard-{i:05d}.pt" for i in range(n_shards)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=min(len(records), n_shards * per_shard), desc="features", unit="seq")
    with Eagle3FeatureCapture(target, layer_ids) as capture:
        for i, path in enumerate(shards):
            chunk = records[i * per_shard : (i + 1) * per_shard]
            if path.exists():
                if bar is not None:
                    bar.update(len(chunk))
                continue
            items = []
            order = sorted(range(len(chunk)), key=lambda j: len(chunk[j]["prompt_ids"]) + len(chunk[j]["response_ids"]))
            for b in range(0, len(order), batch_size):
                group = [chunk[j] for j in order[b : b + batch_size]]
                seqs = [(r["prompt_ids"] + r["response_ids"])[:max_length] for r in group]
                width = max(len(s) for s in seqs)
                ids = torch.zeros(len(seqs), width, dtype=torch.long)
                mask = torch.zeros(len(seqs), width, dtype=torch.long)
                for r, s in enumerate(seqs):
                    ids[r, : len(s)] = torch.tensor(s)
                    mask[r, : len(s)] = 1
                hidden = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
                feats = capture.features(device="cpu", dtype=dtype)
                argmax = lm_head(hidden).argmax(-1).cpu()
                for r, (rec, s) in enumerate(zip(group, seqs)):
                    n = len(s)
                    items.append(
                        {
                            "id": rec.get("id"),
                            "turn": rec.get("turn", 0),
                            "input_ids": torch.tensor(s, dtype=torch.int32),
                            "prompt_len": min(len(rec["prompt_ids"]), n),
                            "features": feats[r, :n].clone(),
                            "last_hidden": hidden[r, :n].to(device="cpu", dtype=dtype).clone(),
                            "target_argmax": argmax[r, :n].to(torch.int32).clone(),
                        }
                    )
                capture.clear()
                if bar is not None:
                    bar.update(len(group))
            tmp = path.with_suffix(".tmp")
            torch.save(items, tmp)
            tmp.replace(path)
    if bar is not None:
        bar.close()
    return shards


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
        if not (self.holdout or self.shards):
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

    def records(self, shards=None) -> list[dict]:
        """All records of ``shards`` (default: the training shards), prompts trimmed as in the batches.

        Args:
            shards: these shard paths only.
        """
        paths = list(shards) if shards is not None else self.shards
        return [self._trim(x) for path in paths for x in torch.load(path, weights_only=False)]

    def num_batches(self, shards=None) -> int:
        """Count batches of one epoch (maps every shard once; only the token ids are read).

        Args:
            shards: these shard paths only (default: the training shards).
        """
        return sum(1 for _ in self.batches(0, shards, mmap=True))


def pad_records(items, keys=("features", "input_ids")) -> list[torch.Tensor]:
    """Stack the per-position tensors ``keys`` of feature records into ``[B, n, ...]``, right-padded with zeros
    (a row's positions never attend to the padding after them).

    Args:
        items: feature records as :class:`FeatureShards` yields them.
        keys: the record entries to pad, one tensor of the same order each.
    """
    n = max(len(x["input_ids"]) for x in items)
    out = []
    for key in keys:
        first = items[0][key]
        padded = torch.zeros(len(items), n, *first.shape[1:], dtype=first.dtype)
        for r, x in enumerate(items):
            padded[r, : len(x[key])] = x[key]
        out.append(padded)
    return out


def collate(items, t2d: torch.Tensor, lm_head_rows: torch.Tensor, prompt_loss_weight: float = 0.0):
    """Pad ``items`` and compute target logits over the draft vocabulary and the loss mask.

    The mask is 1 where a position predicts a response token whose target argmax is in the draft vocabulary (the
    reference recipe). ``prompt_loss_weight`` > 0 also counts prompt positions, with that weight: distillation on
    the prompt text, which is free (its features are cached anyway) and broadens scarce data.

    Returns:
        dict with ``features``, ``input_ids``, ``target_logits``, ``loss_mask``.
    """
    feats, last, ids = pad_records(items, ("features", "last_hidden", "input_ids"))
    ids = ids.long()
    mask = torch.zeros(ids.shape)
    for r, x in enumerate(items):
        L = len(x["input_ids"])
        # position i predicts token i+1: count response tokens (i + 1 >= prompt_len) whose target argmax is drafted
        pos = torch.arange(L)
        drafted = (pos + 1 < L) & t2d[x["target_argmax"]]
        response = pos + 1 >= x["prompt_len"]
        mask[r, :L] = (drafted & response).float() + prompt_loss_weight * (drafted & ~response).float()
    logits = last.float() @ lm_head_rows.T
    return {"features": feats, "input_ids": ids, "target_logits": logits, "loss_mask": mask}
