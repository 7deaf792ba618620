"""The GPU throughput job (benchmarks/gpu_throughput.py): a ResNet-50-shaped convolutional network
and synthetic images, as factories that `hvdtrain fit` and the plain loop both build.

    hvdtrain fit --model benchmarks.resnet:resnet50 --data benchmarks.resnet:synthetic_images \\
        --set data.num_classes=1000

The network has ResNet-50's layout (a 7x7 stem, bottleneck stages of 3, 4, 6 and 3 blocks, 25.6 M
parameters, about 4.1 G multiply-adds per 224x224 image). BENCH_IMAGE_SIZE, BENCH_TRAIN_SAMPLES and
BENCH_VAL_SAMPLES size the data (224, 5120 and 128 by default).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 1000
STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # (width, blocks, stride of the first)
EXPANSION = 4


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class Bottleneck(nn.Module):
    """1x1 down to `width`, 3x3 (carrying the stride), 1x1 up to 4 x width, added to the input."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * EXPANSION
        self.body = nn.Sequential(*_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                                  *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                                  *_conv_bn(width, cout, 1))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(*_conv_bn(cin, cout, 1, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50(num_classes: int = CLASSES) -> nn.Module:
    layers: list[nn.Module] = [*_conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, padding=1)]
    cin = 64
    for width, blocks, stride in STAGES:
        for block in range(blocks):
            layers.append(Bottleneck(cin, width, stride if block == 0 else 1))
            cin = width * EXPANSION
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def synthetic_images() -> tuple[TensorDataset, TensorDataset]:
    """(train, val) of random 3xSxS float images with random labels, in memory. A few distinct images
    repeated: making gigabytes of random numbers would cost more than the run."""
    size = int(os.environ.get("BENCH_IMAGE_SIZE", 224))
    counts = int(os.environ.get("BENCH_TRAIN_SAMPLES", 5120)), int(os.environ.get("BENCH_VAL_SAMPLES", 128))
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randn(64, 3, size, size, generator=generator)
    parts = []
    for count in counts:
        images = distinct.repeat((count + 63) // 64, 1, 1, 1)[:count]
        parts.append(TensorDataset(images, torch.randint(0, CLASSES, (count,), generator=generator)))
    return parts[0], parts[1]


def training_flops_per_sample(model: nn.Module, image_size: int, device: torch.device) -> float:
    """Floating-point operations of one sample's forward and backward pass (a multiply-add counts 2),
    as torch's flop counter adds up its convolutions and matrix products."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = 2
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / batch
