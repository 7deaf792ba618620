"""What a user's data set says about itself: a sample's shape, the targets it holds in memory, its
number of classes. Read through a `Subset` (as `random_split` makes) to the data set beneath."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor-like value (a number has shape ()); None for anything else."""
    if isinstance(value, (torch.Tensor, np.ndarray, int, float)) and not isinstance(value, bool):
        return tuple(torch.as_tensor(value).shape)
    return None


def held_targets(*datasets: Dataset) -> torch.Tensor | None:
    """Every target of data sets that hold them in tensors (a TensorDataset, or `targets`)."""
    held = []
    for dataset in datasets:
        found = _targets_in_memory(_beneath(dataset))
        if found is None:
            return None
        try:
            held.append(torch.as_tensor(found).reshape(-1))
        except (TypeError, ValueError, RuntimeError):
            return None
    return torch.cat(held) if held else None


def num_classes(*datasets: Dataset) -> int | None:
    """From a `num_classes` or `classes` attribute, else from integer labels held in memory."""
    labels = []
    for dataset in datasets:
        base = _beneath(dataset)
        if hasattr(base, "num_classes"):
            return int(base.num_classes)
        if hasattr(base, "classes"):
            return len(base.classes)
        held = _targets_in_memory(base)
        if held is not None:
            held = torch.as_tensor(held)
            if held.dtype.is_floating_point or held.numel() == 0:
                return None
            labels.append(int(held.max()))
    return max(labels) + 1 if labels else None


def _beneath(dataset: Dataset) -> Dataset:
    """Through a Subset: the whole set, a superset."""
    return getattr(dataset, "dataset", dataset)


def _targets_in_memory(base: Dataset) -> Any:
    """A TensorDataset's last tensor (when it has inputs and targets), else a `targets` attribute; or None."""
    if isinstance(base, TensorDataset) and len(base.tensors) > 1:
        return base.tensors[-1]
    return getattr(base, "targets", None)
