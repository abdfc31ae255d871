"""The outputs of ``hf-eagle3 bench``: the markdown table, the plot, and the files they are written to."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def format_markdown(report: dict) -> str:
    """Render the report as a markdown table plus a line on greedy identity.

    Args:
        report: what :func:`run_bench` returned.
    """
    s = report["settings"]
    if "sampled" in s.get("modes", []):
        sampling = f"temperature {s['temperature']} in sampled rows"
    else:
        sampling = "greedy only"
    lines = [
        f"{s['num_prompts']} prompts, max_new_tokens={s['max_new_tokens']}, {sampling}, "
        f"torch threads={s['torch_threads']}, target dtype {s['target_dtype']} on {s.get('device', 'cpu')}, "
        f"{s['date']}",
        "",
        "| mode | strategy | k | tokens/s | ms/token | vs plain | mean acceptance length | acceptance per position "
        "| rounds drafted (mean k) / without draft |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in report["results"]:
        per_pos = r["acceptance_rate_per_position"]
        per_pos = " ".join(f"{x:.2f}" for x in per_pos) if per_pos is not None else "n/a"
        k = "" if r["k"] is None else str(r["k"])
        st = r.get("stats")
        rounds = (f"{st['num_drafts']} ({st['mean_draft_length']:.2f}) / {st['num_rounds_without_draft']}"
                  if st and "mean_draft_length" in st else "n/a")
        lines.append(
            f"| {r['mode']} | {r['strategy']} | {k} | {_fmt(r['tokens_per_s'], '.2f')} | {_fmt(r['ms_per_token'], '.1f')} "
            f"| {_fmt(r['speedup'], '.2f')}x | {_fmt(r['mean_acceptance_length'], '.2f')} | {per_pos} | {rounds} |"
        )
    lines.append("")
    compared = report["greedy_compared"]
    if report["greedy_identical"]:
        lines.append(
            f"Greedy outputs identical across strategies: **yes** ({compared['prompts']} prompts x "
            f"{len(compared['strategies'])} strategies compared with plain generate, token by token)."
        )
    else:
        lines.append(f"Greedy outputs identical across strategies: **NO** ({len(report['greedy_mismatches'])} mismatches):")
        for m in report["greedy_mismatches"]:
            lines.append(f"- {m['strategy']}, prompt {m['prompt_index']}: first difference at new token "
                         f"{m['first_difference']}")
    costs = report.get("target_forward_ms") or {}
    if costs:
        one = costs.get("1")
        parts = [f"{n}: {ms:.1f} ms" + (f" ({ms / one:.2f}x)" if one else "") for n, ms in costs.items()]
        lines += ["", "Target forward for n new tokens (on the first prompt's cache; ratio to 1 token): " + ", ".join(parts)
                  + "."]
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: str | os.PathLike) -> None:
    """Draw the speed-up over plain ``generate`` against k, and the acceptance rate per draft position, into a PNG.

    Args:
        report: what :func:`run_bench` returned.
        path: the PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups = {}
    for r in report["results"]:
        if r["family"] != "plain":
            groups.setdefault((r["family"], r["mode"]), []).append(r)
    for (family, mode), rows in groups.items():
        style = "-" if mode == "greedy" else "--"
        sized = sorted((r for r in rows if isinstance(r["k"], int)), key=lambda r: r["k"])
        others = [r for r in rows if not isinstance(r["k"], int)]  # e.g. tree_total_tokens="auto"
        if len(sized) == 1:
            others, sized = sized + others, []
        if sized:
            ax1.plot([r["k"] for r in sized], [r["speedup"] for r in sized], style, marker="o", label=f"{family} ({mode})")
        for r in others:
            ax1.axhline(r["speedup"], linestyle=":" if mode == "greedy" else "-.", color="gray",
                        label=f"{r['strategy']} ({mode})")
    ax1.axhline(1.0, color="black", linewidth=0.8, label="plain generate")
    ax1.set_xlabel("draft length k")
    ax1.set_ylabel("speed-up over plain generate")
    ax1.set_title("Speed-up vs k")
    ax1.legend(fontsize=7)
    for r in report["results"]:
        per_pos = r["acceptance_rate_per_position"]
        if per_pos:
            style = "-" if r["mode"] == "greedy" else "--"
            ax2.plot(range(len(per_pos)), per_pos, style, marker=".", label=f"{r['strategy']} ({r['mode']})")
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("acceptance at token i")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Acceptance per position")
    ax2.legend(fontsize=7)
    s = report["settings"]
    fig.suptitle(f"hf-eagle3 bench: {s.get('target', 'target')} + {s.get('draft', 'draft')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict, out_dir: str | os.PathLike) -> dict:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out_dir`` (created when missing).

    Args:
        report: what :func:`run_bench` returned.
        out_dir: destination directory.

    Returns:
        ``{"json": path, "markdown": path, "png": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md", "png": out / "bench.png"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(format_markdown(report))
    plot_report(report, paths["png"])
    return {k: str(v) for k, v in paths.items()}
