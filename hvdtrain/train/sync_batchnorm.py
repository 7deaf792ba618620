"""Synchronized BatchNorm (`--sync-batchnorm`): each training batch is normalized with the mean and
variance of the global batch (every rank's samples), as one process over the global batch would.

One implementation on every engine and device: the per-channel sums, sums of squares and counts go
through the engine's own allreduce, in a function whose gradient is the allreduce of the gradient,
so backward is exact as well. (Horovod's `hvd.SyncBatchNorm` and torch's `nn.SyncBatchNorm` take
GPU tensors only; this one runs where the tests run, on CPUs, and on GPUs alike.)

The BatchNorm layers are swapped in place once every rank has set up, keeping their parameters and
buffers (the optimizer and the gradient hooks hold those), so a checkpoint holds plain BatchNorm
state that `evaluate` and `export` load as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _SumOverRanks(torch.autograd.Function):
    """dist: the element-wise sum over ranks; its gradient is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, engine: Any, name: str) -> torch.Tensor:
        ctx.engine, ctx.name = engine, name
        return engine.allreduce_sum(tensor, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.engine.allreduce_sum(grad.contiguous(), f"{ctx.name}.grad"), None, None


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm layer normalizing over the global batch while training; as BatchNorm in eval."""

    def __init__(self, layer: _BatchNorm, engine: Any, name: str):
        super().__init__(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
        # The same parameter and buffer objects: the optimizer, the gradient hooks and the checkpoint see no change.
        self.weight, self.bias = layer.weight, layer.bias
        self.running_mean, self.running_var = layer.running_mean, layer.running_var
        self.num_batches_tracked = layer.num_batches_tracked
        self.engine, self.layer_name = engine, name
        self.training = layer.training

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {input.dim()}-D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.engine.size == 1:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        wide = input.double()  # sums of squares in float64: E[x^2] - E[x]^2 loses digits in float32
        count = torch.tensor([input.numel() / channels], dtype=torch.float64, device=input.device)
        local = torch.cat([wide.sum(dims), (wide * wide).sum(dims), count])
        total = _SumOverRanks.apply(local, self.engine, f"sync_batchnorm.{self.layer_name}")
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        normalized = (wide - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        output = normalized.to(input.dtype)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output


def synchronize_batchnorm(model: nn.Module, engine: Any) -> int:
    """Swaps every BatchNorm layer of `model` for a SyncBatchNorm in place; returns how many."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, SyncBatchNorm):
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                setattr(parent, child_name, SyncBatchNorm(child, engine, name))
                swapped += 1
    return swapped


__all__ = ["SyncBatchNorm", "synchronize_batchnorm"]
