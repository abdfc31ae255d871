"""Training answers from the target model itself (the EAGLE-3 data recipe), for every turn of the users' data.

The data (see :mod:`hf_eagle3.training.conversations`: one-prompt JSONL, OpenAI messages, ShareGPT, JSON or
JSONL, a ``datasets`` folder or Hub name) is read as conversations. By default the target answers every user turn
in order, each turn seeing its own earlier answers (the data's assistant turns are dropped), through its chat
template with the system prompt, greedy unless told otherwise, in batches with left padding. With
``answers="given"`` the data's own assistant turns are taken as they are (off-policy: lower acceptance).

Every answered turn is a record in ``out_dir/responses-*.jsonl``: ``{"id", "turn", "prompt_ids",
"response_ids"}``; the prompt holds the conversation up to the turn, so the loss (on response tokens only) falls on
assistant tokens only, each once. A rerun skips the turns already answered, so an interrupted run resumes where it
stopped; rows that cannot be used are counted, skipped and summarised, never fatal.

With ``features_dir``, the same generation also writes the draft's training features (what
:func:`hf_eagle3.training.features.cache_features` computes with a second pass over the data): the target computes
every position's hidden states while it answers anyway, so hooks keep them, at the cost of one forward fewer per
record. Each batch becomes one feature shard; the last token of a response (never fed back) is left out. A batch's
responses and its shard are one commit (the shard is written under a pending name, then the responses, then the shard
is renamed into place), and a rerun drops, and reports, a half that was left without the other by a kill.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Iterable

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from .conversations import BadRow, check_template, given_answers, read_conversations, render, turn_messages, user_turns

ANSWERS = ("regenerate", "given")
"""Where the answers come from: the target (the default and the recipe) or the data."""


def done_turns(out_dir: str | os.PathLike) -> dict[tuple[str, int], list[int]]:
    """The turns already answered in ``out_dir``: ``{(id, turn): response_ids}`` (records without a turn are 0)."""
    return {(r["id"], r.get("turn", 0)): r["response_ids"] for r in iter_records(out_dir) if "id" in r}


def _shards(out_dir: str | os.PathLike) -> list[Path]:
    """The response shards of ``out_dir``: ``responses-*.jsonl``, and gzipped ``responses-*.jsonl.gz`` archives."""
    return sorted(Path(out_dir).glob("responses-*.jsonl")) + sorted(Path(out_dir).glob("responses-*.jsonl.gz"))


def _own_files(directory: Path, prefix: str, suffix: str) -> list[Path]:
    """Files ``{prefix}NNNNN{suffix}`` of ``directory`` (``prefix`` "responses-" does not match "responses-p1-...")."""
    return [p for p in directory.glob(f"{prefix}*{suffix}") if p.name[len(prefix) : -len(suffix)].isdigit()]


def _next_file(directory: Path, prefix: str, suffix: str) -> Path:
    """The next free ``{prefix}NNNNN{suffix}`` of ``directory``: one past the highest number there (a file dropped
    from the middle never gets its number reused by a file that would then overwrite a later one)."""
    numbers = [int(p.name[len(prefix) : -len(suffix)]) for p in _own_files(directory, prefix, suffix)]
    return directory / f"{prefix}{max(numbers, default=-1) + 1:05d}{suffix}"


PENDING = ".pending"
"""Suffix of a feature shard written but not yet committed (renamed into place once its responses are on disk)."""


def _record_keys(path: Path) -> list[tuple[str, int]] | None:
    """The ``(id, turn)`` of every record of feature shard ``path`` (memory-mapped: no tensor is read), or ``None``
    when it cannot be read (a write that was cut)."""
    try:
        items = torch.load(path, weights_only=False, mmap=True)
    except Exception:  # a shard whose write was cut: torch raises what its reader hits (RuntimeError, EOFError, ...)
        return None
    return [(item["id"], item.get("turn", 0)) for item in items]


def _drop_unpaired(out: Path, features: Path, prefix: str, shard_prefix: str, wanted: set,
                   done: dict) -> tuple[int, int]:
    """Make a batch's responses and its feature records both present or both absent again after an interrupted run,
    among this process's files; return ``(feature records dropped, responses dropped)``.

    A batch's shard is written as ``*.pt.pending`` before its responses and renamed into place after them, so a
    pending shard marks a batch that was never committed: it is removed, with its responses. A committed feature
    record that is a second copy, or whose turn is one of ``wanted`` without a response (``done``), is removed from
    its shard. The turns dropped are answered again; ``done`` is updated.

    Args:
        out: the responses directory.
        features: the feature shards' directory.
        prefix: this process's response file prefix (``"responses-"``, ``"responses-p1-"``).
        shard_prefix: this process's shard prefix (``"shard-"``, ``"shard-p1-"``).
        wanted: the ``(id, turn)`` this process answers.
        done: ``{(id, turn): response_ids}`` read from ``out``.
    """
    if not features.is_dir():
        return 0, 0
    n_features = n_responses = 0
    uncommitted = set()
    for pending in _own_files(features, shard_prefix, ".pt" + PENDING) + _own_files(features, shard_prefix, ".tmp"):
        keys = _record_keys(pending) or []
        uncommitted.update(keys)
        n_features += len(keys)
        pending.unlink()
    if uncommitted and out.is_dir():
        for path in _own_files(out, prefix, ".jsonl"):
            lines = path.read_bytes().splitlines(keepends=True)
            kept = []
            for line in lines:
                try:
                    row = json.loads(line)
                    key = (row["id"], row.get("turn", 0))
                except (ValueError, KeyError, TypeError, AttributeError):
                    kept.append(line)  # a line cut by a kill: kept as it is (readers skip it)
                    continue
                if key in uncommitted:
                    done.pop(key, None)
                    n_responses += 1
                else:
                    kept.append(line)
            if len(kept) < len(lines):
                if kept:
                    tmp = path.with_name(path.name + ".tmp")
                    tmp.write_bytes(b"".join(kept))
                    tmp.replace(path)
                else:
                    path.unlink()
    seen = set()
    for path in sorted(_own_files(features, shard_prefix, ".pt")):
        keys = _record_keys(path)
        if keys is None:
            continue
        unpaired = set()
        for j, key in enumerate(keys):
            if key in seen or (key in wanted and key not in done):
                unpaired.add(j)
            seen.add(key)
        if not unpaired:
            continue
        n_features += len(unpaired)
        items = [item for j, item in enumerate(torch.load(path, weights_only=False)) if j not in unpaired]
        if items:
            tmp = path.with_name(path.name + ".tmp")
            torch.save(items, tmp)
            tmp.replace(path)
        else:
            path.unlink()
    return n_features, n_responses


def iter_records(out_dir: str | os.PathLike) -> Iterable[dict]:
    """Yield every complete ``{"id", "turn", "prompt_ids", "response_ids"}`` record written to ``out_dir``."""
    import gzip

    for shard in _shards(out_dir):
        with (gzip.open(shard, "rt") if shard.suffix == ".gz" else open(shard)) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    pass


def _input_device(model) -> torch.device:
    """Where ``model``'s inputs go: its input embedding's device (the first device of a target spread over several
    with ``device_map``; the CPU when accelerate keeps that embedding offloaded)."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


def _cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    """``ids`` up to and including the first end-of-sequence token."""
    for j, t in enumerate(ids):
        if t in eos:
            return ids[: j + 1]
    return ids


def _given_records(tokenizer, conversation: dict, eos: set[int]) -> list[dict]:
    """The records of the data's own answers in ``conversation`` (``answers="given"``): one per assistant turn, its
    tokens those the chat template renders for it, up to the end-of-turn token."""
    records = []
    for turn, j in enumerate(given_answers(conversation)):
        messages = conversation["messages"]
        prompt = render(tokenizer, messages[:j], add_generation_prompt=True)
        full = render(tokenizer, messages[: j + 1], add_generation_prompt=False)
        if full[: len(prompt)] != prompt or len(full) == len(prompt):
            raise BadRow("the chat template renders an answer's context differently from its prompt (its tokens "
                         "cannot be told apart); regenerate the answers instead")
        records.append({"id": conversation["id"], "turn": turn, "prompt_ids": prompt,
                        "response_ids": _cut_at_eos(full[len(prompt) :], eos)})
    return records


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
    answers: str = "regenerate",
    split: str = "train",
    log=print,
) -> Path:
    """Answer every user turn of the conversations in ``prompts_path`` with ``model`` and store token ids in
    ``out_dir`` (resumable).

    Several processes (one per GPU) can share the work: each is given ``num_shards`` and its own ``shard_index``,
    answers every ``num_shards``-th conversation from ``shard_index`` on, and writes files of its own
    (``responses-p{shard_index}-*.jsonl``, ``shard-p{shard_index}-*.pt``) into the same directories.

    Args:
        model: the target ``PreTrainedModel`` (its own answers are the training data).
        tokenizer: its tokenizer, with a chat template.
        prompts_path: the data: a ``.jsonl`` / ``.json`` file, a ``datasets`` folder or a Hub dataset name (layouts:
            :mod:`hf_eagle3.training.conversations`).
        out_dir: output directory; existing shards are kept and their turns skipped.
        max_prompts: use only the first ``max_prompts`` conversations.
        max_prompt_tokens: a turn whose templated prompt is longer than this is skipped, with the turns after it.
        max_new_tokens: answer length cap.
        batch_size: turns per ``generate`` call (sorted by length to limit padding).
        do_sample: sample the answers instead of greedy decoding.
        temperature: sampling temperature when ``do_sample``.
        seed: sampling seed.
        progress: show a tqdm progress bar.
        features_dir: also write feature shards (the format of ``cache_features``) there, captured during generation.
        layer_ids: the three capture indices (input of layer i); default ``[2, N // 2, N - 3]``.
        feature_dtype: storage dtype of the features (default bfloat16).
        max_feature_prompt_tokens: keep only the last this-many prompt positions of each record in the shards.
        num_shards: number of processes sharing the conversations (1: this one does all).
        shard_index: this process's share, ``0 <= shard_index < num_shards``.
        answers: ``"regenerate"`` (the target answers every user turn) or ``"given"`` (the data's assistant turns,
            as they are; warns, since off-policy answers lower acceptance; writes no features).
        split: the split of a ``datasets`` folder or Hub dataset.
        log: where the data summary and warnings are printed.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    _check_share_and_answers(num_shards, shard_index, answers, features_dir)
    if features_dir is not None:
        layer_ids = _feature_layer_ids(model, features_dir, layer_ids)
    regenerate = answers == "regenerate"
    usable = _usable_conversations(tokenizer, prompts_path, max_prompts, split, regenerate, log)
    if not regenerate:
        warnings.warn("answers='given' (--answers given): the data's own answers are used as they are. Answers the "
                      "target did not write are off-policy and lower the draft's acceptance; regenerate them (the "
                      "default) unless the target wrote them.", stacklevel=2)
    mine = usable[shard_index::num_shards]
    out = Path(out_dir)
    eos = _eos_ids(model)
    done = done_turns(out) if out.exists() else {}
    part = f"p{shard_index}-" if num_shards > 1 else ""  # file names of this process's share
    prefix = f"responses-{part}"
    if features_dir is not None:  # after _feature_layer_ids has checked that the directory is this run's
        wanted = {(c["id"], t) for c in mine for t in range(user_turns(c))}
        dropped = _drop_unpaired(out, Path(features_dir), prefix, f"shard-{part}", wanted, done)
        if any(dropped):
            log(f"{features_dir}: dropped {dropped[0]} feature record(s) and {dropped[1]} response(s) (in {out}) "
                "without their partner, left by an interrupted run; their turns are answered again")
    if not regenerate:
        _write_given(tokenizer, mine, done, eos, out, prefix, prompts_path, log)
        return out
    pending = sum(user_turns(c) for c in mine) - sum(1 for c in mine for t in range(user_turns(c)) if (c["id"], t) in done)
    if not pending:  # everything answered already: write nothing (no empty shard, no features directory)
        return out
    out.mkdir(parents=True, exist_ok=True)
    shard = _next_file(out, prefix, ".jsonl")
    torch.manual_seed(seed + shard_index)
    recorder = None
    if features_dir is not None:
        recorder = _GenerationFeatureRecorder(model, features_dir, layer_ids, feature_dtype or torch.bfloat16,
                                              max_feature_prompt_tokens, prefix=f"shard-{part}")
    generation = {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                  "temperature": temperature if do_sample else None, "top_p": None, "top_k": None}
    _answer_turns(model, tokenizer, mine, done, shard, eos, recorder, generation, batch_size, max_prompt_tokens,
                  pending if progress else None, log)
    return out


def _check_share_and_answers(num_shards: int, shard_index: int, answers: str, features_dir) -> None:
    """Refuse a share or an ``answers`` setting :func:`prepare` cannot honour."""
    if not (isinstance(num_shards, int) and num_shards >= 1 and 0 <= shard_index < num_shards):
        raise ValueError(f"shard_index {shard_index} / num_shards {num_shards}: need num_shards >= 1 and "
                         "0 <= shard_index < num_shards (one index per process).")
    if answers not in ANSWERS:
        raise ValueError(f"answers={answers!r}: use 'regenerate' (the target answers, the recipe) or 'given'.")
    if answers == "given" and features_dir is not None:
        raise ValueError("features are captured while the target answers; with answers='given' nothing is "
                         "generated: drop features_dir (--features-dir) and let `train` compute the features.")


def _eos_ids(model) -> set[int]:
    """The ids that end an answer (the model's generation config's ``eos_token_id``)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()


def _usable_conversations(tokenizer, prompts_path, max_prompts: int | None, split: str, regenerate: bool,
                          log) -> list[dict]:
    """The conversations of the data the chat template can render (the others counted, skipped and summarised in
    the lines given to ``log``)."""
    conversations, summary = read_conversations(prompts_path, max_prompts, split)
    usable = []
    for c in conversations:
        try:
            check_template(tokenizer, c, regenerate)
            usable.append(c)
        except BadRow as bad:
            summary.skip(f"{prompts_path}:id {c['id']}", str(bad))
    summary.kept = len(usable)
    for line in summary.lines():
        log(line)
    return usable


def _write_given(tokenizer, conversations: list[dict], done: dict, eos: set[int], out: Path, prefix: str,
                 prompts_path, log) -> None:
    """``answers="given"``: write the records of the data's own answers not written yet."""
    rows = []
    for c in conversations:
        try:
            rows += [r for r in _given_records(tokenizer, c, eos) if (r["id"], r["turn"]) not in done]
        except BadRow as bad:
            log(f"skipped {prompts_path}:id {c['id']}: {bad}")
    if rows:
        out.mkdir(parents=True, exist_ok=True)
        with open(_next_file(out, prefix, ".jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _answer_turns(model, tokenizer, conversations: list[dict], done: dict, shard: Path, eos: set[int], recorder,
                  generation: dict, batch_size: int, max_prompt_tokens: int, pending: int | None, log) -> None:
    """Answer the turns of ``conversations`` not in ``done``, turn by turn (a turn sees its conversation's earlier
    answers), batch by batch, each batch committed to ``shard`` (and, with a ``recorder``, its feature shard);
    ``pending`` turns on a progress bar (``None``: no bar). Turns skipped as too long are counted to ``log``."""
    bar = None
    if pending is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=pending, desc="prepare", unit="turn")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {} if recorder is None else {"logits_processor": LogitsProcessorList([recorder])}
    device = _input_device(model)
    n_tokens, t0, too_long = 0, time.perf_counter(), 0
    try:
        with open(shard, "a") as f:
            for turn in range(max((user_turns(c) for c in conversations), default=0)):
                todo, skipped = _turn_prompts(tokenizer, conversations, done, turn, max_prompt_tokens)
                too_long += skipped
                for batch in _length_sorted_batches(todo, batch_size):
                    gen, width = _generate(model, batch, pad, device, recorder, {**generation, **extra})
                    rows = []
                    for i, (cid, ids) in enumerate(batch):
                        resp = _cut_at_eos(gen[i, width:].tolist(), eos)
                        n_tokens += len(resp)
                        rows.append({"id": cid, "turn": turn, "prompt_ids": ids, "response_ids": resp})
                    _commit(rows, f, done, recorder, width)
                    if bar is not None:
                        bar.update(len(batch))
                        bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.1f}")
    finally:
        if recorder is not None:
            recorder.close()
        if bar is not None:
            bar.close()
    if too_long:
        log(f"{too_long} turn(s) skipped, with the turns after them: prompt longer than {max_prompt_tokens} tokens "
            "(raise --max-prompt-tokens to keep them)")
    if shard.exists() and shard.stat().st_size == 0:
        shard.unlink()  # every remaining turn was too long: leave no empty file


def _turn_prompts(tokenizer, conversations: list[dict], done: dict, turn: int,
                  max_prompt_tokens: int) -> tuple[list[tuple], int]:
    """This turn of every conversation whose earlier turns are answered (in an earlier run or round), as ``(id,
    prompt ids)``, and how many were too long."""
    todo, too_long = [], 0
    for c in conversations:
        if turn >= user_turns(c) or (c["id"], turn) in done:
            continue
        if any((c["id"], t) not in done for t in range(turn)):
            continue  # an earlier turn was skipped (too long): so are the turns after it
        history = [tokenizer.decode(done[c["id"], t], skip_special_tokens=True) for t in range(turn)]
        ids = render(tokenizer, turn_messages(c, turn, history), add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            todo.append((c["id"], ids))
        else:
            too_long += 1
    return todo, too_long


def _length_sorted_batches(todo: list[tuple], batch_size: int) -> list[list[tuple]]:
    """``todo`` in data order, chunk-wise sorted by length so that batches carry little padding."""
    chunk = batch_size * 16
    batches = []
    for s in range(0, len(todo), chunk):
        part_todo = sorted(todo[s : s + chunk], key=lambda x: len(x[1]))
        batches += [part_todo[i : i + batch_size] for i in range(0, len(part_todo), batch_size)]
    return batches


def _generate(model, batch: list[tuple], pad: int, device, recorder, generation: dict) -> tuple[torch.Tensor, int]:
    """The target's answers to a batch of ``(id, prompt ids)``, left-padded: ``(output ids, padded prompt width)``."""
    width = max(len(ids) for _, ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (_, ids) in enumerate(batch):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    with torch.inference_mode():
        if recorder is not None:
            recorder.start()
        gen = model.generate(input_ids.to(device), attention_mask=mask.to(device), pad_token_id=pad, **generation)
    return gen, width


def _commit(rows: list[dict], f, done: dict, recorder, width: int) -> None:
    """One commit per batch: the feature shard is written under a pending name, then the responses, then the shard
    is renamed into place. A rerun after a kill in between drops both halves."""
    pending_shard = None
    if recorder is not None:
        with torch.inference_mode():
            pending_shard = recorder.write_shard(rows, width)
    for row in rows:
        f.write(json.dumps(row) + "\n")
        done[row["id"], row["turn"]] = row["response_ids"]
    f.flush()
    if pending_shard is not None:
        recorder.commit(pending_shard)


def _feature_layer_ids(model, features_dir, layer_ids: list[int] | None) -> list[int]:
    """The capture indices features are written with (``layer_ids``, else ``[2, N // 2, N - 3]``); raises a
    ``ValueError`` when ``features_dir`` holds features of other layers."""
    from ..core.configuration_eagle3 import default_feature_layer_ids
    from ..core.feature_capture import find_decoder_layers

    if layer_ids is None:
        layer_ids = default_feature_layer_ids(len(find_decoder_layers(model)))
    meta = Path(features_dir) / "meta.json"
    if meta.exists() and json.loads(meta.read_text()).get("layer_ids") != list(layer_ids):
        raise ValueError(f"{meta} was written with other layer ids than {list(layer_ids)}: use another features_dir.")
    return list(layer_ids)


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
        from ..core.feature_capture import Eagle3FeatureCapture
        from .features import save_target_head

        self.layer_ids = _feature_layer_ids(model, features_dir, layer_ids)
        self.capture = Eagle3FeatureCapture(model, self.layer_ids)  # checks the ids before anything is written
        self.out = Path(features_dir)
        self.prefix = prefix
        meta = self.out / "meta.json"
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
        """Write the batch's records as the next shard, under its pending name (``shard-NNNNN.pt.pending``, which
        training never reads); :meth:`commit` puts it in place once the batch's responses are written.

        Args:
            rows: the batch's records (``{"id", "turn", "prompt_ids", "response_ids"}``).
            width: the prompt positions of the batch (prompts are left padded to it).

        Returns:
            The pending shard's path.
        """
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
                "turn": row.get("turn", 0),
                "input_ids": torch.tensor(seq[first:n], dtype=torch.int32),
                "prompt_len": keep,
                "features": feats[i, span].clone(),
                "last_hidden": final.clone(),
                "target_argmax": argmax,
            })
        pending = _next_file(self.out, self.prefix, ".pt")
        pending = pending.with_name(pending.name + PENDING)
        torch.save(items, pending)
        self.start()
        return pending

    def commit(self, pending: Path) -> Path:
        """Rename the shard :meth:`write_shard` wrote to ``pending`` into place (the batch's commit).

        Args:
            pending: what :meth:`write_shard` returned.

        Returns:
            The shard's path.
        """
        path = pending.with_name(pending.name[: -len(PENDING)])
        pending.replace(path)
        return path

    def close(self) -> None:
        """Remove the hooks."""
        self.capture.remove()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
