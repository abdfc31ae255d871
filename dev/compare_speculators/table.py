"""The comparison's table (markdown) from what ``run.sh`` wrote in WORK_DIR.

Usage: ``python dev/compare_speculators/table.py WORK_DIR NAME=DRAFT_DIR [NAME=DRAFT_DIR ...]`` where each
DRAFT_DIR (relative to WORK_DIR) has ``eval_<dir with / as _>.json`` and, where measured,
``mtbench_<...>.json`` beside it.
"""

import json
import sys
from pathlib import Path


def row(work: Path, name: str, draft: str) -> str:
    """One table row."""
    tag = draft.replace("/", "_")
    ev = json.loads((work / f"eval_{tag}.json").read_text())
    chain = ev["chain"]
    per_position = " / ".join(f"{a:.3f}" for a in chain["acceptance_rate_per_position"])
    mt = work / f"mtbench_{tag}.json"
    decoded = "-"
    if mt.exists():
        m = json.loads(mt.read_text())
        decoded = (f"{m['mean_acceptance_length']:.3f} ("
                   + " / ".join(f"{a:.3f}" for a in m["acceptance_rate_per_position"]) + ")")
    return (f"| {name} | {chain['mean_acceptance_length']:.3f} | {per_position} | "
            f"{' / '.join(f'{a:.3f}' for a in ev['acc'][:3])} | {decoded} |")


def main() -> None:
    work = Path(sys.argv[1])
    print("| draft | held-out replay AL (k=5) | replay acceptance per position | TTT accuracy, steps 1-3 | "
          "MT-bench decoded AL (k=5), per position |")
    print("| --- | ---: | --- | --- | --- |")
    for spec in sys.argv[2:]:
        name, draft = spec.split("=", 1)
        print(row(work, name, draft))


if __name__ == "__main__":
    main()
