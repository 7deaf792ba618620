"""Numeric precision for the one training loop: fp32, bf16 autocast, or fp16 with a gradient scaler.

With Horovod the scaler must see gradients after the allreduce: `synchronize()`,
then `unscale_`, then clipping, then `step()` inside `skip_synchronize()`. A rank whose
fp16 gradients overflowed passes inf into the allreduce, so every rank finds the
same overflow and skips the same step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

FP32 = "32"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Wraps the forward pass and the loss."""
        if self.mode not in _DTYPES:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_DTYPES[self.mode])

    def loss_scale(self) -> float:
        """The factor the gradients of the next backward pass carry (1 without a scaler)."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer, any_rank: Callable[[bool], bool] | None = None) -> None:
        """Call after the allreduce and before clipping. `any_rank(found)`: whether any rank found an
        overflow, where each rank holds only its share of the gradients (a sharded optimizer)."""
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        if any_rank is not None:
            # dist: every rank skips the step and lowers the scale together, as after an allreduce.
            # The scaler offers no public way to be told; its per-optimizer record is what step() and
            # update() read (and a rank whose share got no gradient has none: it gets one).
            found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            overflow = any_rank(any(bool(flag.item()) for flag in found.values()))
            if not found:
                found[self.scaler._scale.device] = torch.zeros(1, device=self.scaler._scale.device)
            for flag in found.values():
                flag.fill_(float(overflow))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped when the unscaled gradients hold inf or NaN
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

