"""speculators' own EAGLE-3 trainer (``python -m speculators.train``), run on a CPU.

speculators 0.9.0 trains on an accelerator: its trainer moves the model and batches to ``get_local_rank()`` (an
accelerator index) and autocasts on ``"cuda"`` when no accelerator is found. This launcher changes only that: the
model and batches go to the CPU, autocast runs on the CPU (bfloat16, its ``--hidden-states-dtype`` default) and its
step timer does not synchronise an accelerator.
Every other argument is speculators' own; pass ``--loss-implementation eager`` (the fused loss needs Triton),
``--draft-attn-impl sdpa`` (flex attention runs unfused without ``torch.compile`` on a CPU) and ``--num-workers 0``.

Run it in a venv holding speculators (``.ci/run`` builds one): ``python train_speculators_cpu.py --verifier-name-or-path
... --data-path ... [speculators' arguments]``.
"""

import sys

import speculators.train.checkpointer as checkpointer
import speculators.train.trainer as trainer
import torch
from speculators.train.cli import main
from speculators.train.config import TrainConfig

trainer.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda *args, **kwargs: None  # its step timer synchronises the (absent) accelerator
checkpointer.get_current_device = lambda: "cpu"
_init = trainer.Trainer.__init__


def _init_on_cpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.device_type = "cpu"


trainer.Trainer.__init__ = _init_on_cpu

if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    sys.argv[0] = "speculators.train"
    main(TrainConfig.resolve())
