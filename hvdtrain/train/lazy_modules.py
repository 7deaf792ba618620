"""A model with lazy layers (nn.LazyLinear, nn.LazyConv2d) has no weights until its first forward, and
nothing can broadcast, compare, count or optimize them before: they are made here, by one forward of
two training samples, before anything else touches the model (as torch's DDP asks its users to do by
hand). Every rank makes them alike in shape; rank 0's values reach the others with its broadcast."""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import Dataset

from hvdtrain.data.loading import first_batch
from hvdtrain.tasks import Task
from hvdtrain.tasks.check import guarded


def has_lazy_layers(model: nn.Module) -> bool:
    return any(is_lazy(tensor) for tensor in itertools.chain(model.parameters(), model.buffers()))


def make_lazy_weights(model: nn.Module, task: Task, train: Dataset, collate: Callable[[list[Any]], Any] | None,
                      device: torch.device) -> None:
    """One forward in eval mode without gradients: no running statistics move, no dropout draws."""
    batch = first_batch(train, 2, collate, "training", device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # a failure is the first batch's, as training's own check would say it
            guarded(task, "the model's forward", lambda: task.forward(model, batch), batch, "training", model)
    finally:
        model.train(was_training)
