"""Chain acceptance replayed from cached features equals what greedy chain decoding accepts."""


import pytest
import torch

import hf_eagle3
from hf_eagle3.loading import shipped_draft_path
from hf_eagle3.training.features import FeatureShards, cache_features
from hf_eagle3.training.replay import replay_chain_acceptance, replay_record

DRAFT = shipped_draft_path()


def test_replay_record_walks_rounds_like_decoding():
    """Hand-made predictions: rounds start after the target's token, accept the longest matching run, and stop
    where the recorded answer leaves the target's greedy path."""
    ids = torch.arange(100, 113)  # 2 prompt tokens, 11 answer tokens
    argmax = torch.cat([ids[1:], torch.tensor([0])])  # the answer is the target's greedy continuation
    k, n = 3, len(ids)
    preds = torch.full((k, n - 1), -1)
    # round 1 starts after token 2 (the prefill's), base t = 1: steps guess tokens 3, 4, 5; two are right
    preds[0, 1], preds[1, 1], preds[2, 1] = ids[3], ids[4], -7
    # round 2 starts after token 5 (target's token), base 4: nothing right
    # round 3 starts after token 6, base 5: all three right (tokens 7, 8, 9)
    preds[0, 5], preds[1, 5], preds[2, 5] = ids[7], ids[8], ids[9]
    # round 4 starts after token 10: room for one step (token 11) before the target's token 12 ends the answer
    preds[0, 9] = ids[11]
    stats = replay_record(preds, ids, argmax, prompt_len=2)
    assert stats.num_drafts == 4
    assert stats.drafted_per_position == [4, 3, 3]
    assert stats.accepted_per_position == [3, 2, 1]  # runs of 2, 0, 3, 1 accepted tokens
    # the prefill and 4 drafting rounds (the last one's target token ends the answer) make the 11 answer tokens
    assert (stats.num_target_forwards, stats.num_rounds_without_draft, stats.num_output_tokens) == (5, 0, 11)

    # token 8 sampled (not the target's argmax after token 7): the replay ends at token 7, so round 2 drafts only
    # token 6 and token 7 is the target's own
    off = argmax.clone()
    off[7] = 5
    stats = replay_record(preds, ids, off, prompt_len=2)
    assert (stats.num_drafts, stats.drafted_per_position, stats.accepted_per_position) == (2, [2, 1, 1], [1, 1, 0])
    # tokens 2..7: the prefill, two rounds, and token 7 from a round with no room for a draft
    assert (stats.num_target_forwards, stats.num_rounds_without_draft, stats.num_output_tokens) == (4, 1, 6)
    off[1] = 0  # the prefill's own token is not the target's: nothing to replay
    assert replay_record(preds, ids, off, prompt_len=2).num_target_forwards == 0
    with pytest.raises(ValueError, match="prompt token"):
        replay_record(preds, ids, argmax, prompt_len=0)


@pytest.mark.slow
def test_replay_equals_greedy_chain_decoding_on_smollm2(smollm2, tmp_path):
    """The shipped draft on SmolLM2: the replay over features of the decoded answers reports the rounds and the
    accepted tokens per position that decoding counted."""
    target, tok = smollm2
    draft = hf_eagle3.Eagle3DraftModel.from_pretrained(DRAFT, dtype=torch.float32)
    records, stats = [], None
    for i, prompt in enumerate(["Explain why the sky is blue in two sentences.",
                                "Write a Python function that returns the n-th Fibonacci number."]):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False, num_assistant_tokens=5,
                              num_assistant_tokens_schedule="constant")
        stats = draft.last_stats if stats is None else stats + draft.last_stats
        records.append({"id": str(i), "prompt_ids": ids[0].tolist(), "response_ids": out[0, ids.shape[1]:].tolist()})
    layer_ids = draft.config.resolve_feature_layer_ids(target.config.num_hidden_layers)
    cache_features(target, records, tmp_path, layer_ids, dtype=torch.float32, progress=False)
    items = FeatureShards(tmp_path).records()
    draft.bind_target(target)
    replay = replay_chain_acceptance(draft, items, k=5)
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 5  # the draft really drafts
    assert replay.to_dict() == stats.to_dict()  # rounds, drafted and accepted per position, forwards, tokens
