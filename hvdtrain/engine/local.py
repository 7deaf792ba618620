"""One process, no launcher, no Horovod: every collective is the identity."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hvdtrain.engine.base import Engine, GradientSync


class LocalEngine(Engine):
    name = "local"
    controller = "local"

    def __init__(self, device: torch.device):
        self.rank, self.local_rank, self.size, self.local_size = 0, 0, 1, 1
        self.device = device

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        return optimizer

    def synchronize(self, optimizer: torch.optim.Optimizer) -> bool:
        return True

    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        return None

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return obj

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, name: str) -> list[Any] | None:
        return [obj]

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def send_to_root(self, obj: Any, sender: int, name: str) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def shutdown(self, finished: bool = False) -> None:
        return None
