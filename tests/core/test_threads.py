"""Two threads decoding on one loaded target do not cross-talk.

Each thread runs tree calls (one row) and batched calls (chains and trees) on the same tiny target, several rounds,
started together, with one draft shared by both threads or one draft each, the features taken from the target's
outputs (Transformers >= 5.25) or from forward hooks (earlier releases, ``target_layers_path``). Every call's output,
its proposals (every round's drafted trees) and its statistics (``draft.last_stats`` / ``last_batch_stats`` read by
the thread after its call) equal the same call run alone (greedy, fp32). Fixed shapes only: an ``"auto"`` size may
legitimately learn from the other thread's calls (``draft.drafting_memory``). The static buffers of compiled drafting
are the thread's own.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import cached_draft as draft_of
from conftest import cached_target as target_of
from conftest import random_prompt

from hf_eagle3 import Eagle3Drafter
from hf_eagle3.core.draft_cache import Eagle3RowCache
from hf_eagle3.core.generate_hook import use_drafting
from hf_eagle3.core.transformers_compat import SELECTS_HIDDEN_STATES

TREES = [dict(tree_top_k=3, tree_depth=4, tree_total_tokens=8), dict(tree_top_k=2, tree_depth=3, tree_total_tokens=5)]
CHAIN = dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
ROUNDS = 3


def padded_batch(lengths, seed: int):
    """Left-padded random prompts of the given lengths, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, ids.shape[1] - n :] = torch.randint(4, 256, (n,), generator=g)
        mask[b, ids.shape[1] - n :] = 1
    return ids, mask


def jobs(thread: int) -> list[dict]:
    """One thread's calls: a tree of one row, a batch of trees, a batch of chains (prompts and lengths of its own, so
    that its statistics differ from the other thread's)."""
    seed, new = 100 * thread, dict(max_new_tokens=10 + 3 * thread)
    ids, mask = padded_batch((5, 9, 3), seed + 1)
    ids2, mask2 = padded_batch((7, 4), seed + 2)
    return [
        dict(input_ids=random_prompt(6 + thread, seed=seed), **TREES[thread % 2], **new),
        dict(input_ids=ids, attention_mask=mask, **TREES[(thread + 1) % 2], **new),
        dict(input_ids=ids2, attention_mask=mask2, **CHAIN, **new),
    ]


def recorded_call(target, draft, job: dict, features: str, then=None) -> dict:
    """``job`` decoded with ``draft``: the output, every round's proposals and the statistics the thread reads (after
    ``then()``, when given: the other thread has published its own call's statistics by then)."""
    proposals = []

    class Recording(Eagle3Drafter):
        def select(self, candidates, roots, total):
            trees = super().select(candidates, roots, total)
            proposals.append([(t.tokens.tolist(), t.parents.tolist()) for t in trees])
            return trees

    with use_drafting(drafter=Recording, features=features):
        out = target.generate(**job, assistant_model=draft, do_sample=False)
    if then is not None:
        then()
    return dict(output=out.tolist(), proposals=proposals, stats=draft.last_stats.to_dict(),
                rows=[s.to_dict() for s in draft.last_batch_stats])


@pytest.mark.parametrize("shared, features", [(True, "outputs"), (False, "outputs"), (True, "hooks")],
                         ids=["one_draft", "two_drafts", "one_draft_hooks"])
def test_two_threads_equal_their_calls_run_alone(shared, features):
    if features == "outputs" and not SELECTS_HIDDEN_STATES:
        pytest.skip("Transformers < 5.25 cannot select hidden states (the hooks case covers it)")
    target = target_of("llama")
    drafts = [draft_of("llama", 48)] * 2 if shared else [draft_of("llama", 48), draft_of("llama")]
    alone = [[recorded_call(target, drafts[t], job, features) for job in jobs(t)] for t in range(2)]
    for t in range(2):
        plain = target.generate(**{k: v for k, v in jobs(t)[1].items() if not k.startswith("tree")},
                                do_sample=False)
        assert alone[t][1]["output"] == plain.tolist()  # lossless: the batch equals plain batched generate
        assert all(call["proposals"] for call in alone[t])  # every call drafted

    barrier, results, errors = threading.Barrier(2), [[] for _ in range(2)], []

    def work(t: int):
        try:
            torch.set_num_threads(1)  # two threads each with a pool of 2 would oversubscribe the cores (10x slower)
            barrier.wait()
            for _ in range(ROUNDS):
                results[t].append([recorded_call(target, drafts[t], job, features, barrier.wait) for job in jobs(t)])
        except BaseException as error:  # reported by the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    intra_op = torch.get_num_threads()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(intra_op)
    if errors:
        raise errors[0]
    for t in range(2):
        for r, calls in enumerate(results[t]):
            for j, (call, reference) in enumerate(zip(calls, alone[t])):
                for part in ("output", "proposals", "stats", "rows"):
                    assert call[part] == reference[part], (t, r, j, part)


def test_static_draft_cache_buffers_are_per_thread():
    """Compiled static drafting pools its cache buffers on the draft: a thread reuses its own (the same addresses at
    every call, as CUDA graphs need), a call running in another thread gets others."""
    pool = {}

    def buffers():
        cache = Eagle3RowCache(1, 8, static_buffers=pool)
        cache.place_causal(torch.arange(2)[None], 2)
        k = torch.randn(1, 2, 2, 4)
        cache.attend(k, k, k)
        return cache.keys.data_ptr()

    here = buffers()
    assert buffers() == here
    there = []
    thread = threading.Thread(target=lambda: there.append(buffers()))
    thread.start()
    thread.join()
    assert there[0] != here and len(pool) == 2
