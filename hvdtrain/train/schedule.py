"""Learning rate as a pure function of the optimizer step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvdtrain.config import OptimConfig


@dataclass(frozen=True)
class LearningRate:
    base: float
    scale: float
    """dist: how many times larger the global batch is than the batch `base` is for."""
    lr_batch: int
    """dist: the global batch `base` is for (kept in checkpoints, so a resume keeps the curve)."""
    warmup_steps: int
    total_steps: int
    schedule: str

    @classmethod
    def from_config(cls, cfg: OptimConfig, *, global_batch: int, batch_size: int, adasum: bool,
                    steps_per_epoch: int, epochs: int) -> "LearningRate":
        """`global_batch`: samples per optimizer step over every rank; `batch_size`: one process's
        batch, what `lr` is for unless optim.lr_batch says otherwise."""
        lr_batch = cfg.lr_batch or batch_size
        # dist: linear scaling with the global batch (Goyal et al., 2017). Adasum adds
        # gradients adaptively instead of averaging them, so the lr stays as for one process.
        scale = global_batch / lr_batch if cfg.scale_lr and not adasum else 1.0
        return cls(cfg.lr, scale, lr_batch, round(cfg.warmup_epochs * steps_per_epoch), steps_per_epoch * epochs,
                   cfg.schedule)

    def __call__(self, step: int) -> float:
        target = self.base * self.scale
        if step < self.warmup_steps:
            # dist: ramp from the one-process lr to the scaled one, avoiding early instability.
            return self.base + (target - self.base) * step / self.warmup_steps
        if self.schedule == "cosine":
            progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
            return target * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return target
