"""``hf-eagle3 bench --oracle PROFILE``: the speed the implementation reaches for a given acceptance, apart from
any draft's quality.

The draft's forwards run as usual (their cost is real) but the tokens it proposes are replaced by the target's own
greedy continuation, accepted up to a length drawn each round from an acceptance profile (per draft position, the
fraction of rounds whose token there is accepted, e.g. the seed's Llama-3.1-8B profile); the first token past that
length is made wrong. The output stays the target's, and is checked against plain ``generate``. For each draft length
the bench reports the measured speed-up, the bound the cost model (:mod:`hf_eagle3.core.cost_model`) predicts for the same
profile, and where a round's time goes (draft, verification, bookkeeping).

Targets: any model ``hf-eagle3 bench`` loads, or a random-weight model of a published shape (``--synthetic``), so the
implementation can be measured on a GPU without downloading weights.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from hf_eagle3.bench.oracle_drafting import (
    OracleCandidateGenerator,
    OracleTreeDrafter,
    bind_oracle,
    expected_tokens,
    parse_profile,
)
from hf_eagle3.bench.synthetic import synthetic_target
from hf_eagle3.core.cost_model import measure_round_costs, synchronize
from hf_eagle3.core.generate_hook import use_drafting
from hf_eagle3.environment import environment_record


class _ForwardTimer:
    """Forward hooks on the target that add up its forward time (synchronised on CUDA)."""

    def __init__(self, model):
        self.model, self.times, self._start, self._handles = model, [], None, []

    @property
    def prefill(self) -> float:
        """Seconds of the first forward (the prompt's)."""
        return self.times[0] if self.times else 0.0

    @property
    def decode(self) -> float:
        """Seconds of the forwards after the first."""
        return sum(self.times[1:])

    def _sync(self):
        synchronize(self.model)

    def __enter__(self):
        def pre(module, args, kwargs):
            self._sync()
            self._start = time.perf_counter()

        def post(module, args, kwargs, output):
            self._sync()
            self.times.append(time.perf_counter() - self._start)

        self._handles = [self.model.register_forward_pre_hook(pre, with_kwargs=True),
                         self.model.register_forward_hook(post, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False


def limiting_resource(costs, target, bookkeeping_share: float | None) -> str:
    """
    One sentence naming what limits decoding on this machine, from the measured forward costs.

    Args:
        costs (`Eagle3Costs`): measured costs.
        target: the target (its parameter count and dtype give the bytes a forward reads).
        bookkeeping_share (`float`, *optional*): share of a round spent outside the forwards.
    """
    params = sum(p.numel() for p in target.parameters())
    size = next(target.parameters()).element_size()
    one, eight = costs.target_seconds(1), costs.target_seconds(8)
    bandwidth = params * size / one / 1e9
    flops = 2 * params * 8 / eight / 1e12
    ratio = eight / one
    if params * size < 100e6:
        verdict = "per-forward fixed costs (Python, kernel launches: the model is too small to be bandwidth-bound)"
    elif ratio < 1.3:
        verdict = "memory bandwidth (reading the weights): verifying 8 tokens costs about as much as 1"
    else:
        verdict = "compute: each verified token adds to the forward's time"
    text = (f"limited by {verdict} (8 tokens cost {ratio:.2f}x one; a one-token forward reads the weights at "
            f"{bandwidth:.1f} GB/s, an 8-token forward runs at {flops:.3f} TFLOP/s)")
    if bookkeeping_share is not None and bookkeeping_share > 0.2:
        text += f"; host-side bookkeeping takes {100 * bookkeeping_share:.0f} % of a round"
    return text


TREE_SHAPES = ((4, 4, 8), (8, 6, 32))  # (tree_top_k, tree_depth, tree_total_tokens) of the oracle's tree rows


def round_bound(costs, profile, k: int | None = None, tree: tuple | None = None, tree_depths=None) -> float:
    """
    The speed-up the cost model predicts for a chain of length ``k``, or for a ``(top_k, depth, total)`` tree whose
    main path carries the profile (expected tokens from the depths its trees really had, ``min(depth, total)`` when
    the room left never cut them): expected tokens per round over the round's cost in one-token target forwards.

    Args:
        costs (`Eagle3Costs`): measured costs.
        profile (`tuple[float]`): per-position acceptance.
        k (`int`, *optional*): chain length.
        tree (`tuple[int, int, int]`, *optional*): tree shape.
        tree_depths (`list[int]`, *optional*): the depth of each round's tree, its main path's (default: the
            shape's, ``min(depth, total)``).
    """
    if tree is None:
        expected = expected_tokens(profile, k)
        seconds = costs.round_seconds(k, feed=max(1, round(expected)))
    else:
        top_k, depth, total = tree
        depths = tree_depths or [min(depth, total)]
        expected = sum(expected_tokens(profile, d) for d in depths) / len(depths)
        seconds = (costs.feed_seconds(max(1, round(expected))) + (depth - 1) * costs.feed_seconds(top_k)
                   + costs.target_seconds(total + 1))
    return expected * costs.target_seconds(1) / seconds


def run_oracle_bench(target, draft, prompts: list, profile, ks=(1, 2, 3, 4, 5, 6, 7), max_new_tokens: int = 64,
                     auto: bool = True, tree_shapes=TREE_SHAPES, seed: int = 0, progress: bool = True,
                     generate_kwargs: dict | None = None) -> dict:
    """
    Time plain greedy ``generate`` and EAGLE-3 chains under the oracle for each ``k`` (and ``"auto"``), per prompt in
    turn, and compare with the cost model's bound.

    Args:
        target: the target (eval mode).
        draft (`Eagle3DraftModel`): a draft of the target's shape (its weights do not matter).
        prompts (`list[torch.LongTensor]`): prompt ids ``[1, L]`` each.
        profile (`tuple[float]`): per-position acceptance (see :func:`parse_profile`).
        ks (`tuple[int]`): constant draft lengths.
        max_new_tokens (`int`): new tokens per call.
        auto (`bool`): add a ``num_assistant_tokens_schedule="auto"`` row (draft lengths up to ``max(ks)``).
        tree_shapes (`tuple`): ``(tree_top_k, tree_depth, tree_total_tokens)`` of tree rows (see
            :class:`OracleTreeDrafter`).
        seed (`int`): seed of the acceptance draws.
        progress (`bool`): print the phases and a line per prompt on stderr.
        generate_kwargs (`dict`, *optional*): passed to every ``generate`` call, plain and EAGLE-3 alike (e.g.
            ``cache_implementation="static"`` and a ``compile_config``: the compiled target as the baseline).

    Every time is of the decoding after the prompt's forward (which plain and EAGLE-3 share): speed-ups are of that
    part, and a round is a target forward after the prefill. Each strategy runs once on a short prompt before any
    timing (its first-call costs, compiles included, are not timed).

    Returns:
        The report: ``settings``, ``costs``, ``rows`` (per strategy: speed-up, bound, acceptance, per-round times in
        ms; trees: the mean depth of the rounds' trees), ``identical`` and ``limited_by``.
    """
    device = target.device
    draft.bind_target(target)
    extra = dict(generate_kwargs or {})
    # The first calls (a static cache: the first prompt's own shapes, so that nothing compiles while timed).
    warm, warm_new = (prompts[0].to(device), max_new_tokens) if extra else (prompts[0][:, :16].to(device), 8)
    if progress:
        print("oracle bench: warming up and measuring the forwards' costs ...", file=sys.stderr, flush=True)
    strategies = _oracle_strategies(ks, auto, tree_shapes)
    reference = _time_plain(target, warm, warm_new, _empty_total(), **extra)
    for name, kwargs, _, shape in strategies:  # each strategy's first call, untimed
        _time_oracle(target, draft, warm, reference[0].tolist(), profile, seed, kwargs, shape, warm_new,
                     _empty_total(), **extra)
    costs = measure_round_costs(target, draft, prompts[0].to(device))
    totals = {name: _empty_total() for name in ["plain"] + [strategy[0] for strategy in strategies]}
    identical = True
    for index, ids in enumerate(prompts):
        ids = ids.to(device)
        ref = _time_plain(target, ids, max_new_tokens, totals["plain"], **extra)
        for name, kwargs, _, shape in strategies:
            out = _time_oracle(target, draft, ids, ref[0].tolist(), profile, seed + index, kwargs, shape,
                               max_new_tokens, totals[name], **extra)
            identical &= torch.equal(out, ref)
        if progress:
            print(f"oracle bench: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    rows = _oracle_rows(totals, strategies, costs, profile)
    best = max((r for r in rows if "bound" in r), key=lambda r: r["speedup"])
    share = best["bookkeeping_ms"] / best["round_ms"] if best["round_ms"] else None
    return {
        "settings": {
            "profile": list(profile), "ks": list(ks), "tree_shapes": [list(t) for t in tree_shapes],
            "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "generate_kwargs": {k: str(v) for k, v in extra.items()},
            "prompt_tokens": [int(p.shape[1]) for p in prompts],
            "target_parameters": sum(p.numel() for p in target.parameters()),
            **environment_record(target, draft_path=getattr(draft, "name_or_path", None)),
        },
        "costs": costs.to_dict(),
        "rows": rows,
        "identical": identical,
        "limited_by": limiting_resource(costs, target, share),
    }


def _empty_total() -> dict:
    """A strategy's sums before its first timed call."""
    return {"seconds": 0.0, "tokens": 0, "draft": 0.0, "verify": 0.0, "rounds": 0, "stats": None, "tree_depths": []}


def _oracle_strategies(ks, auto: bool, tree_shapes) -> list[tuple]:
    """The oracle's EAGLE-3 rows: ``(name, generate kwargs, k, tree shape)`` for each chain length, ``"auto"`` and
    each tree shape."""
    strategies = [(f"chain k={k}", {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant"}, k, None)
                  for k in ks]
    if auto:
        strategies.append((f"auto k<={max(ks)}", {"num_assistant_tokens": max(ks),
                                                  "num_assistant_tokens_schedule": "auto"}, None, None))
    for shape in tree_shapes:
        kwargs = dict(zip(("tree_top_k", "tree_depth", "tree_total_tokens"), shape))
        strategies.append((f"tree {shape[0]}x{shape[1]}x{shape[2]}", kwargs, None, tuple(shape)))
    return strategies


def _add_call(total: dict, seconds: float, tokens: int, timer: _ForwardTimer, forwards: int) -> None:
    """Add a call's decoding part (after the prefill, which plain and EAGLE-3 share) to ``total``."""
    total["seconds"] += seconds - timer.prefill
    total["tokens"] += tokens - 1  # the prefill's token
    total["verify"] += timer.decode
    total["rounds"] += forwards - 1


def _time_plain(target, ids, max_new_tokens: int, total: dict, **extra) -> torch.LongTensor:
    """Plain greedy ``generate`` on ``ids`` (with ``extra`` kwargs), timed into ``total``: its output, the oracle's
    reference."""
    with _ForwardTimer(target) as timer:
        synchronize(target)
        start = time.perf_counter()
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, **extra)
        synchronize(target)
    _add_call(total, time.perf_counter() - start, ref.shape[1] - ids.shape[1], timer, len(timer.times))
    return ref


def _time_oracle(target, draft, ids, reference: list, profile, seed: int, kwargs: dict, shape, max_new_tokens: int,
                 total: dict, **extra) -> torch.LongTensor:
    """One EAGLE-3 call (with ``extra`` kwargs) whose drafter proposes ``reference`` (accepted as ``profile`` draws
    with ``seed``), timed into ``total`` (with the drafter's seconds and tree depths): its output."""
    created = []
    base = bind_oracle(OracleCandidateGenerator if shape is None else OracleTreeDrafter, reference, profile, seed=seed)

    class Recording(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            created.append(self)

    install = {"chain": Recording} if shape is None else {"drafter": Recording}
    with use_drafting(**install), _ForwardTimer(target) as timer:
        draft.reset_stats()
        synchronize(target)
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, assistant_model=draft, **kwargs, **extra)
        synchronize(target)
    stats = draft.last_stats
    _add_call(total, time.perf_counter() - start, out.shape[1] - ids.shape[1], timer, stats.num_target_forwards)
    total["draft"] += created[0].draft_seconds
    total["tree_depths"] += getattr(created[0], "tree_depths", [])
    total["stats"] = stats if total["stats"] is None else total["stats"] + stats
    return out


def _oracle_rows(totals: dict, strategies: list[tuple], costs, profile) -> list[dict]:
    """The report's rows: plain, then each EAGLE-3 strategy with its speed-up, per-round times and (for fixed
    shapes) the cost model's bound."""
    plain = totals["plain"]
    plain_tps = plain["tokens"] / plain["seconds"]
    rows = [{"strategy": "plain", "k": None, "speedup": 1.0, "tokens_per_s": plain_tps,
             "round_ms": 1000 * plain["seconds"] / plain["rounds"], "verify_ms": 1000 * plain["verify"] / plain["rounds"],
             "draft_ms": 0.0, "bookkeeping_ms": 1000 * (plain["seconds"] - plain["verify"]) / plain["rounds"]}]
    for name, _, k, shape in strategies:
        total = totals[name]
        stats = total["stats"]
        rounds = total["rounds"]
        tps = total["tokens"] / total["seconds"]
        row = {
            "strategy": name, "k": k, "speedup": tps / plain_tps, "tokens_per_s": tps,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "tokens_per_round": total["tokens"] / rounds,
            "round_ms": 1000 * total["seconds"] / rounds,
            "draft_ms": 1000 * total["draft"] / rounds,
            "verify_ms": 1000 * total["verify"] / rounds,
            "bookkeeping_ms": 1000 * (total["seconds"] - total["draft"] - total["verify"]) / rounds,
            "stats": stats.to_dict(),
        }
        if total["tree_depths"]:  # the rounds that drafted a tree
            row["mean_tree_depth"] = sum(total["tree_depths"]) / len(total["tree_depths"])
        if k is not None or (shape is not None and shape[2] != "auto"):
            row["bound"] = round_bound(costs, profile, k=k, tree=shape, tree_depths=total["tree_depths"])
            row["measured_over_bound"] = row["speedup"] / row["bound"]
        rows.append(row)
    return rows


def format_oracle_markdown(report: dict) -> str:
    """
    The oracle report as a markdown table plus the cost and resource lines.

    Args:
        report (`dict`): what :func:`run_oracle_bench` returned.
    """
    s = report["settings"]
    lines = [
        f"Oracle profile {' '.join(f'{p:.2f}' for p in s['profile'][:8])}; {s['num_prompts']} prompts, "
        f"{s['max_new_tokens']} new tokens, greedy; target {s['target_parameters'] / 1e6:.0f} M parameters, "
        f"{s['target_dtype']} on {s['gpu'] or s['device']} (CPU: {s['cpu']}), torch threads "
        f"{s['torch_threads']}; {s['date']}",
        "",
        "| strategy | vs plain | cost-model bound | measured / bound | tokens per round | round ms | draft ms "
        "| verify ms | bookkeeping ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        bound = f"{r['bound']:.2f}x" if "bound" in r else ""
        ratio = f"{r['measured_over_bound']:.2f}" if "bound" in r else ""
        per_round = f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else "1.00"
        lines.append(f"| {r['strategy']} | {r['speedup']:.2f}x | {bound} | {ratio} | {per_round} | {r['round_ms']:.1f} "
                     f"| {r['draft_ms']:.1f} | {r['verify_ms']:.1f} | {r['bookkeeping_ms']:.1f} |")
    c = report["costs"]
    ratios = ", ".join(f"{n}: {v:.2f}x" for n, v in c["target_ratio"].items())
    lines += [
        "",
        f"Target forward of n tokens relative to one ({c['target_ms']['1']:.1f} ms): {ratios}; draft step "
        f"{c['draft_step_ratio']:.2f}x.",
        f"Greedy outputs identical to plain generate: **{'yes' if report['identical'] else 'NO'}**.",
        f"This machine is {report['limited_by']}.",
    ]
    return "\n".join(lines) + "\n"


def oracle_command(options) -> int:
    """
    Run ``hf-eagle3 bench --oracle`` from its parsed options.

    Args:
        options (`BenchOptions`): the options of ``hf-eagle3 bench`` (:class:`hf_eagle3.bench.run.BenchOptions`).

    Returns:
        0, or 1 when an output differs from plain ``generate``.
    """
    from hf_eagle3.bench.strategies import parse_tree_shapes

    profile = parse_profile(options.oracle)
    ks = [int(k) for k in (options.ks or "1,2,3,4,5,6,7").split(",") if k.strip()]
    num_prompts = options.num_prompts or 4
    max_new_tokens = options.max_new_tokens or 64
    if options.synthetic:
        target, draft, prompts, target_name, draft_name = _synthetic_pair(options, num_prompts)
    else:
        target, draft, prompts, target_name, draft_name = _loaded_pair(options, num_prompts)
    with torch.no_grad():
        shapes = parse_tree_shapes(options.tree_shapes) if options.tree_shapes else TREE_SHAPES
        report = run_oracle_bench(target, draft, prompts, profile, ks=ks, max_new_tokens=max_new_tokens,
                                  tree_shapes=shapes, seed=options.seed)
    report["settings"].update({"target": target_name, "draft": draft_name, "command": options.command})
    text = format_oracle_markdown(report)
    print(text)
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "oracle.md").write_text(text)
    print(f"Wrote {out / 'oracle.json'}, {out / 'oracle.md'}")
    return 0 if report["identical"] else 1


def _synthetic_pair(options, num_prompts: int) -> tuple:
    """``--synthetic``: a random-weight target of a published shape, random prompts and a random draft, with their
    names: ``(target, draft, prompts, target_name, draft_name)``."""
    from hf_eagle3.loading import parse_dtype, random_draft_for

    dtype = parse_dtype(options.dtype) or torch.float32
    # Below float32 a random-weight target's near-ties would take decoding off the oracle's reference path.
    decisive = dtype != torch.float32
    print(f"oracle bench: building a random-weight {options.synthetic} ...", file=sys.stderr, flush=True)
    target = synthetic_target(options.synthetic, dtype=dtype, device=options.device, decisive=decisive)
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(options.seed)
    prompts = [torch.randint(0, vocab, (1, options.prompt_tokens), generator=generator) for _ in range(num_prompts)]
    draft = random_draft_for(target, draft_vocab_size=min(options.draft_vocab_size, vocab))
    return (target, draft, prompts, f"synthetic {options.synthetic} (random weights{', decisive' if decisive else ''})",
            "random draft")


def _loaded_pair(options, num_prompts: int) -> tuple:
    """The target and draft of ``--target`` / ``--draft`` and the encoded prompts, with their names: ``(target,
    draft, prompts, target_name, draft_name)``."""
    from hf_eagle3.loading import encode_prompt, load_pair, load_prompts, parse_dtype

    parse_dtype(options.dtype)  # an unknown dtype is refused before anything loads
    target, tokenizer, draft, draft_name, _ = load_pair(options.target, options.draft, options.dtype, options.device)
    texts = load_prompts(options.dataset, None)[:: max(1, options.prompt_stride)][:num_prompts]
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    return target, draft, prompts, options.target or "SmolLM2-135M-Instruct", draft_name
