"""BatchNorm's running statistics across ranks.

In training mode each rank's BatchNorm layers update their running mean and variance from that
rank's own batches, so after the first step the ranks hold different statistics: validation in `fit`
would use each rank's, a checkpoint rank 0's, and `evaluate` of that checkpoint would not reproduce
`fit`'s record. Before each validation and each checkpoint they are made the same on every rank
(train.dist_bn): `reduce` averages them (every rank's data counts, the better estimate; and, since
the running statistics are running averages, averaging them now or at the end of the epoch gives
the same result, so a resume inside an epoch stays exact), `broadcast` takes rank 0's.
"""

from __future__ import annotations

import torch
from torch import nn

from hvdtrain.engine import Engine

RUNNING = ("running_mean", "running_var")


def share_running_stats(model: nn.Module, engine: Engine, mode: str) -> None:
    """Makes every rank's running statistics the same (`reduce`: their mean; `broadcast`: rank 0's)
    in one collective; nothing for `off`, one process, or a model without them (on every rank alike)."""
    if mode == "off" or engine.size == 1:
        return
    buffers = [b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in RUNNING and b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in buffers])
    if mode == "broadcast" and not engine.is_root:
        flat.zero_()  # dist: a sum of rank 0's values and zeros is rank 0's
    total = engine.allreduce_sum(flat, "running_stats")
    shared = total / engine.size if mode == "reduce" else total
    offset = 0
    for buffer in buffers:
        buffer.copy_(shared[offset:offset + buffer.numel()].view_as(buffer))
        offset += buffer.numel()
