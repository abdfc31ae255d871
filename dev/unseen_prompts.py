"""Prompts the shipped SmolLM2-135M draft never trained on: a held-out split for runs that start from that draft.

The shipped draft trained on every answer in ``examples/data/smollm2-135m-instruct-responses``, so no split of those
files is held out from it. This script writes ``--count`` prompts of the shared prompt files whose ids no record of those
files holds, taken in turn from each source (``t0-*`` templates counted as one; each source in its file's shuffled
order, so a source that runs out leaves the turns to the others), as the JSONL ``hf-eagle3 prepare --prompts``
reads. Prompts over ``--max-chars`` characters are left out, so that all of them fit ``prepare``'s 512-token limit
and the split keeps its size and its mix (English runs about 4 characters a token; the chat template adds about 30). ``--skip`` leaves out that many of them first, so a second, disjoint set (for
training) can follow the held-out one.

Usage: ``python dev/unseen_prompts.py --shared ../shared/data --out unseen.jsonl [--count 128] [--skip 0]
[--max-chars 1600]``
(never the evaluation files: only ``chat_prompts.jsonl`` and ``train_prompts.jsonl`` are read).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "examples/data/smollm2-135m-instruct-responses"
FILES = ["chat_prompts.jsonl", "train_prompts.jsonl"]


def trained_ids(data: Path = DATA) -> set[str]:
    """The prompt ids of every record the shipped draft trained on (a sampled answer's ``#s1``/``#s2`` suffix cut)."""
    ids = set()
    for path in sorted(data.glob("responses-*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            ids.update(json.loads(line)["id"].split("#")[0] for line in f)
    return ids


def source_group(row: dict) -> str:
    """A prompt's source, the T0 templates counted as one."""
    return "t0" if row["source"].startswith("t0") else row["source"]


def unseen_prompts(shared: Path, count: int, skip: int = 0, max_chars: int = 1600) -> list[dict]:
    """The prompts ``skip`` to ``skip + count`` of the shared files that no shipped record holds and that have at most
    ``max_chars`` characters, one source a turn."""
    seen = trained_ids()
    by_source: dict[str, list[dict]] = {}
    for name in FILES:
        with open(shared / name) as f:
            for line in f:
                row = json.loads(line)
                if row["id"] not in seen and len(row["prompt"]) <= max_chars:
                    by_source.setdefault(source_group(row), []).append(row)
    out: list[dict] = []
    queues = [rows[::-1] for rows in by_source.values()]
    while any(queues):
        out.extend(q.pop() for q in queues if q)
    if len(out) < skip + count:
        raise SystemExit(f"only {len(out)} unseen prompts; ask for fewer than --skip {skip} + --count {count}")
    return out[skip:skip + count]


def main() -> None:
    """Write the unseen prompts as JSONL."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, required=True, help="folder holding chat_prompts.jsonl, train_prompts.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=128)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=1600, help="longest prompt kept, in characters")
    args = parser.parse_args()
    rows = unseen_prompts(args.shared, args.count, args.skip, args.max_chars)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources: dict[str, int] = {}
    for r in rows:
        sources[source_group(r)] = sources.get(source_group(r), 0) + 1
    print(f"{len(rows)} prompts -> {args.out}: {sources}")


if __name__ == "__main__":
    main()
