"""Plot the shipped draft's MT-bench acceptance against the data it was trained on (the model card's curve).

Reads ``docs/bench_results/draft_curve.json`` (one entry per training session: response tokens seen in all, passes
over them, CPU minutes of data generation and training, MT-bench mean acceptance length at k = 5) and writes
``docs/draft_curve.png``.

    python examples/drafts/plot_acceptance_curve.py [--data docs/bench_results/draft_curve.json] [--out docs/draft_curve.png]
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    """Draw the curve: acceptance length against response tokens (log scale), each point labelled with its passes
    and compute.

    Args:
        argv (`list[str]`, *optional*): command-line arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="docs/bench_results/draft_curve.json", help="(default: %(default)s)")
    parser.add_argument("--out", default="docs/draft_curve.png", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = json.load(open(args.data))["runs"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [r["response_tokens"] / 1e6 for r in runs]
    ys = [r["mean_acceptance_length"] for r in runs]
    ax.plot(xs, ys, "o-", color="tab:blue")
    for i, (r, x, y) in enumerate(zip(runs, xs, ys)):
        # labels alternate left-above / right-below of their point; the last one has no room on the right, so the
        # one before it goes right-above, clear of the right-below label under it, and the last one higher up, clear
        # of the left-above label of the point two before it (the last sessions' points lie close together)
        if i == len(runs) - 1:
            offset, ha = (-8, 16), "right"
        elif i % 2 == 1 and i != len(runs) - 2:
            offset, ha = (-8, 6), "right"
        else:
            offset, ha = ((8, 2) if i == len(runs) - 2 else (8, -22)), "left"
        ax.annotate(f"{r['name']}\n{r['passes']:.1f} passes, {r['cpu_minutes']} CPU min", (x, y),
                    textcoords="offset points", xytext=offset, fontsize=7, ha=ha)
    ax.set_xscale("log")
    ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
    ax.set_ylim(min(ys) - 0.08, max(ys) + 0.13)  # room for the labels below the first point and above the last
    ticks = [t for t in (0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16) if min(xs) / 1.25 <= t <= max(xs) * 1.25]
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("response tokens trained on (millions, log scale)")
    ax.set_ylabel("MT-bench mean acceptance length (k = 5)")
    ax.set_title("SmolLM2-135M EAGLE-3 draft: acceptance vs data (2-core CPU)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
