"""Sources whose whole data set is two tensors in memory, inputs and targets: split into training
and validation by a permutation drawn from the seed. A kind of this sort says only which names it
claims and how it makes its tensors (`InMemory.tensors`)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

from hvdtrain.config import DataConfig
from hvdtrain.data.sources.base import DataSplit
from hvdtrain.errors import UserError


class InMemory:
    """The `Source` of two tensors; a subclass gives `claims` and `tensors`."""

    def claims(self, name: str) -> bool:
        raise NotImplementedError

    def tensors(self, cfg: DataConfig, seed: int, need_targets: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inputs and targets (None only without `need_targets`, when the data has none), in their own order."""
        raise NotImplementedError

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        x, y = self.tensors(cfg, seed, True)
        return split_tensors(x, y, cfg.val_fraction, seed)

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        x, y = self.tensors(cfg, seed, need_targets)
        return TensorDataset(x) if y is None else TensorDataset(x, y)


def split_tensors(x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int) -> DataSplit:
    if len(x) < 2:
        raise UserError(f"the data set has {len(x)} sample(s): at least 2 are needed for train and validation")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = min(len(x) - 1, max(1, round(len(x) * val_fraction)))
    val_idx, train_idx = order[:n_val], order[n_val:]
    labels = not (y.is_floating_point() or y.dtype == torch.bool)
    return DataSplit(
        TensorDataset(x[train_idx], y[train_idx]),
        TensorDataset(x[val_idx], y[val_idx]),
        tuple(x.shape[1:]),
        int(y.max()) + 1 if labels else None,
        tuple(y.shape[1:]),
        y,
        y.dtype,
    )
