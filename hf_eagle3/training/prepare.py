"""Regenerate training responses with the target model itself (EAGLE-3 data recipe).

Prompts come from a JSONL file (one ``{"id", "prompt"}`` object per line).  Each prompt is formatted with the
target's chat template and answered by the target (greedy by default), in batches with left padding.  Results go
to ``out_dir/responses-*.jsonl`` as ``{"id", "prompt_ids", "response_ids"}``; a rerun skips prompts already done,
so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable


def read_prompts(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """Read ``{"id", "prompt"}`` records from a JSONL file (also accepts MT-bench ``turns``)."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            obj = json.loads(line)
            prompt = obj.get("prompt") or (obj.get("turns") or [None])[0]
            if prompt is None:
                raise ValueError(f"{path}:{i + 1}: no 'prompt' (or 'turns') field")
            rows.append({"id": str(obj.get("id", obj.get("question_id", i))), "prompt": prompt})
            if limit is not None and len(rows) >= limit:
                break
    return rows


def done_ids(out_dir: str | os.PathLike) -> set[str]:
    """Return the ids of prompts already answered in ``out_dir``."""
    return {r["id"] for r in iter_records(out_dir) if "id" in r}


def _shards(out_dir: str | os.PathLike) -> list[Path]:
    """The response shards of ``out_dir``: ``responses-*.jsonl``, and gzipped ``responses-*.jsonl.gz`` archives."""
    return sorted(Path(out_dir).glob("responses-*.jsonl")) + sorted(Path(out_dir).glob("responses-*.jsonl.gz"))


def iter_records(out_dir: str | os.PathLike) -> Iterable[dict]:
    """Yield every complete ``{"id", "prompt_ids", "response_ids"}`` record written to ``out_dir``."""
    import gzip

    for shard in _shards(out_dir):
        with (gzip.open(shard, "rt") if shard.suffix == ".gz" else open(shard)) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    pass


def prepare(
    model,
    tokenizer,
    prompts_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_prompts: int | None = None,
    max_prompt_tokens: int = 512,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 0.7,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Answer the prompts of ``prompts_path`` with ``model`` and store token ids in ``out_dir`` (resumable).

    Args:
        model: the target ``PreTrainedModel`` (its own answers are the training data).
        tokenizer: its tokenizer, with a chat template.
        prompts_path: JSONL file of prompts.
        out_dir: output directory; existing shards are kept and their prompts skipped.
        max_prompts: use only the first ``max_prompts`` prompts of the file.
        max_prompt_tokens: prompts longer than this (after templating) are skipped.
        max_new_tokens: response length cap.
        batch_size: prompts per ``generate`` call (sorted by length to limit padding).
        do_sample: sample responses instead of greedy decoding.
        temperature: sampling temperature when ``do_sample``.
        seed: sampling seed.
        progress: show a tqdm progress bar.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_prompts(prompts_path, max_prompts)
    finished = done_ids(out)
    todo = []
    for r in rows:
        if r["id"] in finished:
            continue
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        if len(ids) <= max_prompt_tokens:
            todo.append((r["id"], ids))
    # Process in file order, chunk-wise sorted by length so that batches carry little padding.
    chunk = batch_size * 16
    batches = []
    for c in range(0, len(todo), chunk):
        part = sorted(todo[c : c + chunk], key=lambda x: len(x[1]))
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    shard = out / f"responses-{len(list(out.glob('responses-*.jsonl'))):05d}.jsonl"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="prepare", unit="prompt")
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    n_tokens, t0 = 0, time.perf_counter()
    with open(shard, "a") as f:
        for batch in batches:
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (_, ids) in enumerate(batch):
                input_ids[i, width - len(ids) :] = torch.tensor(ids)
                mask[i, width - len(ids) :] = 1
            with torch.inference_mode():
                gen = model.generate(
                    input_ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=do_sample,
                    temperature=temperature if do_sample else None,
                    top_p=None,
                    top_k=None,
                    pad_token_id=pad,
                )
            for i, (pid, ids) in enumerate(batch):
                resp = gen[i, width:].tolist()
                for j, t in enumerate(resp):
                    if t in eos:
                        resp = resp[: j + 1]
                        break
                n_tokens += len(resp)
                f.write(json.dumps({"id": pid, "prompt_ids": ids, "response_ids": resp}) + "\n")
            f.flush()
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.1f}")
    if bar is not None:
        bar.close()
    return out
