"""Worker of the multi-process training tests in ``training/test_parallel.py`` (run under torchrun, 2 processes).

Usage: ``torchrun --nproc_per_node 2 ddp_train_worker.py FEATURES_DIR OUT_DIR MAX_MINUTES SELECT_BY MODE`` (0 minutes:
step/epoch limits; SELECT_BY: ``holdout``, ``last`` or ``holdout-stop``, the held-out selection with an early stop
that ends the run at its first checkpoint after the start; MODE: ``ddp`` or ``fsdp``). Records a fingerprint of every
batch this process trains on and saves it with the final weights as ``OUT_DIR/rank{RANK}.pt``.
"""

import hashlib
import os
import sys
from collections import Counter
from pathlib import Path

import torch

from hf_eagle3.training import trainer
from hf_eagle3.training.vocab import build_vocab_mapping


def fingerprint(items) -> str:
    """The same string for the same batch in any process."""
    return hashlib.sha1(b"".join(x["input_ids"].numpy().tobytes() for x in items)).hexdigest()[:16]


def make_draft(feats: Path, seed: int):
    """The draft every run of these tests starts from (its random layer drawn with ``seed``)."""
    head = torch.load(feats / "target_head.pt", weights_only=False)
    d2t, t2d = build_vocab_mapping(Counter(range(4, 132)), 64, head["config"]["vocab_size"])
    torch.manual_seed(seed)
    config = trainer.draft_config_for_target(head["config"], 64, intermediate_size=96, feature_layer_ids=[2, 3, 3])
    return trainer.init_draft(config, head, d2t, t2d)


def config(minutes: float, select_by: str, **overrides) -> trainer.TrainConfig:
    """The training settings of these tests."""
    return trainer.TrainConfig(**{**dict(
        lr=3e-3, epochs=1000 if minutes else 2, batch_tokens=256, warmup_steps=2, ttt_length=3, log_every=1,
        save_every=3, mixed_precision="no", holdout_shards=1, max_minutes=minutes, select_by=select_by,
        select_chain_length=2), **overrides})


def main() -> None:
    feats, out, minutes, select_by, mode = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4], \
        sys.argv[5]
    torch.set_num_threads(1)
    seen = []
    original = trainer.collate

    def collate(items, *args, **kwargs):
        seen.append(fingerprint(items))
        return original(items, *args, **kwargs)

    trainer.collate = collate
    # different initial weights on every process: DDP and FSDP must start every process from rank 0's
    draft = make_draft(feats, int(os.environ["RANK"]))
    stop = dict(stop_gain=10.0, stop_window=1e-6) if select_by == "holdout-stop" else {}
    cfg = config(minutes, select_by.removesuffix("-stop"), fsdp=mode == "fsdp", **stop)
    final = trainer.train(draft, feats, out, cfg, log=lambda s: None)
    torch.save({"seen": seen, "state": final.state_dict()}, out / f"rank{os.environ['RANK']}.pt")
    trainer.end_distributed()


if __name__ == "__main__":
    main()
