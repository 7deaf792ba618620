"""The `Source` interface: one kind of data set, which says which names it takes and builds its
parts; and `DataSplit`, what `fit` gets from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.data import Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data import introspect
from hvdtrain.data.batch import split_batch

HELD_TARGETS_LIMIT = 128 << 20
"""Bytes of targets a source copies into memory for the label checks; larger ones are not held."""


@dataclass
class DataSplit:
    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...] | None
    """One sample's input shape; None when the input is not one tensor (several, or a dict)."""
    num_classes: int | None
    """None when it cannot be read off the data (a factory's Dataset without `classes`)."""
    target_shape: tuple[int, ...] | None = None
    """One sample's target shape (() for a class label); None when there is none."""
    held_targets: torch.Tensor | None = None
    """Every target, when the data set holds them in memory (to check labels once)."""
    target_dtype: torch.dtype | None = None
    """One sample's target dtype; None when there is no target tensor."""
    text_target: str | None = None
    """The first sample's target where it is text (a class's name), which no built-in task takes (unless a
    collate of the user's makes it a number)."""
    image_input: bool = False
    """The first sample's input is a PIL image, not made a tensor (no transform): no batch stacks them."""


class Source(Protocol):
    """One kind of data set (hvdtrain.data.sources.SOURCES lists them in the order they are asked).

    Every rank builds the same parts from the same config and seed: nothing here may depend on the
    rank or on when it runs."""

    def claims(self, name: str) -> bool:
        """Whether `data.name` names a data set of this kind (asked before any file is read)."""

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        """The training and validation parts, and what they say of their samples (for `fit`)."""

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        """Every sample in the source's own order (evaluate and predict with `--part all`);
        without `need_targets`, samples may come without targets."""


def described(train: Dataset, val: Dataset, target_key: str, classes: int | None,
              held: torch.Tensor | None) -> DataSplit:
    """The parts with what their first sample says of every sample (reading no further)."""
    inputs, target = split_batch(train[0], target_key)
    dtype = torch.as_tensor(target).dtype if introspect.shape_of(target) is not None else None
    text = target.decode(errors="replace") if isinstance(target, bytes) else target if isinstance(target, str) else None
    image = type(inputs).__module__.startswith("PIL.")
    return DataSplit(train, val, introspect.shape_of(inputs), classes, introspect.shape_of(target), held, dtype, text,
                     image)
