"""Built-in models and user model factories."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, is_factory_path, resolve_factory

BUILT_IN = ("mlp", "cnn")


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
        return mlp(input_shape, num_outputs, cfg.hidden) if cfg.name == "mlp" else cnn(input_shape, num_outputs, cfg.hidden)
    if is_factory_path(cfg.name):
        if isinstance(resolve_factory(cfg.name, "model"), nn.Module):  # built once, at import, by every rank alike
            raise UserError(f"model '{cfg.name}' is an nn.Module object, not a function that builds one: name a "
                            "function (def model(): return Net()), or pass the object to hvdtrain.fit(model=...)")
        unknown_count = ("the data set does not say how many classes it has: set data.num_classes "
                         "(--set data.num_classes=N), or give your Dataset a `classes` or `num_classes` attribute")
        made = call_factory(cfg.name, "model",
                            {"input_shape": input_shape, "num_classes": num_classes, "num_outputs": num_outputs},
                            unknown={"num_classes": unknown_count, "num_outputs": unknown_count,
                                     "input_shape": "the samples' input is not one tensor"})
        if not isinstance(made, nn.Module):
            raise UserError(f"model factory '{cfg.name}' returned {type(made).__name__}: return a torch.nn.Module")
        return made
    raise UserError(f"unknown model '{cfg.name}': use one of {', '.join(BUILT_IN)} or package.module:function")


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
