"""A directory of memory-mapped `.npy` arrays, `x.npy` and `y.npy` (or `train/` and `val/`
directories of them): hvdtrain.data.mapped reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data import mapped
from hvdtrain.data.sources.base import HELD_TARGETS_LIMIT, DataSplit


class ArrayDirectory:
    """What the arrays say of themselves comes from the files' headers and targets, not their inputs."""

    def claims(self, name: str) -> bool:
        return mapped.is_array_directory(name)

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        train, val = mapped.array_parts(Path(cfg.name), cfg.val_fraction)
        x, y = train.arrays()
        targets = mapped.target_files(train, val)
        largest = mapped.largest_label(targets)
        target_dtype = np.int64 if largest is not None else np.float32
        held = None
        if sum(t.size for t in targets) * 8 <= HELD_TARGETS_LIMIT:  # for the label checks; large ones are not copied
            held = torch.cat([torch.from_numpy(np.array(t, dtype=target_dtype)) for t in targets])
        return DataSplit(train, val, tuple(x.shape[1:]), None if largest is None else largest + 1, tuple(y.shape[1:]),
                         held, torch.int64 if largest is not None else torch.float32)

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        return mapped.whole(Path(cfg.name), cfg.token_dtype, cfg.context)
