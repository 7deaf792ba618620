"""A directory of class folders of images (torchvision's `ImageFolder` layout), read by
hvdtrain.data.images and decoded in the data-loader workers; each batch is augmented on the device
(hvdtrain.data.augment, `data.augment`)."""

from __future__ import annotations

from pathlib import Path

import torch

from hvdtrain.config import DataConfig
from hvdtrain.data import images
from hvdtrain.data.augment import AugmentSettings, DeviceAugment
from hvdtrain.data.sources.base import DataSplit
from hvdtrain.errors import UserError


class ImageFolder:
    """Every part shares one `DeviceAugment`: training batches get it whole, the others its evaluation."""

    def claims(self, name: str) -> bool:
        return images.is_image_folder(name)

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        _require_packages(cfg.name)
        settings = AugmentSettings.of(cfg.augment)
        train, val = images.image_parts(Path(cfg.name), cfg.val_fraction, cfg.image_size)
        train.on_device = val.on_device = augment = DeviceAugment(settings, seed, train.image_shape)
        return DataSplit(train, val, augment.input_shape, len(train.classes), (),
                         torch.from_numpy(train.tree.labels), torch.int64)

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> images.ImageFiles:
        _require_packages(cfg.name)
        every = images.whole(Path(cfg.name), cfg.image_size)
        every.on_device = DeviceAugment(AugmentSettings.of(cfg.augment), seed, every.image_shape)
        return every


def _require_packages(name: str) -> None:
    try:
        import kornia  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as err:
        raise UserError(f"data '{name}' is a folder of images, which needs Pillow and Kornia ({err.name} is "
                        "missing): pip install 'hvdtrain[images]'") from err
