"""The task: what a batch means. The loop calls it and knows no loss or metric itself.

A task answers three questions about a batch:

    forward(model, batch) -> (output, target)   how the batch is fed to the model
    loss(output, target)  -> scalar tensor      what training minimises
    metrics(output, target) -> {name: (sum, count)}
                                                what validation reports: each metric is
                                                its total sum over its total count, over
                                                every batch and rank (exact when sharded)

and, optionally, `summarize(totals)` turns the totals into values that are not plain
ratios (R², perplexity), and `predict(output)` turns an output into what `hvdtrain predict`
writes per sample (a class, 0/1 per label; by default the raw output). A model may compute its own loss: a forward that returns a
scalar tensor, a dict with "loss" or an object with `.loss` (Hugging Face's outputs) is
trained on that loss, and the task's metrics still see the rest of the output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hvdtrain.data.batch import call_model, split_batch
from hvdtrain.numerics.metrics import Totals, ratios


class Task:
    """Subclass and override `loss` (and `metrics`, `forward`, `summarize` as needed)."""

    name = "task"
    target_key = "labels"
    """Dict batches: the key that holds the target."""
    primary = "loss"
    """The metric `run.best_metric: auto` keeps the best checkpoint by."""
    maximize: tuple[str, ...] | None = ()
    """Metrics that are better when higher; every other one is better when lower.
    None: not said (a user's task without `maximize`)."""

    def forward(self, model: nn.Module, batch: Any) -> tuple[Any, Any]:
        inputs, target = split_batch(batch, self.target_key)
        return call_model(model, inputs, self.target_key), target

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        raise NotImplementedError

    def metrics(self, output: Any, target: Any) -> Mapping[str, tuple[Any, Any]]:
        return {}

    def summarize(self, totals: Totals) -> dict[str, float]:
        return ratios(totals)

    def predict(self, output: Any) -> torch.Tensor | None:
        """`hvdtrain predict`'s answer per sample, from the model's output (here its raw output);
        batch-first. None when the output holds no predictions (a model that returns only a loss)."""
        return predictions(output)

    def check(self, output: Any, target: Any, held_targets: torch.Tensor | None) -> None:
        """Raises UserError when the first batch shows the data and model cannot work with this task."""

    def check_data(self, target_dtype: torch.dtype | None, target_shape: tuple[int, ...] | None) -> None:
        """Raises UserError when the data set's targets cannot serve this task (before a model is built)."""

    def num_outputs(self, num_classes: int | None, target_shape: tuple[int, ...] | None) -> int | None:
        """How many outputs per sample a built-in model needs for this task (None: unknown):
        one per class when the data has classes, else one per target value."""
        if num_classes is not None or target_shape is None:
            return num_classes
        return math.prod(target_shape)


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself: a scalar output, output["loss"] or output.loss."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        found = output.get("loss")
    else:
        found = getattr(output, "loss", None)
    return found if isinstance(found, torch.Tensor) else None


def predictions(output: Any) -> torch.Tensor | None:
    """The model's predictions: the output itself, or its `logits` (Hugging Face's outputs)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() > 0 else None
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return found if isinstance(found, torch.Tensor) else None


def training_loss(task: Task, model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss one batch trains on: the model's own when it gives one, else the task's."""
    output, target = task.forward(model, batch)
    own = model_loss(output)
    return own if own is not None else task.loss(output, target)


def batch_metrics(task: Task, output: Any, target: Any, samples: int) -> dict[str, tuple[Any, Any]]:
    """The task's metrics of one batch, with `loss` (sample-weighted) when it gives none."""
    metrics = dict(task.metrics(output, target))
    if "loss" not in metrics:
        own = model_loss(output)
        loss = own if own is not None else task.loss(output, target)
        metrics["loss"] = (loss.detach().float() * samples, samples)
    return metrics
