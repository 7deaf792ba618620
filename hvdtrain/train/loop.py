"""The training loop as plain functions of model, optimizer, batches and engine.

No Horovod here: the engine does every collective, and no loss or metric either: the
task says what a batch means. Losses are accumulated as tensors and read once per
epoch, so the loop never waits on the device for a metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from hvdtrain.data.batch import batch_size, to_device
from hvdtrain.train.device_batches import DeviceBatches
from hvdtrain.engine import Engine
from hvdtrain.numerics.metrics import MetricSums
from hvdtrain.numerics.precision import FP32, Precision
from hvdtrain.tasks import Task, batch_metrics, training_loss
from hvdtrain.tasks.check import Template

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


@dataclass
class EpochSums:
    """This rank's training sums so far in the epoch. A mid-epoch checkpoint keeps them reduced over
    ranks; after a resume rank 0 starts from those and the others from zero, so the epoch's loss
    still counts every step once, whatever the world size."""

    loss: float | torch.Tensor = 0.0
    samples: int = 0
    kept: int = 0
    skipped: int = 0


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
    if not engine.synchronize(optimizer):
        # Adasum: each rank stepped on its own gradients during backward and `step` combines
        # the updates, so only the combined weights are the same everywhere: check those.
        precision.step(optimizer)
        optimizer.zero_grad()
        return not check_finite or _all_finite([p.detach() for p in model.parameters()])
    shards = engine.gradient_shards  # dist: each rank holds the gradients of its share only
    precision.unscale(optimizer, None if shards is None else engine.any_rank)  # dist: averaged over ranks
    finite = True
    if check_finite and precision.scaler is None:  # the fp16 scaler makes this check itself
        finite = _all_finite([p.grad for p in model.parameters() if p.grad is not None]) if shards is None \
            else bool(shards.norms(list(model.parameters())).isfinite().all())
    if finite:
        if clip_grad_norm is not None and shards is not None:  # the norm of all shards together
            shards.clip(list(model.parameters()), clip_grad_norm)
        elif clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        with engine.skip_synchronize(optimizer):
            precision.step(optimizer)
    optimizer.zero_grad()  # set_to_none by default; Horovod's override takes no arguments
    return finite


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return bool(torch.stack(torch._foreach_norm(tensors)).isfinite().all()) if tensors else True


def forward_backward(model: nn.Module, task: Task, batch: Any, precision: Precision = FULL_PRECISION,
                     accumulate: int = 1, doing: Callable[[str], Any] = lambda phase: None) -> torch.Tensor:
    """One (micro-)batch's loss and backward pass; returns the loss, detached. `doing` hears of each phase."""
    doing("forward")
    with precision.autocast():
        loss = training_loss(task, model, batch)
    doing("backward")
    precision.backward(loss / accumulate)  # dist: Horovod allreduces after `accumulate` passes
    return loss.detach()


@dataclass(frozen=True)
class Training:
    """What each optimizer step of a run takes besides its batches (the same every epoch)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    task: Task
    learning_rate: Callable[[int], float]
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    precision: Precision = FULL_PRECISION
    channels_last: bool = False
    nonfinite: str = "error"
    augment: Optional[Callable[[Any, int, int, int], Any]] = None
    """Images: each batch, once on the device, made the augmented float batch the model sees from
    (batch, epoch, step, rank) (hvdtrain.data.augment); None: batches reach the model as loaded."""


def train_epoch(training: Training, engine: Engine, batches: Iterable, *, first_step: int, epoch: int = 0,
                sums: EpochSums | None = None,
                on_step: Callable[[int, torch.Tensor], None] | None = None) -> tuple[EpochResult, int]:
    """Trains on every batch; returns the epoch's reduced loss and the next step number. `sums`
    (updated after each step, before `on_step`) may start where a mid-epoch checkpoint left them."""
    model, optimizer, task, accumulate = training.model, training.optimizer, training.task, training.accumulate
    precision, learning_rate = training.precision, training.learning_rate
    model.train()
    device = engine.device
    sums = sums if sums is not None else EpochSums()
    loss_sum = torch.tensor(sums.loss, dtype=torch.float64, device=device)
    step = first_step
    window_losses: list[torch.Tensor] = []  # this step's micro-batch losses, to name a bad rank
    window_batches: list[Any] = []  # and its batches, to tell bad data from a bad step
    window_samples = 0
    on_device = DeviceBatches(batches, device, training.channels_last, engine.doing)
    for index, (loaded, batch) in enumerate(on_device):
        if index % accumulate == 0:  # before the forward: Adasum steps inside backward
            for group in optimizer.param_groups:  # a user's optimizer's groups keep their ratios
                group["lr"] = learning_rate(step) * group.get("lr_ratio", 1.0)
        window_batches.append(loaded)  # as loaded (on the host): only a failing step looks at it
        if training.augment is not None:  # each micro-batch draws its own; dist: each rank its own
            batch = training.augment(batch, epoch, step * accumulate + index % accumulate, engine.rank)
        size = batch_size(batch)
        loss = forward_backward(model, task, batch, precision, accumulate, engine.doing)
        on_device.stage()  # the GPU runs the backward pass meanwhile; the optimizer step waits for it
        window_losses.append(loss * size)
        window_samples += size
        if (index + 1) % accumulate == 0:
            engine.doing("the optimizer step")
            if apply_gradients(model, optimizer, engine, training.clip_grad_norm, precision, check_finite=True):
                loss_sum += torch.stack(window_losses).sum()
                sums.kept += window_samples
            elif training.nonfinite == "skip":
                sums.skipped += 1
            else:
                _stop_on_nonfinite(engine, step, torch.stack(window_losses).sum(), window_batches)
            sums.samples += window_samples
            window_losses, window_batches, window_samples = [], [], 0
            step += 1
            if on_step is not None:
                engine.doing("after the step")
                sums.loss = loss_sum  # a tensor until read: reading it would wait for the device
                on_step(step, loss)
    engine.doing("the epoch's end")
    totals = engine.allreduce_sum(
        torch.stack([loss_sum, loss_sum.new_tensor(sums.samples), loss_sum.new_tensor(sums.kept)]).cpu(), "train_loss")
    return EpochResult(float(totals[0]) / max(1, int(totals[2])), int(totals[1]), sums.skipped), step


def _stop_on_nonfinite(engine: Engine, step: int, local_loss: torch.Tensor, window: list[Any]) -> None:
    """Every rank gets here at the same step; name the ranks whose own loss was not finite, and
    whether their data was (a NaN in the input is no reason to lower the learning rate)."""
    from hvdtrain.errors import TrainingStopped

    found = (float(local_loss), _nonfinite_sample(window))
    reports = engine.allgather_object(found, "nonfinite")  # dist
    bad = [f"rank {rank} (loss {value})" for rank, (value, _) in enumerate(reports) if not math.isfinite(value)]
    where = ", ".join(bad) or "no rank's loss, but the gradients"
    data = [f"rank {rank}'s {sample}" for rank, (_, sample) in enumerate(reports) if sample]
    if data:
        raise TrainingStopped(
            f"non-finite loss at step {step + 1} on {where}: the data holds NaN or Inf ({', '.join(data)}): "
            "training stopped on every rank and the checkpoints are kept; clean the data set, or pass "
            "--nonfinite skip to drop such steps")
    raise TrainingStopped(
        f"non-finite loss at step {step + 1} on {where}: training stopped on every rank and the checkpoints "
        "are kept; lower --lr, clip with --clip-grad-norm, or pass --nonfinite skip to drop such steps")


def _nonfinite_sample(window: list[Any]) -> str | None:
    """`sample K of batch B of the step` for the first sample holding NaN or Inf, or None."""
    for number, batch in enumerate(window):
        parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
        for part in parts:
            if isinstance(part, torch.Tensor) and part.is_floating_point() and part.dim() > 0:
                bad = ~torch.isfinite(part.reshape(len(part), -1)).all(dim=1)
                if bool(bad.any()):
                    batch_note = f" of micro-batch {number + 1}" if len(window) > 1 else " of its batch"
                    return f"sample {int(bad.int().argmax())}{batch_note}"
    return None


@dataclass
class EvalResult:
    metrics: dict[str, float]
    """Each metric the task reports (`loss` always), over every validation sample."""
    samples: int


@torch.no_grad()
def evaluate(model: nn.Module, engine: Engine, task: Task, batches: Iterable, template: Template,
             precision: Precision = FULL_PRECISION, channels_last: bool = False) -> EvalResult:
    """The task's metrics over every validation sample, each counted once across ranks."""
    model.eval()
    engine.doing("evaluation")
    sums = MetricSums(engine.device, {**template, "_samples": (torch.Size(), torch.Size())})
    for batch in batches:
        batch = to_device(batch, engine.device, channels_last)
        size = batch_size(batch)
        with precision.autocast():
            output, target = task.forward(model, batch)
            metrics = batch_metrics(task, output, target, size)
        sums.add({**metrics, "_samples": (size, 1)})
    totals = sums.reduce(engine, "eval")  # dist: sums, so every sample counts exactly once
    return EvalResult(task.summarize(totals), int(totals["_samples"][0]))
