"""Built-in models (an MLP, a small CNN, ResNets laid out as torchvision's) and user model factories."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, colon_hint, is_factory_path, resolve_factory, unstarted_library

RESNETS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet34": ("basic", (3, 4, 6, 3)),
           "resnet50": ("bottleneck", (3, 4, 6, 3)), "resnet101": ("bottleneck", (3, 4, 23, 3)),
           "resnet152": ("bottleneck", (3, 8, 36, 3))}
"""ResNets by depth: the kind of block and how many of them in each of the four stages."""
BUILT_IN = ("mlp", "cnn", *RESNETS)
# What a model factory taking **kwargs is given of the names above, as torchvision's and timm's
# model functions expect (more from model.args); one declaring input_shape or num_outputs gets them.
KWARGS_CONVENTION = ("num_classes",)


@dataclass
class ModelShapes:
    """What a model is built from besides its config; checkpoints record it, so that a model can
    be rebuilt after `fit` without the data it was trained on."""

    input_shape: tuple[int, ...] | None
    num_classes: int | None
    num_outputs: int | None

    def build(self, cfg: ModelConfig) -> nn.Module:
        return build_model(cfg, self.input_shape, self.num_classes, self.num_outputs)

    def to_dict(self) -> dict[str, Any]:
        return {"input_shape": None if self.input_shape is None else list(self.input_shape),
                "num_classes": self.num_classes, "num_outputs": self.num_outputs}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelShapes":
        shape = raw.get("input_shape")
        return cls(None if shape is None else tuple(int(n) for n in shape), raw.get("num_classes"),
                   raw.get("num_outputs"))


DATA_PARALLEL = (nn.DataParallel, nn.parallel.DistributedDataParallel)
"""Wrappers that do in their own way what hvdtrain's processes and engine do: one around a factory's
model is taken off (on a GPU, DataParallel would spread each rank's batch over every visible GPU, and
DDP would average the gradients a second time)."""


def unwrapped(model: nn.Module) -> nn.Module:
    """The module itself, without torch.compile's wrapper (`--compile`'s, or a factory's own) nor
    DataParallel's or DDP's: checkpoints keep plain names, and evaluate, predict and export load them into it."""
    while (inner := model.module if type(model) in DATA_PARALLEL else getattr(model, "_orig_mod", model)) is not model:
        model = inner
    return model


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """`model.load_state_dict(weights)`; weights saved while a factory's DataParallel or DDP was trained as
    it was (every name `module.…`, before hvdtrain took those off) load into the module itself."""
    if weights and all(name.startswith("module.") for name in weights) and \
            not any(name.startswith("module.") for name in model.state_dict()):
        weights = {name.removeprefix("module."): value for name, value in weights.items()}
    model.load_state_dict(weights)


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...] | None, num_classes: int | None,
                num_outputs: int | None = None) -> nn.Module:
    """The model the config names; call it with the same seed on every rank.

    `num_outputs` is what the task needs per sample (classes, target values, labels);
    it defaults to `num_classes`.
    """
    num_outputs = num_classes if num_outputs is None else num_outputs
    if cfg.name in BUILT_IN:
        if num_outputs is None:
            raise UserError(
                f"model '{cfg.name}' needs the number of outputs, and the data set does not say how many classes "
                "it has: set data.num_classes (--set data.num_classes=N), give your Dataset a `classes` or "
                "`num_classes` attribute, or use a model factory"
            )
        if input_shape is None:
            raise UserError(f"model '{cfg.name}' needs samples whose input is one tensor: for several or named "
                            "inputs use a model factory (package.module:function)")
        if cfg.name in RESNETS:
            return resnet(cfg.name, input_shape, num_outputs)
        return mlp(input_shape, num_outputs, cfg.hidden) if cfg.name == "mlp" else cnn(input_shape, num_outputs, cfg.hidden)
    if is_factory_path(cfg.name):
        if isinstance(resolve_factory(cfg.name, "model"), nn.Module):  # built once, at import, by every rank alike
            raise UserError(f"model '{cfg.name}' is an nn.Module object, not a function that builds one: name a "
                            "function (def model(): return Net()), or pass the object to hvdtrain.fit(model=...)")
        unknown_count = ("the data set does not say how many classes it has: set data.num_classes "
                         "(--set data.num_classes=N), or give your Dataset a `classes` or `num_classes` attribute")
        unknown_shape = ("the samples' input is not one tensor (several, or a dict): give your model the sizes it "
                         "needs as arguments of its own (--set model.args.NAME=VALUE)")
        try:
            made = call_factory(cfg.name, "model",
                                {"input_shape": input_shape, "num_classes": num_classes, "num_outputs": num_outputs},
                                unknown={"num_classes": unknown_count, "num_outputs": unknown_count,
                                         "input_shape": unknown_shape},
                                args=cfg.args, args_key="model.args", convention=KWARGS_CONVENTION)
        except UserError as err:
            if unstarted_library(err) != "torch.distributed":
                raise
            cause = err.__cause__
            raise UserError(f"model factory '{cfg.name}' raised {type(cause).__name__}: {str(cause).rstrip('.')}: hvdtrain starts a "
                            "torch.distributed process group only on the torch engine (torchrun, or --engine torch), "
                            "and either engine averages the gradients itself: return the model without "
                            "DistributedDataParallel") from cause
        if not isinstance(made, nn.Module):
            raise UserError(f"model factory '{cfg.name}' returned {type(made).__name__}: return a torch.nn.Module")
        if type(inner := getattr(made, "_orig_mod", made)) in DATA_PARALLEL and inner is not made:
            raise UserError(f"model factory '{cfg.name}' compiles a {type(inner).__name__}: hvdtrain does its work "
                            "itself; compile the module inside it (or pass --compile)")
        return made
    raise UserError(f"unknown model '{cfg.name}': use one of {', '.join(BUILT_IN)} or "
                    f"package.module:function{colon_hint(cfg.name)}")


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> nn.Module:
    """Two linear layers on the flattened input."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(input_shape: tuple[int, ...], num_classes: int, channels: int = 32) -> nn.Module:
    """Three 3x3 convolutions and a linear head, for (channels, height, width) images."""
    if len(input_shape) != 3:
        raise UserError(
            f"model 'cnn' needs image inputs shaped (channels, height, width), got {input_shape}: use --model mlp"
        )
    c = channels
    return nn.Sequential(
        nn.Conv2d(input_shape[0], c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4 * c, num_classes),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (ResNet-18 and -34)."""

    expansion = 1

    def __init__(self, inputs: int, width: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inputs, width * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (carrying the stride, as torchvision's), 1x1 up to 4x the width, and a shortcut."""

    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inputs, width * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def _shortcut(inputs: int, outputs: int, stride: int) -> nn.Module | None:
    """A 1x1 convolution where the shape changes (`downsample.0`, `downsample.1` as torchvision names them)."""
    if stride == 1 and inputs == outputs:
        return None
    return nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))


class ResNet(nn.Module):
    """torchvision's ResNet layout (conv1, bn1, layer1..4, fc): a state dict of one loads into the other."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], counts: tuple[int, ...], num_classes: int,
                 channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inputs = 64
        for stage, (width, count) in enumerate(zip((64, 128, 256, 512), counts)):
            blocks = []
            for index in range(count):
                blocks.append(block(inputs, width, 2 if stage and not index else 1))
                inputs = width * block.expansion
            self.add_module(f"layer{stage + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, num_classes)
        for module in self.modules():  # torchvision's initialisation
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-18, -34, -50, -101 or -152 for (channels, height, width) images of any size."""
    if len(input_shape) != 3:
        raise UserError(f"model '{name}' needs image inputs shaped (channels, height, width), got {input_shape}: "
                        "use --model mlp")
    kind, counts = RESNETS[name]
    return ResNet(BasicBlock if kind == "basic" else Bottleneck, counts, num_classes, input_shape[0])
