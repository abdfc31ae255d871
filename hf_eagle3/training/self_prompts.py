"""Prompts written by the target itself (the Magpie recipe) for ``hf-eagle3 prepare --self-prompts N``.

An instruction-tuned target, given its chat template up to the start of a user turn and nothing else, writes a
user's message: the kind of request it was trained to answer. Sampling many of them gives a prompt set in the
target's own distribution, without any dataset. :func:`write_self_prompts` samples them (seeded), drops the
degenerate ones (:class:`PromptFilter`), deduplicates them (against each other and the prompts already in the
output file, so a rerun appends until there are enough), keeps out anything that overlaps an evaluation set
(:class:`EvalOverlap`), and writes the ``{"id", "prompt"}`` JSONL that ``prepare`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

_MARK = "\u27e6hf-eagle3-user-turn-7f3a\u27e7"  # a string no template writes itself


def normalize_prompt(text: str) -> str:
    """The form prompts are compared in: lower case, runs of whitespace as one space, punctuation and whitespace at
    both ends stripped.

    Args:
        text: a prompt.
    """
    text = re.sub(r"\s+", " ", text.lower())
    start, end = 0, len(text)
    while start < end and _is_edge(text[start]):
        start += 1
    while end > start and _is_edge(text[end - 1]):
        end -= 1
    return text[start:end]


def _is_edge(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch).startswith(("P", "S"))


@dataclass
class PromptFilter:
    """What makes a self-written prompt degenerate; :meth:`reason` names the first rule a prompt breaks.

    Args:
        min_chars: fewer characters than this (after stripping) is too short.
        max_chars: more characters than this is too long.
        min_letter_ratio: the share of letters among the non-space characters must reach this.
        ngram: length, in words, of the repeated phrases looked for.
        max_ngram_repeats: a phrase of ``ngram`` words seen more often than this is a loop.
        markers: strings that must not appear (the chat template's role markers and special tokens).
    """

    min_chars: int = 16
    max_chars: int = 2000
    min_letter_ratio: float = 0.6
    ngram: int = 3
    max_ngram_repeats: int = 3
    markers: tuple[str, ...] = field(default_factory=tuple)

    def reason(self, text: str) -> str | None:
        """Why ``text`` is rejected (``"too short"``, ``"too long"``, ``"few letters"``, ``"repeats"``,
        ``"role marker"``), or ``None`` when it is kept.

        Args:
            text: the decoded prompt, already cut at the end of the user turn.
        """
        text = text.strip()
        if len(text) < self.min_chars:
            return "too short"
        if len(text) > self.max_chars:
            return "too long"
        if any(m and m in text for m in self.markers):
            return "role marker"
        visible = [c for c in text if not c.isspace()]
        if sum(c.isalpha() for c in visible) < self.min_letter_ratio * len(visible):
            return "few letters"
        words = re.findall(r"\w+", text.lower())
        grams = Counter(tuple(words[i : i + self.ngram]) for i in range(len(words) - self.ngram + 1))
        if grams and max(grams.values()) > self.max_ngram_repeats:
            return "repeats"
        return None


class EvalOverlap:
    """Tells whether a prompt overlaps an evaluation set: the same normalised text, or a normalised span of ``span``
    characters in common with one of its prompts.

    Args:
        texts: the evaluation prompts (every turn of each question).
        span: length of the shared span, in normalised characters, that counts as overlap.
    """

    def __init__(self, texts: Iterable[str], span: int = 50):
        self.span = span
        self.exact: set[str] = set()
        self.windows: set[int] = set()  # hashes of every span-long window of the normalised texts
        for text in texts:
            norm = normalize_prompt(text)
            if not norm:
                continue
            self.exact.add(norm)
            self.windows.update(hash(norm[i : i + span]) for i in range(len(norm) - span + 1))

    def __len__(self) -> int:
        return len(self.exact)

    def matches(self, text: str) -> bool:
        """Whether ``text`` equals an evaluation prompt or shares a ``span``-character span with one (normalised).

        Args:
            text: a candidate prompt.
        """
        norm = normalize_prompt(text)
        if norm in self.exact:
            return True
        return any(hash(norm[i : i + self.span]) in self.windows for i in range(len(norm) - self.span + 1))


def read_exclude_prompts(path: str | os.PathLike) -> list[str]:
    """Every prompt text of an evaluation JSONL: all ``turns`` of MT-bench-style lines, or the ``prompt`` field.

    Args:
        path: the JSONL file (for example ``mt_bench.jsonl``, FastChat's MT-bench ``question.jsonl``).
    """
    texts = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            obj = json.loads(line)
            turns = obj.get("turns")
            found = [t for t in turns if isinstance(t, str)] if isinstance(turns, list) else []
            if isinstance(obj.get("prompt"), str):
                found.append(obj["prompt"])
            if not found:
                raise ValueError(f"{path}:{i + 1}: no 'turns' or 'prompt' field")
            texts += found
    return texts


@dataclass
class UserTurn:
    """Where a user's message goes in the target's chat template.

    Args:
        prefix: the rendered conversation up to the user's text (an injected system prompt included).
        suffix: what the template writes right after the user's text (the end of the turn).
        stop_ids: token ids that end the user turn (the special token that starts ``suffix``, and eos).
        markers: role markers and special tokens that a real user message does not contain.
    """

    prefix: str
    suffix: str
    stop_ids: list[int]
    markers: tuple[str, ...]


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def user_turn(tokenizer, eos_token_id=None) -> UserTurn:
    """Find the start and the end of a user turn in ``tokenizer``'s chat template (a user message holding a unique
    marker is rendered, and cut at the marker).

    Args:
        tokenizer: the target's tokenizer, with a chat template.
        eos_token_id: the target's eos id(s) (from its generation config), also ends of a turn.

    Raises:
        ValueError: the tokenizer has no chat template, or its rendering does not contain the user's text.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template, so the target cannot be asked to write a user's "
                         "message: use a chat (instruction-tuned) target, or give a prompts file (--prompts) instead "
                         "of --self-prompts.")
    text = _render(tokenizer, [{"role": "user", "content": _MARK}])
    if text.count(_MARK) != 1:
        raise ValueError("the chat template does not render the user's message verbatim once; give a prompts file "
                         "(--prompts) instead of --self-prompts.")
    prefix, suffix = text.split(_MARK)
    special = [t for t in tokenizer.all_special_tokens if t]
    stop: list[int] = []
    suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix.strip() else []
    if suffix_ids and suffix_ids[0] in set(tokenizer.all_special_ids):
        stop.append(suffix_ids[0])
    eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
    for e in eos if isinstance(eos, (list, tuple)) else [eos]:
        if e is not None and e not in stop:
            stop.append(int(e))
    markers = set(special) | {suffix.strip()}
    try:  # the headers of a user and an assistant turn, without the system prompt a template injects
        with_answer = _render(tokenizer, [{"role": "user", "content": _MARK}], add_generation_prompt=True)
        markers.add(with_answer.split(_MARK, 1)[1][len(suffix):].strip())
        three = _render(tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": _MARK},
                                    {"role": "user", "content": _MARK + "2"}])
        between = three.split(_MARK)[1]
        markers.add(between.strip())
    except Exception:  # noqa: BLE001 - templates that refuse these conversations: the special tokens remain
        pass
    return UserTurn(prefix, suffix, stop, tuple(sorted(m for m in markers if m)))


def _read_existing(path: Path) -> list[tuple[str, dict]]:
    """The complete lines of an existing prompts file, as ``(line, object)``."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                rows.append((line, obj))
    return rows


def _write_atomically(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def count_prompts(path: str | os.PathLike) -> int:
    """How many prompts a prompts file holds (0 when it does not exist).

    Args:
        path: the JSONL file.
    """
    return len(_read_existing(Path(path)))


@dataclasses.dataclass
class _PromptKeeper:
    """Which sampled user turns :func:`write_self_prompts` keeps: finished, not degenerate, new and not overlapping
    the evaluation prompts (``seen`` and ``rejected`` are updated as it goes)."""

    tokenizer: object
    turn: object
    prompt_filter: PromptFilter
    overlap: EvalOverlap
    seen: set
    rejected: Counter

    def add(self, rows: list[list[int]], lines: list[str], seed: int, num_prompts: int) -> int:
        """Append the kept prompts of ``rows`` (sampled token ids) to ``lines`` as JSON lines, up to ``num_prompts``
        lines in all: how many were added."""
        end_text = self.turn.suffix.strip()
        added = 0
        for row in rows:
            cut = next((j for j, t in enumerate(row) if t in self.turn.stop_ids), None)
            text = self.tokenizer.decode(row if cut is None else row[:cut], skip_special_tokens=False)
            if end_text and end_text in text:  # a turn end the template writes as plain text
                text, cut = text.split(end_text, 1)[0], 0
            if cut is None:
                self.rejected["unfinished"] += 1
                continue
            text = text.strip()
            why = self.prompt_filter.reason(text)
            norm = normalize_prompt(text)
            if why is None and norm in self.seen:
                why = "duplicate"
            if why is None and self.overlap.matches(text):
                why = "eval overlap"
            if why is not None:
                self.rejected[why] += 1
                continue
            self.seen.add(norm)
            lines.append(json.dumps({"id": f"self-{seed}-{len(lines)}", "source": "self", "prompt": text}))
            added += 1
            if len(lines) >= num_prompts:
                break
        return added


def write_self_prompts(
    target,
    tokenizer,
    num_prompts: int,
    out_path: str | os.PathLike,
    *,
    seed: int = 0,
    exclude_prompts: Iterable[str] = (),
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    prompt_filter: PromptFilter | None = None,
    overlap_span: int = 50,
    max_samples: int | None = None,
    progress: bool = True,
) -> Path:
    """Have ``target`` write user prompts of its own (Magpie) until ``out_path`` holds ``num_prompts`` of them.

    The chat template is rendered up to the start of a user turn and the target samples the user's message until it
    ends the turn. Prompts that never end the turn within ``max_new_tokens``, degenerate ones (``prompt_filter``),
    duplicates (normalised: :func:`normalize_prompt`) of each other or of any prompt already in ``out_path``, and
    prompts that overlap ``exclude_prompts`` (:class:`EvalOverlap`) are dropped. Lines
    ``{"id": "self-<seed>-<n>", "source": "self", "prompt": ...}`` are appended (``n``: the line's index), the
    file being replaced atomically after each batch, so an interrupted or shorter earlier run is continued. The same
    seed, target and starting file give the same prompts.

    Args:
        target: the chat target (a ``PreTrainedModel``).
        tokenizer: its tokenizer, with a chat template.
        num_prompts: how many prompts ``out_path`` should hold in the end.
        out_path: the JSONL file (created, or continued).
        seed: sampling seed.
        exclude_prompts: evaluation prompts to keep out (see :func:`read_exclude_prompts`).
        temperature: sampling temperature.
        top_p: nucleus sampling threshold (1.0: off).
        max_new_tokens: most tokens of one prompt; a prompt still open after them is dropped.
        batch_size: prompts sampled per ``generate`` call.
        prompt_filter: the degenerate-prompt rules (default :class:`PromptFilter` with the template's markers).
        overlap_span: normalised characters in common with an excluded prompt that exclude a prompt.
        max_samples: stop after sampling this many (default ``max(64, 20 * missing)``), keeping what was found.
        progress: print one line per batch.

    Returns:
        ``out_path`` as a ``Path``.

    Raises:
        ValueError: the tokenizer has no usable chat template (raised before any file is written).
    """
    turn = user_turn(tokenizer, getattr(getattr(target, "generation_config", None), "eos_token_id", None))
    if num_prompts < 0 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"num_prompts {num_prompts}, batch_size {batch_size}, max_new_tokens {max_new_tokens}: "
                         "need num_prompts >= 0 and the others >= 1.")
    if prompt_filter is None:
        prompt_filter = PromptFilter()
    if not prompt_filter.markers:
        prompt_filter = dataclasses.replace(prompt_filter, markers=turn.markers)
    out = Path(out_path)
    existing = _read_existing(out)
    lines = [line for line, _ in existing]
    seen = {normalize_prompt(obj["prompt"]) for _, obj in existing}
    missing = num_prompts - len(lines)
    if missing <= 0:
        return out
    overlap = EvalOverlap(exclude_prompts, overlap_span)
    budget = max_samples if max_samples is not None else max(64, 20 * missing)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix_ids = tokenizer(turn.prefix, add_special_tokens=False)["input_ids"]
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else turn.stop_ids[0] if turn.stop_ids else 0
    rejected: Counter = Counter()
    sampled = 0
    # The stream depends on the seed and on how many prompts the file held: a continued run samples new ones.
    stream_seed = (seed * 1_000_003 + len(lines)) % (2**63)
    cuda = [device] if device.type == "cuda" else []
    keeper = _PromptKeeper(tokenizer, turn, prompt_filter, overlap, seen, rejected)
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(stream_seed)
        while len(lines) < num_prompts and sampled < budget:
            n = min(batch_size, budget - sampled)
            ids = torch.tensor([prefix_ids] * n, dtype=torch.long, device=device)
            with torch.inference_mode():
                gen = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
                                      eos_token_id=turn.stop_ids or None, pad_token_id=pad)
            sampled += n
            added = keeper.add(gen[:, len(prefix_ids) :].tolist(), lines, seed, num_prompts)
            if added:
                _write_atomically(out, lines)
            if progress:
                print(f"self prompts: {len(lines)}/{num_prompts} in {out} ({sampled} sampled; rejected "
                      f"{dict(rejected) or 'none'})", flush=True)
    if len(lines) < num_prompts:
        print(f"self prompts: only {len(lines)} of {num_prompts} after {sampled} samples (rejected {dict(rejected)}); "
              "rerun to continue, or raise max_samples / lower the temperature.", flush=True)
    return out
