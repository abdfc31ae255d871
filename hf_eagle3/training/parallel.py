"""How training spreads over processes: one process, data parallel with replicated weights (DDP, through
``accelerate``), or data parallel with sharded weights, gradients and optimiser state (FSDP, PyTorch's
``fully_shard``), for drafts whose vocabulary head or optimiser state do not fit on one device.

Every process takes its own batches in all three; the optimiser step sees the gradient averaged over the processes'
batches, so one process accumulating their batches reaches the same weights (``tests/training/test_parallel.py`` compares
the loss curves). Launch several processes with ``torchrun`` or ``accelerate launch``.
"""

from __future__ import annotations

import contextlib

import torch


class DataParallel:
    """The training objective, wrapped for the processes there are, with its optimiser.

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (device, process group, autocast).
        objective: the module whose ``forward`` returns the loss (``TTTObjective``); its ``draft`` is trained.
        make_optimizer: builds the optimiser from a list of parameters (called once they are in their final form).
        fsdp: shard weights, gradients and optimiser state over the processes (FSDP) instead of replicating them
            (DDP); with one process there is nothing to shard and this changes nothing.
    """

    def __init__(self, accelerator, objective: torch.nn.Module, make_optimizer, fsdp: bool = False):
        self.accelerator = accelerator
        self.sharded = fsdp and accelerator.num_processes > 1
        if fsdp and accelerator.mixed_precision == "fp16":
            raise ValueError("FSDP training runs in float32 or bfloat16 autocast, not with float16's loss scaling: "
                             "pass --mixed-precision bf16 or no (or drop --fsdp).")
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            objective.to(accelerator.device)
            with torch.no_grad():  # start every process from the main process's weights, as DDP does
                for tensor in objective.state_dict().values():
                    torch.distributed.broadcast(tensor, src=0)
            fully_shard(objective.draft.midlayer)
            fully_shard(objective)
            self.model = objective
            self.optimizer = make_optimizer([p for p in objective.parameters() if p.requires_grad])
            self.step_optimizer = self.optimizer
        else:
            self.optimizer = make_optimizer([p for p in objective.parameters() if p.requires_grad])
            self.model, self.step_optimizer = accelerator.prepare(objective, self.optimizer)
        self.draft = accelerator.unwrap_model(self.model).draft if not self.sharded else objective.draft

    def no_sync(self, skip: bool):
        """A context in which backward accumulates gradients without averaging them over processes (``skip``: the
        micro-batch is not the last of an optimiser step)."""
        if not skip or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        if self.sharded:
            return _fsdp_no_sync(self.model)
        return self.accelerator.no_sync(self.model)

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip the gradient norm over all parameters (of every shard)."""
        if self.sharded:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        else:
            self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    def model_state(self) -> dict:
        """The draft's full state dict on every process (a collective under FSDP: every process must call it)."""
        if not self.sharded:
            return self.draft.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k.removeprefix("draft."): v for k, v in full.items()}

    def optimizer_state(self) -> dict:
        """The optimiser's state for a checkpoint (full, a collective under FSDP)."""
        if not self.sharded:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, model_state: dict, optimizer_state: dict) -> None:
        """Load a checkpoint written by :meth:`model_state` / :meth:`optimizer_state` (every process)."""
        if not self.sharded:
            self.draft.load_state_dict(model_state)
            self.optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, {f"draft.{k}": v for k, v in model_state.items()}, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    """FSDP's counterpart of DDP's ``no_sync``: gradients stay unsharded and unreduced until the last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
