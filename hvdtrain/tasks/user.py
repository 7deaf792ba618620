"""A user's own task, named `package.module:attribute`, in whichever form it comes:

    a loss function     loss(output, target) -> scalar tensor   (torch.nn.functional:l1_loss works)
    a loss module class torch.nn:SmoothL1Loss                    (made with no arguments)
    a task object       with `loss` and optionally `metrics`, `forward`, `summarize`,
                        `predict`, `maximize`, `primary` and `target_key`   (see hvdtrain.tasks.base)
    a task class        the same, made with no arguments
    a factory           a function of no arguments returning any of the above

task.args, when given, are bound by name to the function, class or factory ("no arguments": none
but those).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hvdtrain.errors import UserError
from hvdtrain.factory import resolve_factory, with_args
from hvdtrain.numerics.metrics import Totals, ratios
from hvdtrain.tasks.base import Task, predictions

_PARTS = ("loss", "metrics", "forward", "summarize", "predict")


def user_task(path: str, target_key: str, args: Mapping[str, Any] | None = None) -> Task:
    found = resolve_factory(path, "task", require_callable=False)
    if args:  # task.args: bound by name to the loss function, the class or the factory
        if not (inspect.isclass(found) or inspect.isroutine(found)):
            raise UserError(f"task '{path}' is a {type(found).__name__} object, made already: task.args has nothing "
                            "to give it; name its class or a function instead")
        found = with_args(path, "task", found, args, "task.args")
    return _adapt(path, found, target_key, made=False)


def _adapt(path: str, found: Any, target_key: str, made: bool) -> Task:
    if isinstance(found, nn.Module):  # a loss module such as nn.CrossEntropyLoss()
        return LossFunctionTask(path, found, target_key)
    if any(hasattr(found, part) for part in _PARTS) and not inspect.isclass(found):
        return UserTask(path, found, target_key)
    if inspect.isclass(found):
        return _adapt(path, _make(path, found), target_key, made=True)
    if callable(found):
        required = _required_positional(found)
        if required >= 2:
            return LossFunctionTask(path, found, target_key)
        if required == 0 and not made:
            return _adapt(path, _make(path, found), target_key, made=True)
    raise UserError(f"task '{path}' is {_what(found)}: give a loss function loss(output, target) -> scalar tensor, "
                    "or an object (or class) with a loss(output, target) method and optionally metrics(output, "
                    "target) -> {name: (sum, count)}")


def _make(path: str, factory: Any) -> Any:
    try:
        return factory()
    except Exception as err:
        raise UserError(f"task '{path}': making it raised {type(err).__name__}: {err} (it is called with no "
                        "arguments)") from err


def _required_positional(function: Any) -> int:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 2  # a builtin: assume loss(output, target)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(1 for p in parameters if p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _what(found: Any) -> str:
    if callable(found):
        return f"a function of {_required_positional(found)} required argument(s)"
    return f"an object of type {type(found).__name__}"


class LossFunctionTask(Task):
    """A bare loss function: trained on it, and validation reports its mean as `loss`."""

    maximize = ()

    def __init__(self, path: str, function: Any, target_key: str):
        self.name, self.function, self.target_key = path, function, target_key

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        predicted = predictions(output)
        return self.function(predicted if predicted is not None else output, target)


class UserTask(Task):
    """A user's task object; the parts it lacks are the base task's."""

    def __init__(self, path: str, impl: Any, target_key: str):
        self.name, self.impl = path, impl
        self.target_key = getattr(impl, "target_key", target_key)
        self.primary = getattr(impl, "primary", "loss")
        maximize = getattr(impl, "maximize", None)
        self.maximize = (maximize,) if isinstance(maximize, str) else tuple(maximize) if maximize is not None else None

    def forward(self, model: nn.Module, batch: Any) -> tuple[Any, Any]:
        if not hasattr(self.impl, "forward"):
            return super().forward(model, batch)
        found = self.impl.forward(model, batch)
        if not (isinstance(found, tuple) and len(found) == 2):
            raise UserError(f"task '{self.name}': forward(model, batch) returned {type(found).__name__}; it must "
                            "return (output, target)")
        return found

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        if not hasattr(self.impl, "loss"):
            raise UserError(f"task '{self.name}' has no loss method and the model returned no loss: add "
                            "loss(self, output, target) -> scalar tensor, or have the model's forward return "
                            "its loss")
        return self.impl.loss(output, target)

    def metrics(self, output: Any, target: Any) -> Mapping[str, tuple[Any, Any]]:
        return self.impl.metrics(output, target) if hasattr(self.impl, "metrics") else {}

    def predict(self, output: Any) -> torch.Tensor | None:
        return self.impl.predict(output) if hasattr(self.impl, "predict") else super().predict(output)

    def summarize(self, totals: Totals) -> dict[str, float]:
        values = ratios(totals)
        if hasattr(self.impl, "summarize"):
            values.update({str(k): float(v) for k, v in self.impl.summarize(totals).items()})
        return values
