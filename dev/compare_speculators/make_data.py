"""Features of the same records in both trainers' formats, for the side-by-side comparison with speculators.

Writes, under OUT:
- ``features/``: hf-eagle3's feature shards (:func:`hf_eagle3.training.features.cache_features`), shard 0 held out;
- ``speculators/``: speculators' offline layout, converted from those shards: a ``datasets`` folder with
  ``input_ids``, ``loss_mask`` (1 on answer tokens) and ``seq_len``, and ``hidden_states/hs_{i}.safetensors``
  holding ``hidden_states`` [T, 4, H] (the inputs of the three captured layers, then the last layer's state) and
  ``token_ids`` [T]; the training shards' rows first and the held-out shard's last, since speculators validates on
  the last rows (``--train-data-ratio`` is printed). speculators
  passes the last state through the target's final RMSNorm itself; the shards keep its output, so the last slot is
  that output divided by the norm's weight, which the norm maps back to it (RMSNorm does not see a vector's scale);
- ``d2t.npy`` / ``t2d.npy`` (and ``vocab.pt``, hf-eagle3's copy): one draft vocabulary for both (the most frequent
  answer tokens of the training records);
- ``responses/``: the records, where ``hf-eagle3 train --data`` reads them.

Usage: ``python dev/compare_speculators/make_data.py --out OUT --records 2000 [--draft-vocab-size 8192]``
(records from ``examples/data/smollm2-135m-instruct-responses``, chat prompts, greedy answers).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import torch

from hf_eagle3.core.configuration_eagle3 import default_feature_layer_ids
from hf_eagle3.core.feature_capture import find_decoder_layers
from hf_eagle3.loading import load_target
from hf_eagle3.training.features import cache_features
from hf_eagle3.training.vocab import build_vocab_mapping, count_tokens

DATA = Path(__file__).resolve().parents[2] / "examples/data/smollm2-135m-instruct-responses"
FILES = ["responses-00003.jsonl.gz", "responses-00006.jsonl.gz"]  # chat prompts, greedy answers


def read_records(n: int, max_length: int) -> list[dict]:
    """The first ``n`` records of the chat files, cut to ``max_length`` tokens."""
    out = []
    for name in FILES:
        with gzip.open(DATA / name, "rt") as f:
            for line in f:
                r = json.loads(line)
                room = max_length - len(r["prompt_ids"])
                if room < 16:
                    continue
                out.append({"id": r["id"], "prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"][:room]})
                if len(out) == n:
                    return out
    return out


@torch.no_grad()
def write_speculators(features: Path, out: Path, norm_weight: torch.Tensor) -> None:
    """speculators' offline dataset from hf-eagle3's feature shards in ``features`` (see the module docstring)."""
    import datasets
    from safetensors.torch import save_file

    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    i = 0
    shards = sorted(features.glob("shard-*.pt"))
    for shard in shards[1:] + shards[:1]:  # the held-out shard last
        for x in torch.load(shard, weights_only=False):
            n, h = len(x["input_ids"]), x["last_hidden"].shape[-1]
            last = (x["last_hidden"].float() / norm_weight.float()).to(torch.bfloat16)
            stacked = torch.cat([x["features"].view(n, 3, h), last[:, None]], dim=1)
            ids = x["input_ids"].long()
            save_file({"hidden_states": stacked.contiguous(), "token_ids": ids.clone()},
                      str(hs_dir / f"hs_{i}.safetensors"))
            rows["input_ids"].append(ids.tolist())
            rows["loss_mask"].append([0] * int(x["prompt_len"]) + [1] * (n - int(x["prompt_len"])))
            rows["seq_len"].append(n)
            i += 1
    datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))  # as speculators writes it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--per-shard", type=int, default=128)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(args.records, args.max_length)
    target, _ = load_target(None, torch.float32, tokenizer="none")
    layer_ids = default_feature_layer_ids(len(find_decoder_layers(target)))
    counts = count_tokens(r["response_ids"] for r in records[args.per_shard :])  # training records only
    d2t, t2d = build_vocab_mapping(counts, args.draft_vocab_size, target.config.vocab_size)
    torch.save((d2t, t2d), out / "vocab.pt")
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    (out / "responses").mkdir(exist_ok=True)  # what `hf-eagle3 train --data` reads
    (out / "responses" / "responses-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "records.json").write_text(json.dumps({"ids": [r["id"] for r in records], "layer_ids": layer_ids,
                                                  "held_out": args.per_shard}))
    cache_features(target, records, out / "features", layer_ids, per_shard=args.per_shard, max_length=args.max_length)
    if not (out / "speculators" / "dataset_info.json").exists():
        write_speculators(out / "features", out / "speculators", target.model.norm.weight)
    held = min(args.per_shard, len(records))
    ratio = (len(records) - held + 0.5) / len(records)  # int(rows * ratio) = the training rows
    print(f"{len(records)} records ({held} held out), {sum(len(r['response_ids']) for r in records)} answer tokens, "
          f"layers {layer_ids}; speculators: --train-data-ratio {ratio:.6f}")


if __name__ == "__main__":
    main()
