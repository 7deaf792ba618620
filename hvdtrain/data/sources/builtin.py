"""The built-in data sets, claimed by their exact names: `digits` (scikit-learn's 8x8 images,
standardized) and `random` (a seeded synthetic classification problem)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from hvdtrain.config import DataConfig
from hvdtrain.data.sources.base import DataSplit
from hvdtrain.data.sources.tensors import InMemory, split_tensors
from hvdtrain.errors import UserError

BUILT_IN = ("digits", "random")


class Digits(InMemory):
    """Zero mean, unit variance per pixel, with statistics from the training part only."""

    def claims(self, name: str) -> bool:
        return name == "digits"

    def tensors(self, cfg: DataConfig, seed: int, need_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # The file behind sklearn.datasets.load_digits, read without importing scikit-learn: that import
        # (SciPy with it) costs each rank about 1.5 s of CPU at every start.
        spec = importlib.util.find_spec("sklearn")
        if spec is None:
            raise UserError("the digits data set ships inside scikit-learn: pip install scikit-learn")
        files = [Path(top) / "datasets" / "data" / "digits.csv.gz" for top in spec.submodule_search_locations or []]
        found = next((path for path in files if path.is_file()), None)
        if found is None:  # laid out otherwise (a zipped install): scikit-learn's own reader
            from sklearn.datasets import load_digits

            digits = load_digits()
            table = np.hstack([digits.data, digits.target[:, None]]).astype(np.float32)
        else:  # 1797 rows: 64 pixels in 0..16, then the digit
            table = np.loadtxt(found, delimiter=",", dtype=np.float32)
        x = torch.from_numpy(table[:, :-1].reshape(-1, 1, 8, 8) / 16.0)  # (N, 1, 8, 8)
        return x, torch.from_numpy(table[:, -1].astype(np.int64))

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        split = super().split(cfg, seed, target_key)
        train_x, train_y = split.train.tensors  # type: ignore[attr-defined]
        val_x, val_y = split.val.tensors  # type: ignore[attr-defined]
        mean, std = _input_statistics(train_x)
        split.train = TensorDataset((train_x - mean) / std, train_y)
        split.val = TensorDataset((val_x - mean) / std, val_y)
        return split

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        x, y = self.tensors(cfg, seed, need_targets)
        # standardized with the training part's statistics, as fit saw it
        mean, std = _input_statistics(split_tensors(x, y, cfg.val_fraction, seed).train.tensors[0])  # type: ignore[attr-defined]
        return TensorDataset((x - mean) / std, y)


def _input_statistics(train_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return train_x.mean(dim=0), train_x.std(dim=0).clamp_min(0.1)  # border pixels are almost always 0


class RandomTeacher(InMemory):
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, unlike random labels."""

    def claims(self, name: str) -> bool:
        return name == "random"

    def tensors(self, cfg: DataConfig, seed: int, need_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(cfg.samples, cfg.features, generator=generator)
        teacher = torch.randn(cfg.features, cfg.classes, generator=generator)
        return x, (x @ teacher).argmax(dim=1)
