"""The training loop as plain functions of model, optimizer, batches and engine.

No Horovod here: the engine does every collective. Losses are accumulated as tensors
and read once per epoch, so the loop never waits on the device for a metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.engine import Engine
from hvdtrain.precision import FP32, Precision

# float32 needs no autocast and no scaler, so one instance serves every device.
FULL_PRECISION = Precision(FP32, torch.device("cpu"))


@dataclass
class EpochResult:
    loss: float
    """Mean loss per sample over all ranks (of the steps kept)."""
    samples: int
    """Samples seen by all ranks together."""
    skipped_steps: int = 0
    """Steps dropped for a non-finite loss (nonfinite=skip)."""


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, engine: Engine,
                    clip_grad_norm: Optional[float], precision: Precision = FULL_PRECISION,
                    check_finite: bool = False) -> bool:
    """One optimizer step on gradients combined over all ranks.

    Horovod's order: wait for the allreduce, then touch the gradients (unscale and
    clip them), then step without a second allreduce. Clipping or unscaling before
    `synchronize` would act on each rank's local gradient.

    With `check_finite`, returns False (and leaves the weights alone) when the
    gradients hold NaN or Inf. They are the same on every rank after the allreduce,
    and a NaN on one rank reaches all, so every rank decides the same way.
    """
    engine.synchronize(optimizer)  # dist: gradients are now the average over ranks
    precision.unscale(optimizer)
    finite = True
    if check_finite and precision.scaler is None:  # the fp16 scaler makes this check itself
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()) if grads else True
    if finite:
        if clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        with engine.skip_synchronize(optimizer):
            precision.step(optimizer)
    optimizer.zero_grad()  # set_to_none by default; Horovod's override takes no arguments
    return finite


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     precision: Precision = FULL_PRECISION, accumulate: int = 1) -> torch.Tensor:
    """One (micro-)batch's loss and backward pass; returns the loss, detached."""
    with precision.autocast():
        loss = F.cross_entropy(model(inputs), targets)
    precision.backward(loss / accumulate)  # dist: Horovod allreduces after `accumulate` passes
    return loss.detach()


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, engine: Engine, batches: Iterable,
                *, first_step: int, learning_rate: Callable[[int], float], accumulate: int = 1,
                clip_grad_norm: Optional[float] = None, precision: Precision = FULL_PRECISION,
                channels_last: bool = False, nonfinite: str = "error",
                on_step: Callable[[int, torch.Tensor], None] | None = None) -> tuple[EpochResult, int]:
    """Trains on every batch; returns the epoch's reduced loss and the next step number."""
    model.train()
    device = engine.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = kept = skipped = 0
    step = first_step
    window_losses: list[torch.Tensor] = []  # this step's micro-batch losses, to name a bad rank
    for index, (inputs, targets) in enumerate(batches):
        inputs, targets = to_device(inputs, targets, device, channels_last)
        loss = forward_backward(model, inputs, targets, precision, accumulate)
        window_losses.append(loss * len(targets))
        samples += len(targets)
        if (index + 1) % accumulate == 0:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step)
            if apply_gradients(model, optimizer, engine, clip_grad_norm, precision, check_finite=True):
                loss_sum += torch.stack(window_losses).sum()
                kept += len(targets) * accumulate
            elif nonfinite == "skip":
                skipped += 1
            else:
                _stop_on_nonfinite(engine, step, torch.stack(window_losses).sum())
            window_losses = []
            step += 1
            if on_step is not None:
                on_step(step, loss)
    totals = engine.allreduce_sum(
        torch.stack([loss_sum, loss_sum.new_tensor(samples), loss_sum.new_tensor(kept)]).cpu(), "train_loss")
    return EpochResult(float(totals[0]) / max(1, int(totals[2])), int(totals[1]), skipped), step


def _stop_on_nonfinite(engine: Engine, step: int, local_loss: torch.Tensor) -> None:
    """Every rank gets here at the same step; name the ranks whose own loss was not finite."""
    from hvdtrain.errors import TrainingStopped

    losses = engine.allgather_object(float(local_loss), "nonfinite")  # dist
    bad = [f"rank {rank} (loss {value})" for rank, value in enumerate(losses) if not math.isfinite(value)]
    where = ", ".join(bad) or "no rank's loss, but the gradients"
    raise TrainingStopped(
        f"non-finite loss at step {step + 1} on {where}: training stopped on every rank and the checkpoints "
        "are kept; lower --lr, clip with --clip-grad-norm, or pass --nonfinite skip to drop such steps")


@dataclass
class EvalResult:
    loss: float
    accuracy: float
    samples: int


@torch.no_grad()
def evaluate(model: nn.Module, engine: Engine, batches: Iterable, precision: Precision = FULL_PRECISION,
             channels_last: bool = False) -> EvalResult:
    """Loss and accuracy over every validation sample, each counted once across ranks."""
    model.eval()
    device = engine.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for inputs, targets in batches:
        inputs, targets = to_device(inputs, targets, device, channels_last)
        with precision.autocast():
            logits = model(inputs)
        totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == targets).sum()
        totals[2] += len(targets)
    totals = engine.allreduce_sum(totals.cpu(), "eval")  # dist: sums, so the mean is exact
    count = int(totals[2])
    return EvalResult(float(totals[0]) / max(1, count), float(totals[1]) / max(1, count), count)


def to_device(inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
              channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Asynchronous copies (the batches come from pinned memory on GPUs)."""
    inputs = inputs.to(device, non_blocking=True)
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets.to(device, non_blocking=True)
