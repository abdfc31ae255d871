"""Draft training: vocabulary mapping, TTT attention/loss/masking, training-time test == inference, training."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_draft, tiny_records, tiny_target

import hf_eagle3
from hf_eagle3.training.features import cache_features, collate
from hf_eagle3.training.trainer import TrainConfig, draft_config_for_target, evaluate, init_draft, train
from hf_eagle3.training.ttt import ConcatKVCache, TTTAttention, ttt_attention_mask, ttt_forward, ttt_loss
from hf_eagle3.training.vocab import build_vocab_mapping, check_vocab_mapping, count_tokens, coverage


def test_vocab_mapping_toy_corpus():
    counts = count_tokens([[5, 5, 2, 9], [5, 9, 2, 1], [5, 9, 2]])  # 5:4, 2:3, 9:3, 1:1
    d2t, t2d = build_vocab_mapping(counts, 3, 12)
    used = torch.arange(3) + d2t
    assert used.tolist() == [2, 5, 9]  # the 3 most frequent, sorted ascending
    assert d2t.tolist() == [2, 4, 7]  # d2t[i] = used[i] - i
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]
    assert coverage(counts, d2t) == pytest.approx(10 / 11)
    # ties broken by the smaller id; unseen ids fill a vocabulary larger than the corpus
    d2t, _ = build_vocab_mapping(Counter({7: 2, 3: 2, 4: 1}), 2, 10)
    assert (torch.arange(2) + d2t).tolist() == [3, 7]
    d2t, t2d = build_vocab_mapping(Counter({7: 2}), 3, 10)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 7] and int(t2d.sum()) == 3


def test_vocab_mapping_consistency_check():
    d2t, t2d = build_vocab_mapping(Counter({1: 3, 4: 2, 6: 1}), 3, 8)
    bad = t2d.clone()
    bad[0] = True
    with pytest.raises(ValueError, match="t2d"):
        check_vocab_mapping(d2t, bad)
    with pytest.raises(ValueError, match="increasing"):
        check_vocab_mapping(torch.tensor([4, 0, 0]), t2d)
    with pytest.raises(ValueError, match="outside"):
        build_vocab_mapping(Counter({99: 1}), 1, 8)


def test_ttt_attention_equals_masked_sdpa():
    torch.manual_seed(0)
    att, ref = TTTAttention(), ConcatKVCache()
    for step in range(4):
        q = torch.randn(2, 4, 6, 8)
        k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        out = att.attend(q, k, v)
        keys, values = ref.update(k, v)
        expected = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ttt_attention_mask(6, step), enable_gqa=True
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _bound_draft(vocab=64, dv=32, hidden=32, seed=0):
    target = tiny_target("llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4)
    draft = tiny_draft(target, dv, seed=seed)
    draft.bind_target(target)
    return target, draft


def test_training_time_test_matches_inference():
    """Step k of the unrolled TTT at base t == the draft's (k+1)-th step at inference after real features up to t."""
    torch.manual_seed(0)
    _, draft = _bound_draft()
    n, T = 9, draft.config.target_hidden_size
    feats = torch.randn(1, n, 3 * T)
    ids = torch.randint(0, 64, (1, n))
    steps = ttt_forward(draft, feats, ids, ttt_length=3)
    for t in range(n - 1):
        cache = hf_eagle3.Eagle3KVCache()
        out = draft(input_ids=ids[:, 1 : t + 2], target_features=feats[:, : t + 1], cache=cache)
        torch.testing.assert_close(out.hidden_states[:, -1], steps[0][:, t], atol=1e-5, rtol=1e-4)
        h = out.hidden_states[:, -1:]
        for k in range(1, 3):
            if t + 1 + k >= n:
                break
            out = draft(input_ids=ids[:, t + 1 + k : t + 2 + k], hidden_states=h, cache=cache,
                        position_ids=torch.tensor([[t + k]]))
            torch.testing.assert_close(out.hidden_states[:, -1], steps[k][:, t], atol=1e-5, rtol=1e-4)
            h = out.hidden_states


def test_ttt_loss_matches_direct_computation_and_masking():
    torch.manual_seed(1)
    _, draft = _bound_draft()
    b, n, T, dv = 2, 7, draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits = torch.randn(b, n, dv)
    mask = (torch.rand(b, n) > 0.4).float()
    mask[:, -1] = 0
    loss, stats = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3, step_decay=0.8)
    steps = ttt_forward(draft, feats, ids, 3)
    expected = 0.0
    for k in range(3):
        terms, hits = [], []
        for r in range(b):
            for t in range(n - 1):
                pos = t + 1 + k  # step k at base t is trained on the target's distribution at position t+1+k
                if pos < n and mask[r, pos] > 0:
                    p = tlogits[r, pos].softmax(-1)
                    logq = draft.compute_logits(steps[k][r, t]).log_softmax(-1)
                    terms.append(-(p * logq).sum())
                    hits.append(float(logq.argmax() == p.argmax()))
        assert stats["count"][k] == len(terms)
        if terms:
            expected = expected + 0.8**k * torch.stack(terms).mean()
            assert stats["acc"][k] == pytest.approx(sum(hits) / len(hits))
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=loss.dtype), atol=1e-4, rtol=1e-4)
    # a fully masked batch contributes nothing
    zero, stats0 = ttt_loss(draft, feats, ids, tlogits, torch.zeros(b, n), ttt_length=3)
    assert float(zero.detach()) == 0.0 and stats0["count"] == [0.0, 0.0, 0.0]
    zero.backward()  # and still backpropagates (a training step on it must not fail), with zero gradients everywhere
    grads = [q.grad for q in draft.parameters() if q.requires_grad]
    assert grads and all(g is not None and not g.any() for g in grads)


def test_sliding_window_drafts_train_where_the_window_does_not_bind():
    """A sliding-window draft (speculators' default layout) computes on sequences shorter than its window what a
    full-attention one does, so it trains and evaluates exactly; where the window would bind, a clear error."""
    torch.manual_seed(3)
    _, draft = _bound_draft()
    b, n, T, dv = 2, 9, draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits, mask = torch.randn(b, n, dv), torch.ones(b, n)
    full, _ = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3)
    # step k at base position t sits at position t + k and attends position 0: at most (n - 2) + 2 = 9 apart
    draft.midlayer.self_attn.sliding_window = n + 1
    windowed, _ = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3)
    torch.testing.assert_close(windowed, full)
    draft.midlayer.self_attn.sliding_window = n  # 9 apart: the window binds
    with pytest.raises(ValueError, match=r"sliding window \(9\) binds on these sequences \(8 positions, step 3\)"):
        ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=3)


def test_ttt_loss_target_temperature_sharpens_the_soft_labels():
    torch.manual_seed(2)
    _, draft = _bound_draft()
    b, n, T, dv = 2, 6, draft.config.target_hidden_size, draft.config.draft_vocab_size
    feats, ids = torch.randn(b, n, 3 * T), torch.randint(0, 64, (b, n))
    tlogits, mask = torch.randn(b, n, dv), torch.ones(b, n)
    mask[:, -1] = 0
    ref, ref_stats = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2)
    # temperature T on the labels == the reference loss on logits / T
    half, half_stats = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2, target_temperature=0.5)
    torch.testing.assert_close(half, ttt_loss(draft, feats, ids, 2 * tlogits, mask, ttt_length=2)[0])
    assert not torch.allclose(half, ref) and half_stats["acc"] == ref_stats["acc"]  # accuracy is the argmax's
    # towards 0 the labels become one-hot on the target's argmax: cross-entropy on it
    cold, _ = ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2, target_temperature=1e-4)
    hard = 1e4 * F.one_hot(tlogits.argmax(-1), dv).float()
    torch.testing.assert_close(cold, ttt_loss(draft, feats, ids, hard, mask, ttt_length=2)[0])
    with pytest.raises(ValueError, match="target_temperature"):
        ttt_loss(draft, feats, ids, tlogits, mask, ttt_length=2, target_temperature=0.0)


def test_train_cli_refuses_a_non_positive_target_temperature_before_any_work(tmp_path):
    from hf_eagle3.training.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="--target-temperature -1.0: give a temperature > 0"):
        main(["train", "--data", str(tmp_path / "missing"), "--out", str(out), "--target-temperature", "-1"])
    assert not out.exists()  # refused before the data is read or anything is written


def test_collate_mask_counts_response_tokens_in_draft_vocab():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 3]] = True
    item = {
        "input_ids": torch.tensor([5, 6, 1, 2, 9]),
        "features": torch.zeros(5, 6),
        "last_hidden": torch.zeros(5, 2),
        "target_argmax": torch.tensor([1, 1, 2, 9, 3]),
        "prompt_len": 2,
    }
    batch = collate([item], t2d, torch.zeros(3, 2))
    # position i counts if token i+1 is a response token (i+1 >= 2), i+1 exists, and the target argmax at i is drafted
    assert batch["loss_mask"][0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    # prompt positions (predicting token 1 here) count with prompt_loss_weight when asked for
    weighted = collate([item], t2d, torch.zeros(3, 2), prompt_loss_weight=0.5)
    assert weighted["loss_mask"][0].tolist() == [0.5, 1.0, 1.0, 0.0, 0.0]


def _responses_dir(path, records):
    """Write ``records`` where ``train --data`` reads them (``path/responses-00000.jsonl``) and return ``path``."""
    import json

    path.mkdir()
    with open(path / "responses-00000.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def test_a_few_training_steps_reduce_the_loss_and_checkpoint_resumes(tmp_path):
    target = tiny_target("llama")
    with torch.no_grad():  # a peaked target distribution, so that a draft can learn something within a few steps
        target.lm_head.weight.mul_(8)
    records = tiny_records(target)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [2, 3, 3], per_shard=8, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 128, 256)
    draft = init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)
    shards = sorted(feats.glob("shard-*.pt"))
    before = evaluate(draft, feats, shards=shards[:2], ttt_length=3)
    # vocabulary coverage, against the target's own argmax, for a small vocabulary built from a few answers
    small_d2t, small_t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records[:3]), 32, 256)
    small = init_draft(draft_config_for_target(head["config"], 32, intermediate_size=96), head, small_d2t, small_t2d)
    with torch.no_grad():
        argmax = [target(torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0].argmax(-1)
                  [len(r["prompt_ids"]) - 1 : -1] for r in records]
    expected = float(torch.cat([small_t2d.bool()[a] for a in argmax]).float().mean())
    coverage = evaluate(small, feats, shards=shards, ttt_length=1, chain_length=0)["vocab_coverage"]
    assert 0.0 < expected < 1.0 and coverage == pytest.approx(expected)
    assert evaluate(draft, feats, shards=shards, ttt_length=1, chain_length=0)["vocab_coverage"] == 1.0  # greedy answers
    cfg = TrainConfig(lr=3e-3, epochs=4, batch_tokens=256, warmup_steps=2, ttt_length=3, log_every=1,
                      save_every=1000, mixed_precision="no", holdout_shards=1)
    draft = train(draft, feats, tmp_path / "run", cfg, log=lambda s: None)
    after = evaluate(draft, feats, shards=shards[:2], ttt_length=3)
    assert sum(after["loss"]) < 0.9 * sum(before["loss"])
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert state["epoch"] == 4 and state["step"] > 0
    # a rerun resumes at the end instead of starting over: nothing more is trained
    again = init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)
    again = train(again, feats, tmp_path / "run", cfg, log=lambda s: None)
    for a, b in zip(draft.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(a, b)
    # the trained draft decodes losslessly
    ids = torch.tensor([records[0]["prompt_ids"]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, assistant_model=again.float(), max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)


def test_a_draft_that_does_not_match_the_features_is_refused_before_any_work(tmp_path):
    """Other layer ids (would train silently, then read the wrong layers at inference), another target's sizes,
    and a missing features directory: a clear error, and no output directory left behind."""
    from hf_eagle3.training.cli import main
    from hf_eagle3.training.trainer import check_draft_matches_features

    target = tiny_target("llama")
    records = tiny_records(target, n=4, new=8)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [1, 2, 4], per_shard=2, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 64, 256)
    cfg = TrainConfig(max_steps=1, batch_tokens=256, mixed_precision="no")

    default_ids = init_draft(draft_config_for_target(head["config"], 64), head, d2t, t2d)  # reads [2, 3, 3]
    with pytest.raises(ValueError, match=r"captured at target layers \[1, 2, 4\] but the draft reads layers \[2, 3, 3\]") as err:
        train(default_ids, feats, tmp_path / "run", cfg, log=lambda s: None)
    assert "feature_layer_ids" in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="captured at target layers"):
        evaluate(default_ids, feats)

    wide = tiny_target("llama", hidden_size=32, num_attention_heads=4)
    other = tiny_draft(wide, hidden_size=32, feature_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match="target hidden size 64 != draft target_hidden_size 32"):
        check_draft_matches_features(other, feats)
    matching = init_draft(draft_config_for_target(head["config"], 64, feature_layer_ids=[1, 2, 4]), head, d2t, t2d)
    check_draft_matches_features(matching, feats)  # no error
    with pytest.raises(FileNotFoundError, match="no target_head.pt"):
        check_draft_matches_features(matching, tmp_path / "nothing")

    # the CLI: --init-draft with a draft for other layers is refused before vocab.pt or a run directory is written
    data = _responses_dir(tmp_path / "data", records)
    default_ids.save_pretrained(tmp_path / "init")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="captured at target layers"):
        main(["train", "--data", str(data), "--out", str(out), "--skip-features", "--features-dir", str(feats),
              "--init-draft", str(tmp_path / "init"), "--max-steps", "1", "--mixed-precision", "no"])
    assert not (out / "vocab.pt").exists() and not (out / "run").exists()
    # without --init-draft the new draft reads the layers the features were captured at
    main(["train", "--data", str(data), "--out", str(out), "--skip-features", "--features-dir", str(feats),
          "--draft-vocab-size", "64", "--max-steps", "1", "--batch-tokens", "256", "--mixed-precision", "no",
          "--holdout-shards", "1"])
    assert hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft").config.feature_layer_ids == [1, 2, 4]


def _torchrun_training(feats, out, minutes: float, select_by: str, mode: str) -> None:
    """Train with ``tests/ddp_train_worker.py`` on two processes (gloo on CPU)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(Path(__file__).parent / "ddp_train_worker.py"), str(feats), str(out),
           str(minutes), select_by, mode]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ddp_and_fsdp_on_two_processes_follow_one_process_accumulating_their_batches(tmp_path):
    """Two processes (torchrun, gloo), weights replicated (DDP) or sharded (FSDP), against one process that
    accumulates the same two batches per optimiser step: the same logged loss at every step and the same weights, on
    every process; the FSDP checkpoint resumes."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from ddp_train_worker import config, make_draft

    target = tiny_target("llama")
    feats = tmp_path / "features"
    cache_features(target, tiny_records(target, n=20, new=16), feats, [2, 3, 3], per_shard=4, dtype=torch.float32,
                   progress=False)

    def losses(out):
        return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]

    one = train(make_draft(feats, 0), feats, tmp_path / "one", config(0, "last", accumulate=2), log=lambda s: None)
    reference = losses(tmp_path / "one")
    assert len(reference) >= 4
    for mode in ("ddp", "fsdp"):
        out = tmp_path / mode
        _torchrun_training(feats, out, 0, "last", mode)
        assert losses(out) == pytest.approx(reference, rel=1e-4, abs=1e-6), mode
        for rank in (0, 1):
            state = torch.load(out / f"rank{rank}.pt", weights_only=False)["state"]
            for k, v in one.state_dict().items():
                torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=f"{mode} rank {rank} {k}")
        checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
        assert checkpoint["layout"] == {"processes": 2, "accumulate": 1, "fsdp": mode == "fsdp"}
    # a rerun of the FSDP run resumes at its end (the full checkpoint loads into the shards) and trains nothing more
    (tmp_path / "fsdp" / "rank0.pt").unlink()
    _torchrun_training(feats, tmp_path / "fsdp", 0, "last", "fsdp")
    assert losses(tmp_path / "fsdp") == pytest.approx(reference, rel=1e-4, abs=1e-6)
    state = torch.load(tmp_path / "fsdp" / "rank0.pt", weights_only=False)
    assert state["seen"] == []
    for k, v in one.state_dict().items():
        torch.testing.assert_close(state["state"][k], v, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="Resume with the same number of processes, --accumulate and --fsdp"):
        train(make_draft(feats, 0), feats, tmp_path / "fsdp", config(0, "last"), log=lambda s: None)


@pytest.mark.parametrize("max_minutes", [0.0, 0.04])
def test_data_parallel_training_on_two_processes(tmp_path, max_minutes):
    """Two processes (torchrun, gloo on CPU, as ``accelerate launch`` on GPUs): each trains on its own half of every
    round of batches, both end with the same weights (also when a time budget, read off each machine's clock, ends
    training, and when the main process selects the best checkpoint on the held-out shards), and only one process
    writes the log and the checkpoint."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from ddp_train_worker import fingerprint

    from hf_eagle3.training.features import FeatureShards

    target = tiny_target("llama")
    feats = tmp_path / "features"
    cache_features(target, tiny_records(target, n=20, new=16), feats, [2, 3, 3], per_shard=4, dtype=torch.float32,
                   progress=False)
    out = tmp_path / "run"
    _torchrun_training(feats, out, max_minutes, "holdout" if max_minutes else "last", "ddp")
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(r0["seen"]) == len(r1["seen"]) > 0
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k
    data = FeatureShards(feats, 256, 256, holdout_shards=1)
    expected = ([], [])  # every epoch: rank 0 takes batches 0, 2, 4, ..., rank 1 batches 1, 3, 5, ...
    for epoch in range(len(r0["seen"]) + 1):
        batches = [fingerprint(items) for _, _, items in data.batches(epoch)]
        rounds = len(batches) // 2
        expected[0].extend(batches[0 : 2 * rounds : 2])
        expected[1].extend(batches[1 : 2 * rounds : 2])
    assert r0["seen"] == expected[0][: len(r0["seen"])] and r1["seen"] == expected[1][: len(r1["seen"])]
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in logged if "loss" in r]
    assert steps == list(range(1, len(r0["seen"]) + 1))  # one writer
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["step"] == len(r0["seen"])
    returned = torch.load(out / "best.pt", weights_only=False)["model"] if max_minutes else state["model"]
    for k, v in returned.items():
        assert torch.equal(v, r0["state"][k]), k
    assert (out / "best.pt").exists() == bool(max_minutes)
    if max_minutes:
        scored = [r["step"] for r in logged if "holdout_acceptance_length" in r]
        assert scored and scored[-1] == len(r0["seen"])  # every checkpoint scored, the last one included
    if not max_minutes:  # 2 epochs, an incomplete last round left out
        assert len(r0["seen"]) == 2 * (data.num_batches() // 2)


def test_train_cli_end_to_end_and_exports_reload(tmp_path):
    """`hf-eagle3 train`: vocab -> features -> TTT -> save; flat and speculators exports reload identically."""
    import json

    from hf_eagle3.training.cli import main

    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = _responses_dir(tmp_path / "data", tiny_records(target, n=12, new=16))
    out = tmp_path / "out"
    main(["train", "--target", str(tmp_path / "target"), "--data", str(data), "--out", str(out),
          "--draft-vocab-size", "64", "--per-shard", "4", "--max-steps", "3", "--batch-tokens", "256",
          "--mixed-precision", "no", "--save-dtype", "float32", "--export-flat", "--export-speculators",
          "--feature-dtype", "float32"])
    native = hf_eagle3.Eagle3DraftModel.from_pretrained(out / "draft")
    assert native.config.draft_vocab_size == 64 and native.config.feature_layer_ids == [2, 3, 3]
    summary = json.loads((out / "draft" / "training_summary.json").read_text())
    assert summary["records"] == 12 and len(summary["holdout"]["acc"]) == 7
    chain = summary["holdout"]["chain"]  # the held-out greedy answers replayed as chain decoding (5 tokens a round)
    assert chain["k"] == 5 and chain["num_drafts"] > 0 and len(chain["drafted_per_position"]) == 5
    assert chain["mean_acceptance_length"] == 1 + sum(chain["accepted_per_position"]) / chain["num_drafts"]
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    ref = target.generate(ids, assistant_model=native, max_new_tokens=12, do_sample=False)
    feats = torch.randn(1, 6, 3 * 64)
    native.bind_target(target)
    expected = native(input_ids=ids, target_features=feats).logits
    for layout in ("export-flat", "export-speculators"):
        other = hf_eagle3.Eagle3DraftModel.from_pretrained(out / layout)
        assert other.config.feature_layer_ids == [2, 3, 3]
        other.bind_target(target)
        torch.testing.assert_close(other(input_ids=ids, target_features=feats).logits, expected)
        assert torch.equal(target.generate(ids, assistant_model=other, max_new_tokens=12, do_sample=False), ref)
    # Continue from it with a vocabulary rebuilt (and grown) from the data: the CLI path of --rebuild-vocab.
    main(["train", "--target", str(tmp_path / "target"), "--data", str(data), "--out", str(tmp_path / "again"),
          "--features-dir", str(out / "features"), "--skip-features", "--init-draft", str(out / "draft"),
          "--rebuild-vocab", "--vocab-data", str(data), "--draft-vocab-size", "80", "--max-steps", "2",
          "--batch-tokens", "256", "--mixed-precision", "no", "--save-dtype", "float32"])
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "again" / "draft")
    assert again.config.draft_vocab_size == 80 and again.lm_head.out_features == 80
    assert torch.equal(target.generate(ids, assistant_model=again, max_new_tokens=12, do_sample=False), ref)


def test_train_vocabulary_counts_all_of_data_when_max_records_cuts_the_feature_pass(tmp_path):
    """``train --max-records N`` caches features for the first N records only; the draft vocabulary (new, or rebuilt
    with ``--rebuild-vocab``) still counts the answers of every record of ``--data``, so a token that only the later
    records use is in it."""
    from hf_eagle3.training.cli import main

    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt_ids": torch.randint(4, 256, (6,), generator=g).tolist(),
                "response_ids": (torch.randint(4, 40, (12,), generator=g).tolist() if i < 2 else [200, 201] * 6)}
               for i in range(8)]
    data = _responses_dir(tmp_path / "data", records)
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--max-records", "2", "--per-shard", "1",
              "--max-steps", "1", "--batch-tokens", "64", "--mixed-precision", "no", "--save-dtype", "float32",
              "--feature-dtype", "float32"]
    main(["train", *common, "--out", str(tmp_path / "new"), "--draft-vocab-size", "16"])
    d2t, _ = torch.load(tmp_path / "new" / "vocab.pt")
    used = (torch.arange(16) + d2t).tolist()
    assert 200 in used and 201 in used  # only records 3..8 hold them: counted although they have no features
    assert len(list((tmp_path / "new" / "features").glob("shard-*.pt"))) == 2  # the feature pass took 2 records
    first = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "new" / "draft")
    with torch.no_grad():  # a draft whose vocabulary lacks them, rebuilt from --data alone (no --vocab-data)
        first.d2t.zero_()
    first.save_pretrained(tmp_path / "narrow")
    assert 200 not in (torch.arange(16) + hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "narrow").d2t).tolist()
    main(["train", *common, "--out", str(tmp_path / "again"), "--features-dir", str(tmp_path / "new" / "features"),
          "--skip-features", "--init-draft", str(tmp_path / "narrow"), "--rebuild-vocab", "--draft-vocab-size", "16"])
    again = hf_eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "again" / "draft")
    assert {200, 201} <= set((torch.arange(16) + again.d2t).tolist())


@pytest.mark.slow
def test_prepare_is_resumable(tmp_path):
    """Responses are regenerated with the target's chat template; a rerun answers only the missing prompts."""
    import json

    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path
    from hf_eagle3.training.prepare import done_turns, iter_records, prepare

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question number {i}?"}) + "\n" for i in range(5)))
    out = tmp_path / "data"
    prepare(target, tok, prompts, out, max_prompts=3, max_new_tokens=6, batch_size=2, progress=False)
    assert set(done_turns(out)) == {("p0", 0), ("p1", 0), ("p2", 0)}
    with open(next(out.glob("responses-*.jsonl")), "a") as f:
        f.write('{"id": "p3", "prompt_ids": [1, 2')  # a line cut by an interruption
    prepare(target, tok, prompts, out, max_new_tokens=6, batch_size=2, progress=False)
    records = list(iter_records(out))
    assert sorted(r["id"] for r in records) == ["p0", "p1", "p2", "p3", "p4"]  # nothing answered twice
    expected = tok.apply_chat_template([{"role": "user", "content": "Question number 4?"}], add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    rec = next(r for r in records if r["id"] == "p4")
    assert rec["prompt_ids"] == list(expected) and 1 <= len(rec["response_ids"]) <= 6


@pytest.mark.slow
def test_prepare_shares_the_prompts_between_processes(tmp_path, monkeypatch):
    """`prepare(num_shards=, shard_index=)` (one process per GPU): each process answers its share into files of its
    own in the same directories; together they answer every prompt once, features included; reruns resume."""
    import json

    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path
    from hf_eagle3.training.cli import process_share
    from hf_eagle3.training.prepare import iter_records, prepare

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(7)))
    out, feats = tmp_path / "data", tmp_path / "features"
    kwargs = dict(max_new_tokens=5, batch_size=2, progress=False, features_dir=feats, layer_ids=[0, 1, 1],
                  feature_dtype=torch.float32, num_shards=2)
    for index in (0, 1):
        prepare(target, tok, prompts, out, shard_index=index, **kwargs)
    by_file = {f.name: [json.loads(line)["id"] for line in f.read_text().splitlines()] for f in out.iterdir()}
    assert by_file == {"responses-p0-00000.jsonl": ["p0", "p2", "p4", "p6"],
                       "responses-p1-00000.jsonl": ["p1", "p3", "p5"]}
    shards = sorted(p.name for p in feats.glob("shard-*.pt"))
    assert shards == ["shard-p0-00000.pt", "shard-p0-00001.pt", "shard-p1-00000.pt", "shard-p1-00001.pt"]
    in_shards = [item["id"] for name in shards for item in torch.load(feats / name, weights_only=False)]
    assert sorted(in_shards) == [f"p{i}" for i in range(7)]
    assert sorted(r["id"] for r in iter_records(out)) == [f"p{i}" for i in range(7)]
    prepare(target, tok, prompts, out, shard_index=1, **kwargs)  # rerun: its share is done, nothing is added
    assert len(list(out.iterdir())) == 2 and len(list(feats.glob("shard-*.pt"))) == 4
    assert len(list(iter_records(out))) == 7
    with pytest.raises(ValueError, match="0 <= shard_index < num_shards"):
        prepare(target, tok, prompts, tmp_path / "bad", shard_index=2, **kwargs)
    assert not (tmp_path / "bad").exists()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert process_share(None, None) == (4, 3) and process_share(2, 0) == (2, 0)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert process_share(None, None) == (1, 0)


@pytest.mark.parametrize("do_sample", [False, True])
def test_prepare_writes_the_features_cache_features_would(tmp_path, do_sample):
    """Features captured during generation (left-padded batches) equal a separate cache_features pass."""
    import json

    from transformers import AutoTokenizer

    from hf_eagle3.smollm2 import smollm2_path
    from hf_eagle3.training.prepare import iter_records, prepare

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    target = tiny_target("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = tmp_path / "prompts.jsonl"
    texts = ["Hi?", "Tell me about the sea, the sky and the wind.", "Why?", "A much longer question " * 3]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out, fused = tmp_path / "data", tmp_path / "fused"
    prepare(target, tok, prompts, out, max_new_tokens=7, batch_size=3, do_sample=do_sample, progress=False,
            features_dir=fused, layer_ids=[0, 1, 1], feature_dtype=torch.float32, max_feature_prompt_tokens=6)
    records = list(iter_records(out))
    reference = cache_features(target, records, tmp_path / "ref", [0, 1, 1], per_shard=100, dtype=torch.float32,
                               progress=False)
    ref = {item["id"]: item for item in torch.load(reference[0], weights_only=False)}
    shards = sorted(fused.glob("shard-*.pt"))
    assert len(shards) == 2 and (fused / "target_head.pt").exists()
    items = [item for path in shards for item in torch.load(path, weights_only=False)]
    assert sorted(item["id"] for item in items) == ["p0", "p1", "p2", "p3"]
    for item in items:
        r = ref[item["id"]]
        p = int(r["prompt_len"])
        keep = min(p, 6)
        n = len(item["input_ids"])
        assert item["prompt_len"] == keep
        assert n == len(r["input_ids"]) - p + keep - (0 if len(r["input_ids"]) - p < 7 else 1)  # unfed last token
        span = slice(p - keep, p - keep + n)
        assert torch.equal(item["input_ids"], r["input_ids"][span])
        torch.testing.assert_close(item["features"], r["features"][span], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(item["last_hidden"], r["last_hidden"][span], atol=1e-4, rtol=1e-4)
        assert torch.equal(item["target_argmax"], r["target_argmax"][span])
    # generation itself is unchanged by the recording, and no hook stays behind
    assert not any(layer._forward_pre_hooks for layer in target.model.layers) and not target.model._forward_hooks
    with pytest.raises(ValueError, match="other layer ids"):
        prepare(target, tok, prompts, tmp_path / "data2", max_new_tokens=2, progress=False, features_dir=fused,
                layer_ids=[0, 1, 0])
    with pytest.raises(ValueError, match="out of range"):  # refused before any file is written
        prepare(target, tok, prompts, tmp_path / "data3", max_new_tokens=2, progress=False,
                features_dir=tmp_path / "bad", layer_ids=[0, 1, 99])
    assert not (tmp_path / "bad").exists()
    assert not any(layer._forward_pre_hooks for layer in target.model.layers) and not target.model._forward_hooks


def test_remap_draft_vocab_keeps_trained_rows_and_takes_new_ones_from_the_target():
    """``train --init-draft --rebuild-vocab``: tokens both vocabularies hold keep the draft's trained output rows
    (their scores do not move), new tokens start from the target's rows, and the mapping is consistent."""
    from hf_eagle3.training.vocab import remap_draft_vocab

    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab_size=64).float()
    old_used = (torch.arange(64) + draft.d2t).tolist()
    shared = old_used[:40]
    fresh = [t for t in range(4, 256) if t not in old_used][:30]
    counts = Counter({t: 100 for t in shared} | {t: 50 for t in fresh})
    d2t, t2d = build_vocab_mapping(counts, 70, 256)
    features = torch.randn(1, 3, 3 * 64)
    ids = torch.tensor([[5, 6, 7]])
    draft.bind_target(target)
    before = draft(input_ids=ids, target_features=features).logits[0, -1]
    old_rows = {t: draft.lm_head.weight[i].clone() for i, t in enumerate(old_used)}
    head = target.lm_head.weight.detach()
    rows = remap_draft_vocab(draft, d2t, t2d, head)
    new_used = (torch.arange(70) + d2t).tolist()
    assert rows == {"kept": 40, "new": 30, "mapped": False} and draft.config.draft_vocab_size == 70 and draft.lm_head.out_features == 70
    check_vocab_mapping(draft.d2t, draft.t2d)
    for i, t in enumerate(new_used):
        expected = old_rows[t] if t in old_rows else head[t]
        torch.testing.assert_close(draft.lm_head.weight[i], expected, rtol=0, atol=0)
    after = draft(input_ids=ids, target_features=features).logits[0, -1]
    for t in shared:  # the same hidden state, the same row: the same score
        torch.testing.assert_close(after[new_used.index(t)], before[old_used.index(t)], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="same target"):
        remap_draft_vocab(draft, *build_vocab_mapping(Counter({5: 1}), 10, 300), head)


def test_remap_draft_vocab_maps_new_rows_like_the_trained_ones():
    """With enough kept rows, a new token's row is the target's row through the map that takes the kept tokens'
    target rows to their trained rows: exact when training moved every row by one linear map."""
    from hf_eagle3.training.vocab import remap_draft_vocab

    target = tiny_target("llama")
    head = target.lm_head.weight.detach()
    draft = tiny_draft(target, draft_vocab_size=160).float()
    old_used = (torch.arange(160) + draft.d2t).tolist()
    turn = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) / 8
    with torch.no_grad():  # "training" turned and scaled every row the same way
        draft.lm_head.weight.copy_(head[old_used] @ turn)
    fresh = [t for t in range(256) if t not in old_used][:40]
    d2t, t2d = build_vocab_mapping(Counter({t: 100 for t in old_used} | {t: 50 for t in fresh}), 200, 256)
    rows = remap_draft_vocab(draft, d2t, t2d, head)
    assert rows == {"kept": 160, "new": 40, "mapped": True}
    new_used = (torch.arange(200) + d2t).tolist()
    for t in fresh:
        torch.testing.assert_close(draft.lm_head.weight[new_used.index(t)], head[t] @ turn, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(draft.lm_head.weight[new_used.index(t)], head[t], atol=1e-2)


def test_train_seed_orders_the_shards_and_reaches_the_trainer(tmp_path, monkeypatch):
    """``train --seed`` changes the order in which shards are read (so that a run continuing a draft for part of a
    pass can start with other shards than the last run), the same seed gives the same order, and the CLI hands the
    seed to the trainer."""
    from hf_eagle3.training import trainer as trainer_module
    from hf_eagle3.training.cli import main
    from hf_eagle3.training.features import FeatureShards

    target = tiny_target("llama")
    records = tiny_records(target, n=6, new=8)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [1, 2, 4], per_shard=1, dtype=torch.float32, progress=False)

    def order(seed):
        return [path.name for path, _, _ in FeatureShards(feats, 256, seed=seed).batches(0)]

    assert len(order(0)) == 6 and order(0) == order(0)
    assert any(order(seed) != order(0) for seed in range(1, 6))

    data = _responses_dir(tmp_path / "data", records)
    seen = []

    class Stop(Exception):
        pass

    def fake_train(draft, features_dir, run_dir, cfg, **kw):
        seen.append(cfg.seed)
        raise Stop

    monkeypatch.setattr(trainer_module, "train", fake_train)
    with pytest.raises(Stop):
        main(["train", "--data", str(data), "--out", str(tmp_path / "out"), "--skip-features", "--features-dir",
              str(feats), "--draft-vocab-size", "64", "--seed", "7", "--mixed-precision", "no"])
    assert seen == [7]


def test_train_returns_the_checkpoint_best_on_the_held_out_shards(tmp_path, monkeypatch):
    """select_by="holdout": every checkpoint is scored by the replayed chain acceptance on the held-out shards, the
    log says each score, and the weights returned are the best checkpoint's (here an early one, forced by a scorer
    that prefers early steps), equal to a run stopped at that step; "last" returns the last weights."""
    import json

    from hf_eagle3.training import trainer as trainer_module

    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    records = tiny_records(target, n=16)
    feats = tmp_path / "features"
    cache_features(target, records, feats, [2, 3, 3], per_shard=4, dtype=torch.float32, progress=False)
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(count_tokens(r["response_ids"] for r in records), 128, 256)

    def new_draft():
        torch.manual_seed(0)
        return init_draft(draft_config_for_target(head["config"], 128, intermediate_size=96), head, d2t, t2d)

    def cfg(**kw):
        return TrainConfig(**{**dict(lr=3e-3, epochs=3, batch_tokens=128, warmup_steps=2, ttt_length=2, log_every=1,
                                     save_every=2, mixed_precision="no", holdout_shards=1, select_chain_length=3),
                              **kw})

    lines = []
    honest = train(new_draft(), feats, tmp_path / "honest", cfg(), log=lines.append)
    scores = [json.loads(line) for line in (tmp_path / "honest" / "log.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["holdout_acceptance_length"] for r in scores if "holdout_acceptance_length" in r}
    assert len(scores) >= 3 and 2 in scores and 4 in scores
    selection = json.loads((tmp_path / "honest" / "selection.json").read_text())
    assert selection["selected_score"] == pytest.approx(max(scores.values()), abs=1e-4)
    assert lines[-1].startswith(f"selected the checkpoint of step {selection['selected_step']}")
    replayed = evaluate(honest, feats, ttt_length=1, holdout_shards=1, chain_length=3, batch_tokens=128)
    assert replayed["chain"]["mean_acceptance_length"] == pytest.approx(selection["selected_score"], abs=1e-4)

    calls = []

    class Early:  # a scorer that prefers early checkpoints: the first one scored (step 2) wins
        def __init__(self, *args):
            calls.append(args)
            self.mean_acceptance_length = 10.0 - len(calls)

    monkeypatch.setattr(trainer_module, "replay_chain_acceptance", Early)
    early = train(new_draft(), feats, tmp_path / "early", cfg(), log=lambda s: None)
    monkeypatch.undo()
    assert json.loads((tmp_path / "early" / "selection.json").read_text())["selected_step"] == 2
    stopped = train(new_draft(), feats, tmp_path / "stopped", cfg(max_steps=2, select_by="last"), log=lambda s: None)
    last = train(new_draft(), feats, tmp_path / "last", cfg(select_by="last"), log=lambda s: None)
    assert not (tmp_path / "last" / "best.pt").exists()
    for a, b, c in zip(early.state_dict().values(), stopped.state_dict().values(), last.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(early.state_dict().values(), last.state_dict().values()))
    with pytest.raises(ValueError, match="holdout_shards >= 1"):
        train(new_draft(), feats, tmp_path / "none", cfg(holdout_shards=0), log=lambda s: None)
    assert not (tmp_path / "none").exists()
