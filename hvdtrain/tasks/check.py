"""The first batch, run once before training: mistakes become one line, not a failure mid-run.

The model (in eval mode, without gradients) and the task see one batch of this rank's
training data. Whatever does not fit (labels beyond the model's classes, a dict batch
without the target key, a loss that is not a scalar or not finite, metrics that are
not sums and counts) stops set-up with a message that names it. What it learns, the
metrics' names and shapes, lets every rank reduce the same tensors even when a rank
has no validation batch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hvdtrain.data.batch import batch_size, describe, tensors_in
from hvdtrain.errors import UserError, users_code
from hvdtrain.numerics.metrics import MetricSums, is_sum_and_count
from hvdtrain.numerics.precision import Precision
from hvdtrain.tasks.base import Task, batch_metrics, model_loss, predictions

Template = dict[str, tuple[torch.Size, torch.Size]]


@dataclass
class FirstBatch:
    template: Template
    """Each metric's (sum shape, count shape)."""
    reported: list[str]
    """The metric names validation reports (after the task's summarize)."""


def check_first_batch(task: Task, model: nn.Module, batch: Any, held_targets: torch.Tensor | None,
                      precision: Precision, stage: str = "training") -> FirstBatch:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision.autocast():
            output, target = guarded(task, "the model's forward", lambda: task.forward(model, batch), batch, stage,
                                     model)
            own = model_loss(output)
            if target is None and own is None and isinstance(batch, Mapping):
                raise UserError(f"the batch is a dict with keys {', '.join(map(repr, batch))} but no "
                                f"'{task.target_key}' for task {task.name}: name the target's key with "
                                f"--set task.target_key=KEY")
            if own is None or predictions(output) is not None:  # nothing to check when only a loss came back
                task.check(output, target, held_targets)
            loss = own if own is not None else guarded(task, "its loss", lambda: task.loss(output, target), batch, stage)
            _check_loss(task, loss, "the model's" if own is not None else f"task '{task.name}' loss")
            if own is None and stage == "training":  # evaluation takes no step
                _check_loss_follows_the_output(task, output, target)
            metrics = guarded(task, "its metrics", lambda: batch_metrics(task, output, target, batch_size(batch)), batch, stage)
            template = _check_metrics(task, metrics)
            sums = MetricSums(torch.device("cpu"), template)
            sums.add(metrics)
            reported = guarded(task, "its summarize", lambda: task.summarize(sums.sums), batch, stage)
    finally:
        model.train(was_training)
    return FirstBatch(template, sorted(reported))


def best_metric(name: str, mode: str, task: Task, reported: list[str]) -> tuple[str, bool]:
    """(record key such as `val_acc`, whether higher is better) for run.best_metric and run.best_mode."""
    metric = task.primary if name == "auto" else name.removeprefix("val_")
    if name == "auto" and metric not in reported:
        metric = "loss"  # a model that returns only its loss
    if metric not in reported:
        raise UserError(f"run.best_metric '{name}' is not a metric of task {task.name}: it reports "
                        f"{', '.join('val_' + r for r in reported)}")
    if mode != "auto":
        return f"val_{metric}", mode == "max"
    if metric == "loss":
        return "val_loss", False
    if task.maximize is None:
        raise UserError(f"hvdtrain cannot tell whether a higher or lower val_{metric} is better: set "
                        f"run.best_mode to max or min, or list the metrics that are better when higher in "
                        f"your task's `maximize`")
    return f"val_{metric}", metric in task.maximize


def guarded(task: Task, what: str, call: Callable[[], Any], batch: Any, stage: str = "training",
            model: nn.Module | None = None) -> Any:
    """`call()`, with a failure of the user's code turned into one line about the first batch (`model`: the
    one whose forward it calls)."""
    def described(err: BaseException) -> str:
        hint = ""
        if isinstance(batch, Mapping) and task.target_key not in batch:
            hint = (f"; it has no '{task.target_key}' key (task.target_key): if another key holds the target, "
                    "--set task.target_key=KEY")
        elif "double" in str(err).lower() and any(tensor.dtype == torch.float64 for tensor in tensors_in(batch)):
            hint = ("; the batch holds float64 (NumPy's default) where the model's weights are float32: return "
                    "float32 from your Dataset (x.astype(np.float32), or torch.as_tensor(x, dtype=torch.float32))")
        elif re.search(r"\b(Half|BFloat16)\b", str(err)) and _weights_of(model, torch.float16, torch.bfloat16) and any(
                tensor.dtype == torch.float32 for tensor in tensors_in(batch)):
            hint = ("; a model built in float16 or bfloat16 (.half()) meets float32 inputs: build it in float32 and "
                    "train with --precision fp16 or bf16 (autocast computes in half precision and keeps the weights "
                    "float32, which the optimizer's small updates need)")
        elif re.search(r"\b(Half|BFloat16)\b", str(err)) and _weights_of(model, torch.float32) and any(
                tensor.dtype in (torch.float16, torch.bfloat16) for tensor in tensors_in(batch)):
            hint = ("; the batch holds float16 or bfloat16 where the model's weights are float32: return float32 "
                    "from your Dataset (x.float() as each sample is read: the data may stay half precision), or "
                    "train with --precision bf16 or fp16, whose autocast takes such inputs")
        elif "Double" in str(err) and _weights_of(model, torch.float64) and any(
                tensor.dtype == torch.float32 for tensor in tensors_in(batch)):
            hint = ("; a model built in float64 (.double()) meets float32 inputs: build it in float32, or return "
                    "float64 from your Dataset")
        return f"; the batch was {describe(batch)}{hint}"

    return users_code(f"the first {stage} batch failed in {what} (task {task.name})", call, described)


def _check_loss_follows_the_output(task: Task, output: Any, target: Any) -> None:
    """A loss that backward cannot follow to the output (detached, or made anew from `.item()`) trains
    nothing, and fails at the first step on every rank. The forward above tracks no gradients: the loss
    is computed again from the output's tensors made to track them (not leaves: in-place operations work
    on them as in training). Only where every tensor of the output could be, and without a word where the
    loss fails here: the training step says what the loss itself does wrong."""
    def tracked(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().requires_grad_().clone()
        if type(value) in (tuple, list):
            return type(value)(map(tracked, value))
        return {key: tracked(item) for key, item in value.items()} if type(value) is dict else value

    with torch.enable_grad():  # the first batch's forward runs under no_grad
        copy = tracked(output)
        floats = [tensor for tensor in tensors_in(copy) if tensor.is_floating_point()]
        if not floats or not all(tensor.requires_grad for tensor in floats):  # an output object, integers
            return
        try:
            loss = task.loss(copy, target)
        except Exception:  # noqa: BLE001 - not this check's to say
            return
    if isinstance(loss, torch.Tensor) and not loss.requires_grad:
        raise UserError(f"task '{task.name}' loss does not follow the model's output back (it has no gradient: "
                        "detached, or made anew from .item() or numbers): compute it from the output it is given")


def _weights_of(model: nn.Module | None, *dtypes: torch.dtype) -> bool:
    return model is not None and any(p.dtype in dtypes for p in model.parameters())


def _check_loss(task: Task, loss: Any, whose: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"{whose} returned {type(loss).__name__}, not a tensor: return the loss as a tensor "
                        "(do not call .item() on it)")
    if loss.dim() != 0:
        raise UserError(f"{whose} returned a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it, "
                        "for example with .mean()")
    if not loss.is_floating_point():
        raise UserError(f"{whose} returned a {loss.dtype} tensor: a loss must be floating point")
    if not math.isfinite(float(loss)):
        raise UserError(f"{whose} is {float(loss)} on the first training batch, before any step: check the "
                        "data for NaN or Inf values and the loss for log(0) or division by zero")


def _check_metrics(task: Task, metrics: Any) -> Template:
    if not isinstance(metrics, Mapping):
        raise UserError(f"task '{task.name}' metrics returned {type(metrics).__name__}: return a dict "
                        "{name: (sum, count)}")
    template: Template = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise UserError(f"task '{task.name}' metrics: names must be non-empty strings, got {name!r}")
        if not is_sum_and_count(value):
            raise UserError(f"task '{task.name}' metrics: '{name}' is {_short(value)}, not a (sum, count) pair: "
                            f"return for example (correct.sum(), len(target)) so that ranks can be summed exactly")
        total, count = (torch.as_tensor(v) for v in value)
        try:
            torch.broadcast_shapes(total.shape, count.shape)
        except RuntimeError:
            raise UserError(f"task '{task.name}' metrics: '{name}' has a sum of shape {tuple(total.shape)} and a "
                            f"count of shape {tuple(count.shape)}, which do not broadcast") from None
        template[name] = (total.shape, count.shape)
    return template


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"
