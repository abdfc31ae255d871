"""The data users have, read as conversations: one list of ``{"role", "content"}`` messages per row.

Accepted rows (JSON Lines, a JSON file holding a list of rows, a ``datasets`` folder or a Hub dataset name):

- OpenAI messages: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``, also under
  ``"conversations"``;
- ShareGPT: ``{"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}`` (``"user"`` and
  ``"assistant"`` are accepted as ``from`` too), with an optional top-level ``"system"`` prompt;
- one prompt: ``{"prompt": str}``; user turns only: ``{"turns": [str, ...]}`` (MT-bench's layout).

A row's id is its ``"id"`` (or ``"question_id"``), else its position in the source. A row that cannot be used (an
empty turn, an unknown role, no user turn, a system prompt after the first message, an id seen before, not JSON, a
byte that is not UTF-8) is a :class:`BadRow`: :func:`read_conversations` counts and skips it and says why in its
:class:`ReadSummary`, so that a long job never stops halfway on one bad row. Rows the target's chat template cannot
render are counted the same way by :func:`check_template`. A UTF-8 byte order mark before a row is read past.
"""

from __future__ import annotations

import codecs
import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
"""Accepted role names (OpenAI ``role`` and ShareGPT ``from``) and the role each one is."""


class BadRow(ValueError):
    """A row that cannot be read as a conversation; the message says why (it names the row's kind of fault)."""


@dataclass
class ReadSummary:
    """What :func:`read_conversations` kept and skipped.

    Args:
        read: rows seen.
        kept: conversations returned.
        skipped: reasons (the :class:`BadRow` messages) and how many rows each skipped.
        first: the first row skipped for each reason, as ``"source:row"``.
    """

    read: int = 0
    kept: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    first: dict = field(default_factory=dict)

    def skip(self, where: str, reason: str) -> None:
        """Count one skipped row."""
        self.skipped[reason] += 1
        self.first.setdefault(reason, where)

    def lines(self) -> list[str]:
        """The summary as printable lines (one per reason skipped)."""
        out = [f"{self.kept} conversation(s) of {self.read} row(s) read"
               + (f", {sum(self.skipped.values())} skipped:" if self.skipped else "")]
        out += [f"  {n} x {reason} (first: {self.first[reason]})" for reason, n in self.skipped.most_common()]
        return out


def to_conversation(row, index: int) -> dict:
    """One row as ``{"id": str, "messages": [{"role", "content"}, ...]}``; raises :class:`BadRow` if it cannot be.

    Args:
        row: the row (a dict, in one of the layouts of this module's docstring).
        index: its position in the source (its id when it has none).
    """
    if not isinstance(row, dict):
        raise BadRow(f"not an object ({type(row).__name__})")
    rid = row.get("id", row.get("question_id", index))
    turns = next((row[k] for k in ("messages", "conversations") if row.get(k) is not None), None)
    if turns is not None:
        if not isinstance(turns, list):
            raise BadRow("'messages' / 'conversations' is not a list")
        messages = []
        if isinstance(row.get("system"), str) and row["system"].strip():
            messages.append({"role": "system", "content": row["system"]})
        for turn in turns:
            if not isinstance(turn, dict):
                raise BadRow("a turn is not an object")
            role = turn.get("role", turn.get("from"))
            content = turn.get("content", turn.get("value"))
            if role not in ROLES:
                raise BadRow(f"unknown role {role!r} (known: {', '.join(ROLES)})")
            messages.append({"role": ROLES[role], "content": content})
    elif row.get("prompt") is not None:
        messages = [{"role": "user", "content": row["prompt"]}]
    elif row.get("turns") is not None:
        if not isinstance(row["turns"], list):
            raise BadRow("'turns' is not a list")
        messages = [{"role": "user", "content": t} for t in row["turns"]]
    else:
        raise BadRow("no 'messages', 'conversations', 'prompt' or 'turns' field")
    for m in messages:
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise BadRow(f"empty {m['role']} turn")
    if any(m["role"] == "system" for m in messages[1:]):
        raise BadRow("a system prompt after the first message")
    if not any(m["role"] == "user" for m in messages):
        raise BadRow("no user turn")
    return {"id": str(rid), "messages": messages}


def _rows(source: str | os.PathLike, split: str):
    """Yield ``(where, row)`` pairs of ``source`` (a row that is not JSON comes as ``(where, BadRow)``)."""
    path = Path(source)
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # a byte order mark is no part of the first row
        if path.suffix == ".json" or raw.lstrip().startswith(b"["):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                line = raw[: err.start].count(b"\n") + 1
                raise ValueError(f"{path}:{line}: byte 0x{raw[err.start]:02x} is not UTF-8 text, and a JSON document "
                                 "is read whole: re-save it as UTF-8 (or give one row a line as .jsonl, where such a "
                                 "row is skipped)") from None
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not a JSON document ({err}); give one row a line as .jsonl") from None
            if isinstance(data, dict):  # {"data": [...]} or a single conversation
                data = next((v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)), [data])
            for i, row in enumerate(data):
                yield f"{path}:row {i}", row
            return
        for i, line in enumerate(raw.splitlines()):  # bytes: a bad byte spoils its own row only
            if not line.strip():
                continue
            try:
                text = line.removeprefix(codecs.BOM_UTF8).decode("utf-8")
            except UnicodeDecodeError:
                yield f"{path}:{i + 1}", BadRow("not UTF-8 text (re-save the file as UTF-8)")
                continue
            try:
                yield f"{path}:{i + 1}", json.loads(text)
            except json.JSONDecodeError:
                yield f"{path}:{i + 1}", BadRow("not JSON")
        return
    if path.suffix in (".jsonl", ".json") and not path.exists():
        raise FileNotFoundError(f"{path}: no such file.")
    if path.is_file():
        raise ValueError(f"{path}: give a .jsonl or .json file, a `datasets` folder or a Hub dataset name.")
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{source} is not a .jsonl / .json file: reading a dataset folder or Hub name needs the "
                          "`datasets` package (pip install 'hf-eagle3[data]').") from None
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        data = datasets.load_from_disk(str(path))  # written by Dataset.save_to_disk
    else:  # a folder of data files, or a Hub name
        data = datasets.load_dataset(str(source), split=split)
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{source} has no split {split!r} (it has {', '.join(data)}): pass --split.")
        data = data[split]
    for i, row in enumerate(data):
        yield f"{source}:row {i}", row


def read_conversations(source: str | os.PathLike, limit: int | None = None, split: str = "train",
                       ) -> tuple[list[dict], ReadSummary]:
    """Read the conversations of ``source``, skipping (and counting) rows that cannot be used.

    Args:
        source: a ``.jsonl`` or ``.json`` file, a folder (``Dataset.save_to_disk`` output, or data files
            ``datasets.load_dataset`` reads) or a Hugging Face Hub dataset name (those two need ``datasets``).
        limit: keep at most this many conversations (the first ones).
        split: the split of a dataset folder or Hub dataset.

    Returns:
        ``(conversations, summary)``: ``{"id", "messages"}`` dicts in source order and a :class:`ReadSummary`.
    """
    summary = ReadSummary()
    out, seen = [], set()
    for where, row in _rows(source, split):
        if limit is not None and len(out) >= limit:
            break
        summary.read += 1
        try:
            if isinstance(row, BadRow):
                raise row
            conversation = to_conversation(row, summary.read - 1)
            if conversation["id"] in seen:  # its turns would be taken for the first one's on a resume
                raise BadRow("an id seen before (ids name a conversation's answers on disk)")
            seen.add(conversation["id"])
            out.append(conversation)
        except BadRow as bad:
            summary.skip(where, str(bad))
    summary.kept = len(out)
    return out, summary


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template.

    Args:
        tokenizer: the target's tokenizer, with a chat template.
        messages: ``{"role", "content"}`` dicts.
        add_generation_prompt: end with the template's opening of an assistant turn.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def turn_messages(conversation: dict, turn: int, answers: list[str]) -> list[dict]:
    """The messages the target answers at user turn ``turn`` when every answer is its own: the system prompt (if
    any), then user turns ``0 .. turn``, each before ``turn`` followed by its answer from ``answers`` (the data's
    own assistant turns are left out).

    Args:
        conversation: ``{"id", "messages"}`` from :func:`to_conversation`.
        turn: which user turn is answered (0-based).
        answers: the answers to user turns ``0 .. turn - 1``, as text.
    """
    messages = [m for m in conversation["messages"] if m["role"] == "system"]
    users = [m for m in conversation["messages"] if m["role"] == "user"]
    for t in range(turn + 1):
        messages.append(users[t])
        if t < turn:
            messages.append({"role": "assistant", "content": answers[t]})
    return messages


def user_turns(conversation: dict) -> int:
    """How many user turns ``conversation`` has (each gets an answer when answers are regenerated)."""
    return sum(m["role"] == "user" for m in conversation["messages"])


def given_answers(conversation: dict) -> list[int]:
    """Indices of the messages that are answers given in the data: assistant turns after a user turn."""
    seen_user, out = False, []
    for j, m in enumerate(conversation["messages"]):
        seen_user = seen_user or m["role"] == "user"
        if m["role"] == "assistant" and seen_user:
            out.append(j)
    return out


def check_template(tokenizer, conversation: dict, regenerate: bool = True) -> None:
    """Raise :class:`BadRow` if the chat template cannot render ``conversation`` as training uses it (with
    ``regenerate``: every user turn followed by an answer; else: its messages as given, and it must hold an answer).

    Args:
        tokenizer: the target's tokenizer.
        conversation: ``{"id", "messages"}``.
        regenerate: whether the target answers every user turn (else the data's answers are used).
    """
    if regenerate:
        n = user_turns(conversation)
        messages = turn_messages(conversation, n - 1, ["..."] * n) + [{"role": "assistant", "content": "..."}]
    else:
        if not given_answers(conversation):
            raise BadRow("no assistant answer to use (--answers given)")
        messages = conversation["messages"]
    try:
        render(tokenizer, messages, add_generation_prompt=False)
    except Exception as err:  # templates raise what their authors chose (jinja2 TemplateError, ValueError, ...)
        raise BadRow(f"the chat template cannot render it ({type(err).__name__}: {str(err)[:80]})") from None
