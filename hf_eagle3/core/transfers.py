"""Host values to the device without blocking the host.

On CUDA a copy from pageable host memory waits for every queued kernel before it starts, so a round that builds index
tensors from host lists (the accepted paths, the next roots) would stall the device pipeline once per tensor. The
loop builds them here: from pinned memory with ``non_blocking=True`` on CUDA (the host queues the copy and moves on;
PyTorch's caching host allocator keeps the pinned block until the copy is done), in place elsewhere.
"""

from __future__ import annotations

import torch


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """
    ``values`` (numbers or nested lists of them, read on the host) as a tensor on ``device``, without a copy that
    blocks the host.

    Args:
        values (`list`): the values (rectangular when nested).
        device (`torch.device` or `str`): where the tensor goes.
        dtype (`torch.dtype`): its dtype.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
