"""A flat `.bin` file of token ids (with `val.bin` beside a `train.bin`), read memory-mapped as
windows of `data.context` tokens (hvdtrain.data.mapped); its vocabulary is its largest id plus one."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data import mapped
from hvdtrain.data.sources.base import DataSplit


class TokenFile:
    def claims(self, name: str) -> bool:
        return mapped.is_token_file(name)

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        train, val = mapped.token_parts(Path(cfg.name), cfg.token_dtype, cfg.context, cfg.val_fraction)
        return DataSplit(train, val, (cfg.context,), cfg.num_classes or mapped.vocabulary(train, val))

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        return mapped.whole(Path(cfg.name), cfg.token_dtype, cfg.context)
