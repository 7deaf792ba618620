"""Hugging Face `datasets` (a `save_to_disk` directory, an `.arrow` or `.parquet` file), read by
columns through hvdtrain.data.huggingface."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data import huggingface, introspect
from hvdtrain.data.batch import split_batch
from hvdtrain.data.sources.base import HELD_TARGETS_LIMIT, DataSplit


class HuggingFace:
    def claims(self, name: str) -> bool:
        return huggingface.is_hugging_face(name)

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        train, val, classes = huggingface.parts(cfg.name, cfg.input_columns, cfg.target_column, cfg.val_fraction)
        inputs, target = split_batch(train[0], target_key)
        held = None
        scalar = target is not None and introspect.shape_of(target) == ()
        tables = list({id(part.table): part.table for part in (train, val)}.values())
        if scalar and sum(len(table) for table in tables) * 8 <= HELD_TARGETS_LIMIT:  # one number per row, for the checks
            columns = [np.asarray(table[train.target]) for table in tables]
            kind = np.int64 if all(np.issubdtype(c.dtype, np.integer) for c in columns) else np.float32
            held = torch.cat([torch.from_numpy(c.astype(kind)) for c in columns])
        dtype = torch.as_tensor(target).dtype if target is not None else None
        if classes is None and held is not None and not held.is_floating_point():
            classes = int(held.max()) + 1
        return DataSplit(train, val, introspect.shape_of(inputs), classes, introspect.shape_of(target), held, dtype)

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        return huggingface.whole(cfg.name, cfg.input_columns, cfg.target_column)
