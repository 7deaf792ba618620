"""WebDataset-style tar shards (a directory, a brace pattern or a glob of `.tar` files), read
front to back as a stream: hvdtrain.data.shards reads them, hvdtrain.data.streams orders them."""

from __future__ import annotations

from torch.utils.data import Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data import shards
from hvdtrain.data.sources.base import DataSplit, described
from hvdtrain.data.streams import StreamDataset


class TarShards:
    def claims(self, name: str) -> bool:
        return shards.is_shards(name)

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        train, val = shards.shard_parts(cfg.name, cfg.input_columns, cfg.target_column, cfg.val_fraction)
        held = shards.held_labels(train, val)
        return described(StreamDataset(train, seed), StreamDataset(val, seed), target_key,
                         None if held is None else int(held.max()) + 1, held)

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        return StreamDataset(shards.whole(cfg.name, cfg.input_columns, cfg.target_column), seed)
