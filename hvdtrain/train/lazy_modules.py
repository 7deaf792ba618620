"""A model with lazy layers (nn.LazyLinear, nn.LazyConv2d) has no weights until its first forward, and
nothing can broadcast, compare, count or optimize them before: they are made here, by one forward of
two training samples, before anything else touches the model (as torch's DDP asks its users to do by
hand). Every rank makes them alike in shape; rank 0's values reach the others with its broadcast."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import Dataset

from hvdtrain.data.loading import first_batch
from hvdtrain.errors import UserError
from hvdtrain.tasks import Task
from hvdtrain.tasks.check import guarded


def has_lazy_layers(model: nn.Module) -> bool:
    return bool(_lazy_names(model))


def make_lazy_weights(model: nn.Module, task: Task, train: Dataset, collate: Callable[[list[Any]], Any] | None,
                      device: torch.device, autocast: contextlib.AbstractContextManager | None = None) -> None:
    """One forward in eval mode without gradients (under training's `autocast`), where the model has lazy
    layers: no running statistics move, no dropout draws."""
    if not has_lazy_layers(model):
        return
    batch = first_batch(train, 2, collate, "training", device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast or contextlib.nullcontext():  # a failure is the first batch's
            guarded(task, "the model's forward", lambda: task.forward(model, batch), batch, "training", model)
    finally:
        model.train(was_training)
    left = _lazy_names(model)
    if left:
        raise UserError(f"the model's lazy layers {', '.join(left[:3])}{' ...' if len(left) > 3 else ''} got no "
                        "weights from a forward in eval mode (one used in training only): make them in your model "
                        "factory with one training-mode forward of a batch, or give them their sizes (nn.Linear)")


def _lazy_names(model: nn.Module) -> list[str]:
    return [name for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()) if is_lazy(tensor)]
