"""``hf-eagle3 calibrate``: time the forwards a decoding round is made of, ahead of time, into the cost table that
every ``"auto"`` call prices its rounds with (:func:`~hf_eagle3.core.cost_model.calibrate`); show, ship, load or reset
that table.

The module is light (its parser builds without torch): the command imports the cost model when it runs.
"""

from __future__ import annotations

import json
import sys


def _ints(text: str, option: str) -> tuple:
    """Comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SystemExit(f"{option} {text!r}: expected comma-separated positive integers, e.g. 1,4")
    return values


def calibrate_command(args) -> int:
    """Run ``hf-eagle3 calibrate`` from parsed arguments (see :func:`hf_eagle3.cli.add_calibrate_parser`).

    Args:
        args: the ``argparse.Namespace``.

    Returns:
        0.
    """
    from hf_eagle3.core.cost_model import calibrate, cost_table

    table = cost_table()
    if args.reset:
        table.reset()
        print(f"Forgot every cost (removed {table.path}).")
        return 0
    if args.load:
        try:
            table.load(args.load)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        print(f"Merged {args.load} into {table.save() or 'the table (in memory only)'}.")
        return 0
    if args.show:
        print(json.dumps({"path": str(table.path), "entries": {k: {str(c): v for c, v in b.items()}
                                                               for k, b in table.entries.items()}}, indent=1))
        return 0
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    contexts = _ints(args.contexts, "--contexts")
    from hf_eagle3.loading import load_pair

    target, _, draft, name, _ = load_pair(args.target, args.draft, args.dtype, args.device, tokenizer="none")
    draft.bind_target(target)
    print(f"Timing {name} with its target at contexts {contexts} for batch sizes {batch_sizes} ...", file=sys.stderr)
    calibrate(target, draft, batch_sizes=batch_sizes, contexts=contexts, save=False,
              progress=lambda line: print("  " + line, file=sys.stderr))
    written = [path for path in (table.save(), table.save(args.out) if args.out else None) if path is not None]
    print(f"Wrote {', '.join(str(p) for p in written)}." if written else "The table stays in memory (see the warning).")
    return 0


def add_calibrate_parser(subparsers):
    """Add the ``calibrate`` subcommand.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    from hf_eagle3.cli import add_model_placement, core_constant

    p = subparsers.add_parser(
        "calibrate",
        help="time a target and draft's forwards once, ahead of time, for the 'auto' budgets (or show/reset the table)",
        description="Time every forward a decoding round is made of (the target over 1 to 64 new tokens, the draft's "
        "feed and step) at two context lengths, for each batch size, and keep them in the cost table "
        "($HF_EAGLE3_CACHE/costs.json, else ~/.cache/hf_eagle3/costs.json). 'auto' calls price their rounds from it "
        "and never time anything themselves; without a table they learn the costs from their own rounds.",
    )
    p.add_argument("--target", default=None, help="target Hub id or directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft (default: as for demo)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes to calibrate (default 1)")
    p.add_argument("--contexts", default=",".join(str(c) for c in core_constant("cost_model", "CALIBRATION_CONTEXTS")),
                   help="comma-separated cache lengths to time at; costs between are interpolated (default %(default)s)")
    p.add_argument("--out", default=None, help="also write the table to this file, to ship it or pass it elsewhere (default: none)")
    p.add_argument("--load", default=None, metavar="FILE", help="merge a table written by --out into this machine's (default: none)")
    p.add_argument("--show", action="store_true", help="print the table and where it lives, time nothing")
    p.add_argument("--reset", action="store_true", help="forget every cost and delete the table's file")
    add_model_placement(p)
    p.set_defaults(func=calibrate_command)
    return p


register = add_calibrate_parser
