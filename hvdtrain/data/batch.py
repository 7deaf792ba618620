"""Batches of any structure: moved to the device in one place, split into inputs and
targets, and fed to the model in the form the batch has.

A batch is what the data loader yields: a tensor, a tuple or list, or a dict, nested
in any way. The rules, in the order they apply:

    (inputs, target)          model(inputs)       inputs a tensor
    ((x1, x2), target)        model(x1, x2)       several inputs
    ({"a": .., "b": ..}, t)   model(a=.., b=..)   named inputs
    (x1, x2, target)          model(x1, x2)       the last element is the target
    {"input_ids": .., "labels": ..}
                              model(input_ids=..) the target key (task.target_key) is
                                                  passed too when forward takes it,
                                                  so a model can compute its own loss
    tensor                    model(tensor)       no target: the task or the model
                                                  must make do without one
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Every tensor in a nested batch on `device` (asynchronous copies from pinned memory
    on GPUs); 4-d floating tensors in channels-last format when asked."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.dim() == 4 and batch.is_floating_point():
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, dict):
        return {key: to_device(value, device, channels_last) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device, channels_last) for value in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        return 1
    return len(tensor)


def first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (an output object's attributes too), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (tuple, list)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, nn.Module):
        items = list(vars(value).values())
    else:
        return []
    return [tensor for item in items for tensor in tensors_in(item)]


def split_batch(batch: Any, target_key: str) -> tuple[Any, Any]:
    """(model inputs, target); the target is None when the batch holds none."""
    if isinstance(batch, dict):
        return batch, batch.get(target_key)
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return batch[0], batch[1]
        return tuple(batch[:-1]), batch[-1]
    return batch, None


def call_model(model: nn.Module, inputs: Any, target_key: str) -> Any:
    """The model called in the form its inputs have (see the module docstring)."""
    if isinstance(inputs, dict):
        if not takes_keyword(model, target_key):
            inputs = {key: value for key, value in inputs.items() if key != target_key}
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


_TAKES: dict[tuple[type, str], bool] = {}


def takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether the model's forward has a parameter `name` (Hugging Face models take `labels`)."""
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper takes anything
    key = (type(module), name)
    if key not in _TAKES:
        _TAKES[key] = _has_parameter(module.forward, name)
    return _TAKES[key]


def _has_parameter(function: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


def describe(value: Any) -> str:
    """A short description of a batch's structure, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {describe(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(item) for item in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return type(value).__name__
