"""Regenerate training responses with the target model itself (EAGLE-3 data recipe).

Prompts come from a JSONL file (one ``{"id", "prompt"}`` object per line).  Each prompt is formatted with the
target's chat template and answered by the target (greedy by default), in batches with left padding.  Results go
to ``out_dir/responses-*.jsonl`` as ``{"id", "prompt_ids", "response_ids"}``; a rerun skips prompts already done,
so an interrupted run resumes where it stopped.

With ``features_dir``, the same generation also writes the draft's training features (what
:func:`hf_eagle3.training.features.cache_features` computes with a second pass over the data): the target computes
every position's hidden states while it answers anyway, so hooks keep them, at the cost of one forward fewer per
record. Each batch becomes one feature shard; the last token of a response (never fed back) is left out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable

import torch
from transformers import LogitsProcessor, LogitsProcessorList


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


def _own_files(directory: Path, prefix: str, suffix: str) -> list[Path]:
    """Files ``{prefix}NNNNN{suffix}`` of ``directory`` (``prefix`` "responses-" does not match "responses-p1-...")."""
    return [p for p in directory.glob(f"{prefix}*{suffix}") if p.name[len(prefix) : -len(suffix)].isdigit()]


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
    features_dir: str | os.PathLike | None = None,
    layer_ids: list[int] | None = None,
    feature_dtype=None,
    max_feature_prompt_tokens: int | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> Path:
    """Answer the prompts of ``prompts_path`` with ``model`` and store token ids in ``out_dir`` (resumable).

    Several processes (one per GPU) can share the work: each is given ``num_shards`` and its own ``shard_index``,
    answers every ``num_shards``-th prompt from ``shard_index`` on, and writes files of its own
    (``responses-p{shard_index}-*.jsonl``, ``shard-p{shard_index}-*.pt``) into the same directories.

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
        features_dir: also write feature shards (the format of ``cache_features``) there, captured during generation.
        layer_ids: the three capture indices (input of layer i); default ``[2, N // 2, N - 3]``.
        feature_dtype: storage dtype of the features (default bfloat16).
        max_feature_prompt_tokens: keep only the last this-many prompt positions of each record in the shards.
        num_shards: number of processes sharing the prompts (1: this one does all).
        shard_index: this process's share, ``0 <= shard_index < num_shards``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    if not (isinstance(num_shards, int) and num_shards >= 1 and 0 <= shard_index < num_shards):
        raise ValueError(f"shard_index {shard_index} / num_shards {num_shards}: need num_shards >= 1 and "
                         "0 <= shard_index < num_shards (one index per process).")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_prompts(prompts_path, max_prompts)[shard_index::num_shards]
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
    if not batches:  # everything answered already: write nothing (no empty shard, no features directory)
        return out
    part = f"p{shard_index}-" if num_shards > 1 else ""  # file names of this process's share
    prefix = f"responses-{part}"
    shard = out / f"{prefix}{len(_own_files(out, prefix, '.jsonl')):05d}.jsonl"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="prepare", unit="prompt")
    torch.manual_seed(seed + shard_index)
    device = next(model.parameters()).device
    n_tokens, t0 = 0, time.perf_counter()
    recorder, extra = None, {}
    if features_dir is not None:
        recorder = _GenerationFeatureRecorder(model, features_dir, layer_ids, feature_dtype or torch.bfloat16,
                                              max_feature_prompt_tokens,
                                              prefix=f"shard-{part}")
        extra = {"logits_processor": LogitsProcessorList([recorder])}
    try:
        with open(shard, "a") as f:
            for batch in batches:
                width = max(len(ids) for _, ids in batch)
                input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, (_, ids) in enumerate(batch):
                    input_ids[i, width - len(ids) :] = torch.tensor(ids)
                    mask[i, width - len(ids) :] = 1
                with torch.inference_mode():
                    if recorder is not None:
                        recorder.start()
                    gen = model.generate(
                        input_ids.to(device),
                        attention_mask=mask.to(device),
                        max_new_tokens=max_new_tokens,
                        do_sample=do_sample,
                        temperature=temperature if do_sample else None,
                        top_p=None,
                        top_k=None,
                        pad_token_id=pad,
                        **extra,
                    )
                rows = []
                for i, (pid, ids) in enumerate(batch):
                    resp = gen[i, width:].tolist()
                    for j, t in enumerate(resp):
                        if t in eos:
                            resp = resp[: j + 1]
                            break
                    n_tokens += len(resp)
                    rows.append({"id": pid, "prompt_ids": ids, "response_ids": resp})
                if recorder is not None:  # the shard first: a crash in between regenerates the batch, never loses it
                    with torch.inference_mode():
                        recorder.write_shard(rows, width)
                for row in rows:
                    f.write(json.dumps(row) + "\n")
                f.flush()
                if bar is not None:
                    bar.update(len(batch))
                    bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.1f}")
    finally:
        if recorder is not None:
            recorder.close()
    if bar is not None:
        bar.close()
    return out


class _GenerationFeatureRecorder(LogitsProcessor):
    """Keeps, at every decoding step of a batched ``generate``, the step's captured features, final hidden states
    and the argmax of the scores (a logits processor that changes nothing), and writes them as a feature shard.

    Args:
        model: the target.
        features_dir: where the shards go (with ``target_head.pt`` and ``meta.json``).
        layer_ids: the three capture indices, or ``None`` for ``[2, N // 2, N - 3]``.
        dtype: storage dtype.
        max_prompt_tokens: prompt positions kept per record (the last ones), or ``None`` for all.
        prefix: shard file names are ``{prefix}NNNNN.pt`` (one prefix per process when several share the work).
    """

    def __init__(self, model, features_dir, layer_ids, dtype, max_prompt_tokens, prefix: str = "shard-"):
        from ..core.configuration_eagle3 import default_feature_layer_ids
        from ..core.feature_capture import Eagle3FeatureCapture, find_decoder_layers
        from .features import save_target_head

        if layer_ids is None:
            layer_ids = default_feature_layer_ids(len(find_decoder_layers(model)))
        self.layer_ids = list(layer_ids)
        self.capture = Eagle3FeatureCapture(model, self.layer_ids)  # checks the ids before anything is written
        self.out = Path(features_dir)
        self.prefix = prefix
        meta = self.out / "meta.json"
        if meta.exists() and json.loads(meta.read_text()).get("layer_ids") != self.layer_ids:
            raise ValueError(f"{meta} was written with other layer ids than {self.layer_ids}: use another features_dir.")
        self.out.mkdir(parents=True, exist_ok=True)
        if not (self.out / "target_head.pt").exists():
            save_target_head(model, self.out)
        tmp = self.out / f"meta.{os.getpid()}.tmp"  # several processes may share the directory: replace atomically
        tmp.write_text(json.dumps({"layer_ids": self.layer_ids}))
        tmp.replace(meta)
        self.dtype, self.max_prompt_tokens = dtype, max_prompt_tokens
        self.lm_head = model.get_output_embeddings()
        self._final = None
        self._handle = None
        try:
            self.capture.install()
            self._handle = model.base_model.register_forward_hook(self._keep_final)
        except BaseException:
            self.close()
            raise
        self.start()

    def _keep_final(self, module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state
        self._final = hidden.detach()

    def start(self) -> None:
        """Forget the previous batch."""
        self.features, self.finals, self.argmax = [], [], []
        self.capture.clear()

    def __call__(self, input_ids, scores):
        feats = self.capture.features(device="cpu", dtype=self.dtype)
        if feats is None or self._final is None:
            raise RuntimeError("the feature hooks saw no forward before this decoding step")
        self.features.append(feats)
        self.finals.append(self._final.to(device="cpu", dtype=self.dtype))
        self.argmax.append(scores.argmax(-1).cpu())
        self.capture.clear()
        self._final = None
        return scores

    def write_shard(self, rows: list[dict], width: int) -> Path:
        """Write the batch's records (``rows``, left padded to ``width`` prompt positions) as the next shard."""
        feats = torch.cat(self.features, dim=1)  # positions 0 .. width + steps - 2 (the last token is never fed)
        finals = torch.cat(self.finals, dim=1)
        step_argmax = torch.stack(self.argmax, dim=1)  # argmax at positions width - 1 .. width + steps - 2
        fed = feats.shape[1]
        items = []
        for i, row in enumerate(rows):
            p = len(row["prompt_ids"])
            seq = row["prompt_ids"] + row["response_ids"]
            pad = width - p
            n = min(len(seq), fed - pad)  # positions with features
            keep = p if self.max_prompt_tokens is None else min(p, self.max_prompt_tokens)
            first = p - keep
            span = slice(pad + first, pad + n)
            final = finals[i, span]
            # argmax at row position t >= p - 1 comes from decoding step t - (p - 1); before that, from the
            # prompt positions' final hidden states (generate computes no logits there).
            pos = torch.arange(first, n)
            stepped = pos >= p - 1
            argmax = torch.empty(n - first, dtype=torch.int32)
            argmax[stepped] = step_argmax[i, pos[stepped] - (p - 1)].to(torch.int32)
            if not bool(stepped.all()):
                head = self.lm_head.weight
                logits = self.lm_head(final[~stepped].to(head.device, head.dtype))
                argmax[~stepped] = logits.argmax(-1).to(torch.int32).cpu()
            items.append({
                "id": row["id"],
                "input_ids": torch.tensor(seq[first:n], dtype=torch.int32),
                "prompt_len": keep,
                "features": feats[i, span].clone(),
                "last_hidden": final.clone(),
                "target_argmax": argmax,
            })
        path = self.out / f"{self.prefix}{len(_own_files(self.out, self.prefix, '.pt')):05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(items, tmp)
        tmp.replace(path)
        self.start()
        return path

    def close(self) -> None:
        """Remove the hooks."""
        self.capture.remove()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
