"""Image batches made ready on the device: uint8 to float, augmented for training (random resized
crop, horizontal flip, colour jitter) with Kornia's operations, and normalised. A batch travels to
the device as the data-loader workers decoded it (uint8, a quarter of float32's bytes) and is
turned into what the model sees there, per batch, on the GPU when there is one.

The random draws of a training batch come from a generator of its own on the batch's device,
seeded from (seed, epoch, step, rank): the global random state is not touched (dropout draws what
it would without augmentation), the same run draws the same crops, and a run resumed inside an
epoch draws at each step what the uninterrupted run drew there. Validation gets no augmentation:
the conversion, the centre square the model's size asks for, and the normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.data import Dataset

from hvdtrain.config.coercion import build_section, require
from hvdtrain.data.batch import to_device
from hvdtrain.data.sampler import batch_seed
from hvdtrain.errors import UserError

_SALT = 0x1A5E_D0A6  # keeps augmentation's seeds apart from the data loading's (sampler.SeededBatch)


@dataclass
class AugmentSettings:
    """`data.augment`: how training batches of images are augmented (`--set data.augment.flip=false`)."""

    enabled: bool = True
    """Random crops, flips and colour jitter for training batches; false: only the conversion and
    normalisation, as validation has."""
    size: Optional[int] = None
    """Side of the square the model sees (the random crops' size; validation cuts the centre square
    of this side); unset: the decoded images' own size."""
    scale: float = 0.08
    """Random resized crop: the smallest share of the image's area a crop keeps (1 with ratio 1: no crop)."""
    ratio: float = 4 / 3
    """Random resized crop: the crops' aspect ratios lie between 1/ratio and ratio."""
    flip: bool = True
    """Mirror a random half of the images left to right."""
    jitter: float = 0.4
    """Colour jitter: brightness, contrast and saturation each scaled by a factor drawn from
    [1 - jitter, 1 + jitter] per image (0: none)."""
    mean: str = "0.485,0.456,0.406"
    """Per-channel mean subtracted after scaling to [0, 1] (comma-separated; ImageNet's by default)."""
    std: str = "0.229,0.224,0.225"
    """Per-channel standard deviation divided by after the mean (comma-separated)."""

    def __post_init__(self) -> None:
        key = "data.augment"
        require(self.size is None or self.size >= 1, f"{key}.size", f"must be at least 1, got {self.size}")
        require(0 < self.scale <= 1, f"{key}.scale", f"must be in (0, 1], got {self.scale}")
        require(self.ratio >= 1, f"{key}.ratio", f"must be 1 or more, got {self.ratio}")
        require(0 <= self.jitter < 1, f"{key}.jitter", f"must be in [0, 1), got {self.jitter}")
        for name in ("mean", "std"):
            values = _numbers(getattr(self, name), f"{key}.{name}")
            require(name == "mean" or all(v > 0 for v in values), f"{key}.std", f"must be positive, got {self.std}")

    @classmethod
    def of(cls, raw: dict[str, Any]) -> "AugmentSettings":
        return build_section(cls, raw, "data.augment")


def _numbers(text: str, key: str) -> list[float]:
    try:
        return [float(part) for part in str(text).split(",")]
    except ValueError:
        raise UserError(f"config key '{key}' must be numbers separated by commas, got '{text}'") from None


class DeviceAugment:
    """The batch's images, uint8 (N, C, H, W) on the device, to the float batch the model sees.
    Called with (batch, epoch, step, rank) for training; `evaluation(batch)` for validation."""

    def __init__(self, settings: AugmentSettings, seed: int, image_shape: tuple[int, ...]):
        channels, height, width = image_shape
        side = settings.size
        if side is not None and side > min(height, width):
            raise UserError(f"data.augment.size {side} is larger than the images ({width}x{height}): crops are cut "
                            "from them; lower it, or decode larger images (data.image_size)")
        self.settings, self.seed = settings, seed
        self.output = (side, side) if side is not None else (height, width)
        self.mean, self.std = _numbers(settings.mean, "data.augment.mean"), _numbers(settings.std, "data.augment.std")
        if len(self.mean) != channels or len(self.std) != channels:
            raise UserError(f"data.augment.mean and std need one value per channel ({channels}), got "
                            f"{len(self.mean)} and {len(self.std)}")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One sample's shape as the model sees it."""
        return (len(self.mean), *self.output)

    def __call__(self, batch: Any, epoch: int, step: int, rank: int) -> Any:
        if not self.settings.enabled:
            return self.evaluation(batch)
        return _on_images(batch, lambda images: self._augmented(images, epoch, step, rank))

    def evaluation(self, batch: Any) -> Any:
        return _on_images(batch, lambda images: self._normalised(_centre(_to_float(images), self.output)))

    def _augmented(self, images: torch.Tensor, epoch: int, step: int, rank: int) -> torch.Tensor:
        from kornia import enhance

        generator = torch.Generator(device=images.device)
        generator.manual_seed(batch_seed(self.seed + _SALT, epoch, (step << 20) | rank))  # dist: ranks draw apart
        draws = torch.rand(len(images), 8, generator=generator, device=images.device)
        x = _to_float(images)
        settings = self.settings
        x = self._cropped(x, draws[:, :4]) if (settings.scale, settings.ratio) != (1, 1) else _centre(x, self.output)
        if settings.flip:
            x = torch.where(draws[:, 4, None, None, None] < 0.5, x.flip(-1), x)
        if settings.jitter:
            factors = 1 + settings.jitter * (2 * draws[:, 5:8] - 1)
            x = enhance.adjust_brightness_accumulative(x, factors[:, 0])
            x = enhance.adjust_contrast_with_mean_subtraction(x, factors[:, 1])
            if x.shape[1] == 3:  # saturation needs colour
                x = enhance.adjust_saturation_with_gray_subtraction(x, factors[:, 2])
        return self._normalised(x)

    def _cropped(self, x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """Random resized crops: an area share in [scale, 1] and a log-uniform aspect ratio, shrunk to
        fit the image where it would not, at a uniform place; resized to the output size."""
        from kornia.geometry.transform import crop_and_resize

        height, width = x.shape[-2:]
        log_ratio = math.log(self.settings.ratio)
        area = height * width * (self.settings.scale + (1 - self.settings.scale) * draws[:, 0])
        ratio = torch.exp(log_ratio * (2 * draws[:, 1] - 1))
        crop_w = torch.sqrt(area * ratio).clamp(1, width)
        crop_h = torch.sqrt(area / ratio).clamp(1, height)
        left, top = (width - crop_w) * draws[:, 2], (height - crop_h) * draws[:, 3]
        right, bottom = left + crop_w - 1, top + crop_h - 1
        boxes = torch.stack([torch.stack([left, top], 1), torch.stack([right, top], 1),
                             torch.stack([right, bottom], 1), torch.stack([left, bottom], 1)], 1)
        return crop_and_resize(x, boxes, self.output)

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        from kornia.enhance import normalize

        return normalize(x, x.new_tensor(self.mean), x.new_tensor(self.std))


def _to_float(images: torch.Tensor) -> torch.Tensor:
    return images.float().div_(255)


def _centre(x: torch.Tensor, output: tuple[int, int]) -> torch.Tensor:
    """The centre part of `output` size (the whole image when it is that size)."""
    height, width = x.shape[-2:]
    top, left = (height - output[0]) // 2, (width - output[1]) // 2
    return x[..., top:top + output[0], left:left + output[1]]


def _on_images(batch: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The batch with its images (a uint8 tensor: the batch, or the first element of a tuple) changed."""
    if isinstance(batch, torch.Tensor):
        return change(batch) if batch.dtype == torch.uint8 else batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return type(batch)([_on_images(batch[0], change), *batch[1:]])
    return batch


def on_device(dataset: Dataset) -> DeviceAugment | None:
    """What a data set's batches need on the device before the model sees them; None: nothing."""
    return getattr(dataset, "on_device", None)


def prepared(dataset: Dataset, batch: Any) -> Any:
    """A batch of `dataset`, already on the device, as the model sees it at validation and inference."""
    found = on_device(dataset)
    return batch if found is None else found.evaluation(batch)


def prepared_batches(batches: Iterable, dataset: Dataset, device: torch.device) -> Iterable:
    """Validation or inference batches of `dataset`, each moved to the device and made what the model
    sees there (the batches themselves where the data set needs nothing): a loop that moves them to
    the device finds them there."""
    return batches if on_device(dataset) is None else _Prepared(batches, dataset, device)


class _Prepared:
    def __init__(self, batches: Iterable, dataset: Dataset, device: torch.device):
        self.batches, self.dataset, self.device = batches, dataset, device

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            yield prepared(self.dataset, to_device(batch, self.device))
