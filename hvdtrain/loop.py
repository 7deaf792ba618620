"""The training loop as plain functions of model, optimizer, batches and engine.

No Horovod here: the engine does every collective. Losses are accumulated as tensors
and read once per epoch, so the loop never waits on the device for a metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.engine import Engine


@dataclass
class EpochResult:
    loss: float
    """Mean loss per sample over all ranks."""
    samples: int
    """Samples seen by all ranks together."""


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, engine: Engine,
                    clip_grad_norm: Optional[float]) -> None:
    """One optimizer step on gradients combined over all ranks.

    Horovod's order: wait for the allreduce, then touch the gradients (clip them
    here; a gradient scaler would unscale them here), then step without a second
    allreduce. Clipping before `synchronize` would clip each rank's local gradient.
    """
    engine.synchronize(optimizer)  # dist: gradients are now the average over ranks
    if clip_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    with engine.skip_synchronize(optimizer):
        optimizer.step()
    optimizer.zero_grad()  # set_to_none by default; Horovod's override takes no arguments


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, engine: Engine, batches: Iterable,
                *, first_step: int, learning_rate: Callable[[int], float], accumulate: int = 1,
                clip_grad_norm: Optional[float] = None,
                on_step: Callable[[int, torch.Tensor], None] | None = None) -> tuple[EpochResult, int]:
    """Trains on every batch; returns the epoch's reduced loss and the next step number."""
    model.train()
    device = engine.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    step = first_step
    for index, (inputs, targets) in enumerate(batches):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = F.cross_entropy(model(inputs), targets)
        (loss / accumulate).backward()  # dist: Horovod allreduces after `accumulate` passes
        loss_sum += loss.detach() * len(targets)
        samples += len(targets)
        if (index + 1) % accumulate == 0:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step)
            apply_gradients(model, optimizer, engine, clip_grad_norm)
            step += 1
            if on_step is not None:
                on_step(step, loss.detach())
    totals = engine.allreduce_sum(torch.stack([loss_sum, loss_sum.new_tensor(samples)]).cpu(), "train_loss")
    total_samples = int(totals[1])
    return EpochResult(float(totals[0]) / max(1, total_samples), total_samples), step


@dataclass
class EvalResult:
    loss: float
    accuracy: float
    samples: int


@torch.no_grad()
def evaluate(model: nn.Module, engine: Engine, batches: Iterable) -> EvalResult:
    """Loss and accuracy over every validation sample, each counted once across ranks."""
    model.eval()
    device = engine.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for inputs, targets in batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(inputs)
        totals[0] += F.cross_entropy(logits, targets, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    totals = engine.allreduce_sum(totals.cpu(), "eval")  # dist: sums, so the mean is exact
    count = int(totals[2])
    return EvalResult(float(totals[0]) / max(1, count), float(totals[1]) / max(1, count), count)
