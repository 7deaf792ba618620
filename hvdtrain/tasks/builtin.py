"""The built-in tasks: classification, regression, multilabel, language-model.

Each reports its metrics as sums and counts (see hvdtrain.numerics.metrics) and checks the first
batch for the mistakes that would otherwise fail deep inside PyTorch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from hvdtrain.data.batch import call_model, split_batch
from hvdtrain.errors import UserError
from hvdtrain.numerics.metrics import Totals, ratios
from hvdtrain.tasks.base import Task, predictions


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(tensor.shape))


def _outputs_of(output: Any, task: str) -> torch.Tensor:
    found = predictions(output)
    if found is None:
        raise UserError(f"task {task}: the model returned {type(output).__name__}, not a tensor of predictions "
                        "(nor a dict or object with `logits`): return the predictions from forward")
    return found


def _need_target(target: Any, task: str, key: str) -> torch.Tensor:
    if not isinstance(target, torch.Tensor):
        raise UserError(f"task {task}: the batch has no target tensor (got {type(target).__name__}): yield "
                        f"(input, target) samples, or dicts with the target under '{key}' (task.target_key)")
    return target


class Classification(Task):
    """Cross-entropy over class logits (N, C, ...) against integer labels or class probabilities."""

    name = "classification"
    primary = "acc"
    maximize = ("acc", "top5_acc")

    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = -100, target_key: str = "labels"):
        self.label_smoothing, self.ignore_index, self.target_key = label_smoothing, ignore_index, target_key

    def num_outputs(self, num_classes: int | None, target_shape: tuple[int, ...] | None) -> int | None:
        if num_classes is None and target_shape == ():  # one label a sample: how many classes is unknown, not 1
            return None
        return super().num_outputs(num_classes, target_shape)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(predictions(output), target, label_smoothing=self.label_smoothing,
                               ignore_index=self.ignore_index)

    def metrics(self, output: Any, target: torch.Tensor) -> dict[str, tuple[Any, Any]]:
        logits = predictions(output)
        if logits is None:
            return {}
        logits = logits.float()
        losses = F.cross_entropy(logits, target, reduction="none", label_smoothing=self.label_smoothing,
                                 ignore_index=self.ignore_index)
        labels = target.argmax(dim=1) if target.is_floating_point() else target
        scored = labels != self.ignore_index
        count = scored.sum()
        found = {"loss": (losses.sum(), count),
                 "acc": (((logits.argmax(dim=1) == labels) & scored).sum(), count)}
        if logits.shape[1] >= 5:
            top5 = logits.topk(5, dim=1).indices
            found["top5_acc"] = (((top5 == labels.unsqueeze(1)).any(dim=1) & scored).sum(), count)
        return found

    def predict(self, output: Any) -> torch.Tensor | None:
        logits = predictions(output)
        return None if logits is None else logits.argmax(dim=1)  # the class (per position for (N, C, ...))

    def check_data(self, target_dtype: torch.dtype | None, target_shape: tuple[int, ...] | None) -> None:
        if target_dtype is not None and target_dtype.is_floating_point and target_shape in ((), (1,)):
            raise UserError(f"task classification: the targets (each sample's last item, or its '{self.target_key}') "
                            f"are {target_dtype} numbers, one per sample; classification needs integer class labels: "
                            "for float targets use --task regression")

    def check(self, output: Any, target: Any, held_targets: torch.Tensor | None) -> None:
        logits = _outputs_of(output, self.name)
        target = _need_target(target, self.name, self.target_key)
        if not logits.is_floating_point() or logits.dim() < 2:
            raise UserError(f"task classification: the model's output has shape {_shape(logits)} "
                            f"({logits.dtype}); it needs float logits shaped (batch, classes): for one value per "
                            "sample use --task regression, for 0/1 per class --task multilabel")
        classes = logits.shape[1]
        if not target.is_floating_point() and target.dtype != torch.bool:
            # Before the count of classes: labels 0, -1, -2, ... make a data set of "one class".
            self._check_no_negative_label(target, held_targets)
        if classes < 2:  # its loss is 0 and its accuracy 1 whatever the model does
            raise UserError(f"task classification: the model gives {classes} output per sample, one class: nothing "
                            "to tell apart. For one number per sample use --task regression; for a yes/no label "
                            "--task multilabel, or two classes labelled 0 and 1")
        if target.is_floating_point():
            if target.shape != logits.shape:
                raise UserError(f"task classification: the targets are {target.dtype} shaped {_shape(target)}; "
                                "classification needs integer class labels (or class probabilities shaped like the "
                                f"output, {_shape(logits)}): for float targets use --task regression")
            sums = target.detach().float().sum(1)
            worst = int((sums - 1).abs().reshape(-1).argmax())
            if abs(float(sums.reshape(-1)[worst]) - 1) > 1e-3:
                raise UserError(f"task classification: float targets are read as class probabilities, and sample "
                                f"{worst} of the first batch has probabilities summing to "
                                f"{float(sums.reshape(-1)[worst]):.4g}, not 1: for numbers use --task regression, for "
                                "several 0/1 labels per sample --task multilabel")
            return
        if target.dtype == torch.bool and target.shape == logits.shape[:1] + logits.shape[2:]:
            raise UserError("task classification: the labels are true/false (torch.bool): give them as integer "
                            "class labels, 0 and 1 (int(label))")
        if target.dtype == torch.bool or target.shape != logits.shape[:1] + logits.shape[2:]:
            raise UserError(f"task classification: labels of shape {_shape(target)} ({target.dtype}) do not fit "
                            f"the model's output {_shape(logits)}: one integer label per sample is needed "
                            f"(shape {_shape(logits[:, 0])}); for several 0/1 labels per sample use --task multilabel")
        labels = torch.cat([target.reshape(-1).cpu()] + ([held_targets.reshape(-1)] if held_targets is not None else []))
        labels = labels[labels != self.ignore_index]
        if labels.numel() == 0:
            return
        high = int(labels.max())
        if high >= classes:
            raise UserError(f"task classification: the labels reach {high} but the model's output has {classes} "
                            f"classes (shape {_shape(logits)}): the model needs at least {high + 1} outputs "
                            "(a model factory receives the count as num_classes; set it with data.num_classes)")

    def _check_no_negative_label(self, target: torch.Tensor, held_targets: torch.Tensor | None) -> None:
        """The first negative label (other than task.ignore_index) and where: among the labels the data set
        holds (its own index there), else in the first batch."""
        for labels, whose in ((held_targets, "the data set's labels"), (target.detach().cpu(), "the first batch")):
            if labels is None:
                continue
            negative = ((labels < 0) & (labels != self.ignore_index)).nonzero()
            if len(negative):
                index = tuple(int(i) for i in negative[0])
                place = f"index {index[0]}" if len(index) == 1 else f"position {index}"
                raise UserError(f"task classification: the labels include {int(labels[index])} (the first negative "
                                f"one, at {place} of {whose}); class labels run from 0 to classes - 1 "
                                f"(task.ignore_index {self.ignore_index} marks a label to skip)")


class Regression(Task):
    """Float targets of any shape; MSE, L1 or Huber loss; metrics MSE, MAE and R²."""

    name = "regression"
    primary = "r2"
    maximize = ("r2",)

    def __init__(self, loss: str = "mse", huber_delta: float = 1.0, target_key: str = "labels"):
        self.kind, self.huber_delta, self.target_key = loss, huber_delta, target_key

    def _pair(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        predicted = predictions(output)
        if predicted.shape != target.shape and predicted.numel() == target.numel():
            predicted = predicted.reshape(target.shape)  # (N, 1) against (N,), say
        return predicted, target.to(predicted.dtype if predicted.is_floating_point() else torch.float32)

    def _elementwise(self, predicted: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.kind == "l1":
            return F.l1_loss(predicted, target, reduction=reduction)
        if self.kind == "huber":
            return F.huber_loss(predicted, target, reduction=reduction, delta=self.huber_delta)
        return F.mse_loss(predicted, target, reduction=reduction)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self._elementwise(*self._pair(output, target), "mean")

    def metrics(self, output: Any, target: torch.Tensor) -> dict[str, tuple[Any, Any]]:
        if predictions(output) is None:
            return {}
        predicted, target = self._pair(output, target)
        predicted, target = predicted.double(), target.double()
        error = predicted - target
        per_output = target.reshape(len(target), -1)  # R² per output, then averaged (scikit-learn's default)
        samples = len(target)
        return {
            "loss": (self._elementwise(predicted, target, "none").sum(), target.numel()),
            "mse": (error.square().sum(), target.numel()),
            "mae": (error.abs().sum(), target.numel()),
            "_sse": (error.reshape(samples, -1).square().sum(dim=0), samples),
            "_sum": (per_output.sum(dim=0), samples),
            "_sum_sq": (per_output.square().sum(dim=0), samples),
        }

    def summarize(self, totals: Totals) -> dict[str, float]:
        values = ratios(totals)
        if "_sse" in totals:
            sse, samples = totals["_sse"]
            total, _ = totals["_sum"]
            total_sq, _ = totals["_sum_sq"]
            sst = total_sq - total.square() / samples.clamp_min(1)
            # A constant target (sst 0) scores 1 when predicted exactly, else 0 (as scikit-learn does).
            r2 = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-300), (sse == 0).double())
            values["r2"] = float(r2.mean())
        return values

    def check(self, output: Any, target: Any, held_targets: torch.Tensor | None) -> None:
        predicted = _outputs_of(output, self.name)
        target = _need_target(target, self.name, self.target_key)
        if not predicted.is_floating_point():
            raise UserError(f"task regression: the model's output is {predicted.dtype}; it must be float")
        if target.dtype == torch.bool or target.is_complex():
            raise UserError(f"task regression: the targets are {target.dtype}; regression needs numbers "
                            "(for 0/1 labels per class use --task multilabel)")
        if predicted.numel() != target.numel():
            samples = max(1, len(target))
            raise UserError(f"task regression: the model gives {predicted.numel() // samples} value(s) per sample "
                            f"(output {_shape(predicted)}) but the targets hold {target.numel() // samples} "
                            f"(shape {_shape(target)}): make the model's last layer give one output per target "
                            "value (a model factory receives the count as num_outputs)")

    def num_outputs(self, num_classes: int | None, target_shape: tuple[int, ...] | None) -> int | None:
        return math.prod(target_shape) if target_shape is not None else None


class Multilabel(Task):
    """0/1 targets per class, binary cross-entropy on logits; exact-match accuracy and micro-F1."""

    name = "multilabel"
    primary = "f1"
    maximize = ("exact_match", "f1")

    def __init__(self, target_key: str = "labels"):
        self.target_key = target_key

    def predict(self, output: Any) -> torch.Tensor | None:
        logits = predictions(output)
        return None if logits is None else (logits > 0).to(torch.int64)  # probability above 1/2

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = predictions(output)
        return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype))

    def metrics(self, output: Any, target: torch.Tensor) -> dict[str, tuple[Any, Any]]:
        logits = predictions(output)
        if logits is None:
            return {}
        logits = logits.float()
        losses = F.binary_cross_entropy_with_logits(logits, target.float(), reduction="none")
        predicted, actual = logits > 0, target > 0.5  # probability above one half
        true_pos = (predicted & actual).sum()
        false_pos = (predicted & ~actual).sum()
        false_neg = (~predicted & actual).sum()
        rows = len(target)
        return {
            "loss": (losses.sum(), target.numel()),
            "exact_match": ((predicted == actual).reshape(rows, -1).all(dim=1).sum(), rows),
            "f1": (2 * true_pos, 2 * true_pos + false_pos + false_neg),  # micro-F1 is a ratio of sums
        }

    def check_data(self, target_dtype: torch.dtype | None, target_shape: tuple[int, ...] | None) -> None:
        if target_shape == ():
            raise UserError("task multilabel: the targets are one value per sample; multilabel needs a 0/1 target "
                            "per class (shape (classes,) per sample): for one class label per sample use "
                            "--task classification")

    def check(self, output: Any, target: Any, held_targets: torch.Tensor | None) -> None:
        logits = _outputs_of(output, self.name)
        target = _need_target(target, self.name, self.target_key)
        if target.shape != logits.shape:
            raise UserError(f"task multilabel: the targets have shape {_shape(target)} but the model's output "
                            f"{_shape(logits)}: give one 0/1 target per output (a model factory receives the "
                            "count as num_outputs)")
        values = torch.cat([target.reshape(-1).cpu().float()]
                           + ([held_targets.reshape(-1).float()] if held_targets is not None else []))
        if not bool(((values == 0) | (values == 1)).all()):
            odd = values[(values != 0) & (values != 1)][0].item()
            raise UserError(f"task multilabel: targets must be 0 or 1, found {odd}: for class indices use "
                            "--task classification, for numbers --task regression")

    def num_outputs(self, num_classes: int | None, target_shape: tuple[int, ...] | None) -> int | None:
        return target_shape[-1] if target_shape else None


class LanguageModel(Task):
    """Next-token cross-entropy over token ids; metrics token accuracy and perplexity.

    Position t's logits predict token t + 1 (`shift`, Hugging Face's convention: the
    targets are the input ids, or a copy with task.ignore_index where nothing is scored).
    """

    name = "language-model"
    primary = "perplexity"
    maximize = ("token_acc",)

    def __init__(self, ignore_index: int = -100, shift: bool = True, target_key: str = "labels"):
        self.ignore_index, self.shift, self.target_key = ignore_index, shift, target_key

    def forward(self, model: Any, batch: Any) -> tuple[Any, Any]:
        inputs, target = split_batch(batch, self.target_key)
        if target is None:  # a batch of token ids alone: they are their own targets
            target = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
        return call_model(model, inputs, self.target_key), target

    def _aligned(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = predictions(output)
        if self.shift:
            logits, target = logits[:, :-1], target[:, 1:]
        return logits.reshape(-1, logits.shape[-1]), target.reshape(-1)

    def predict(self, output: Any) -> torch.Tensor | None:
        logits = predictions(output)
        return None if logits is None else logits.argmax(dim=-1)  # position t: the token at t + 1 (with shift)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits, target = self._aligned(output, target)
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index)

    def metrics(self, output: Any, target: torch.Tensor) -> dict[str, tuple[Any, Any]]:
        if predictions(output) is None:
            return {}
        logits, target = self._aligned(output, target)
        logits = logits.float()
        scored = target != self.ignore_index
        count = scored.sum()
        losses = F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="none")
        return {"loss": (losses.sum(), count),
                "token_acc": (((logits.argmax(dim=-1) == target) & scored).sum(), count)}

    def summarize(self, totals: Totals) -> dict[str, float]:
        values = ratios(totals)
        if "loss" in values and "token_acc" in values:
            values["perplexity"] = math.exp(min(values["loss"], 700.0))  # exp of the mean token loss
        return values

    def check(self, output: Any, target: Any, held_targets: torch.Tensor | None) -> None:
        logits = _outputs_of(output, self.name)
        target = _need_target(target, self.name, self.target_key)
        if logits.dim() != 3 or not logits.is_floating_point():
            raise UserError(f"task language-model: the model's output has shape {_shape(logits)}; it needs float "
                            "logits shaped (batch, positions, vocabulary)")
        if target.is_floating_point() or target.shape != logits.shape[:2]:
            raise UserError(f"task language-model: the targets are {target.dtype} shaped {_shape(target)}; they "
                            f"must be integer token ids shaped like the output's first two dimensions "
                            f"{_shape(logits[..., 0])}")
        if self.shift and target.shape[1] < 2:
            raise UserError("task language-model: sequences of one token have no next token to predict: "
                            "give sequences of at least 2 tokens")
        tokens = target[target != self.ignore_index]
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
            raise UserError(f"task language-model: token ids run from {int(tokens.min())} to {int(tokens.max())} "
                            f"but the model's vocabulary has {logits.shape[-1]} entries (pad with "
                            f"task.ignore_index {self.ignore_index} where nothing is to be scored)")
