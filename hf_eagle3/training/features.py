"""Cache the target's features for draft training, in resumable shards.

For every training sequence (prompt + regenerated response) one target forward gives, per position: the three
captured hidden states (the draft's input, captured with the same hooks as at inference), the final (post-norm)
hidden state (the target's logits over the draft vocabulary are recomputed from it at training time) and the
target's argmax token (for the loss mask). Shard ``i`` holds records ``[i * per_shard, (i + 1) * per_shard)`` of
the input order, so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..feature_capture import Eagle3FeatureCapture, find_decoder_layers


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
        layer_ids: the draft's three capture indices (input of layer i).
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
