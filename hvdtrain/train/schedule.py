"""Learning rate as a pure function of the optimizer step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvdtrain.config import Config, OptimConfig
from hvdtrain.train.steps import StepCount


# OneCycle's shape (Smith and Topin, 2018; torch's OneCycleLR defaults): a cosine rise over the first
# 30% from 1/25 of the peak, then a cosine fall to 1/(25 x 10^4) of it.
ONECYCLE_RISE, ONECYCLE_START, ONECYCLE_END = 0.3, 1 / 25, 1 / (25 * 1e4)


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
    step_every_steps: int = 0
    """`step`: optimizer steps between two decays (from optim.step_every_epochs)."""
    step_gamma: float = 0.1

    @classmethod
    def from_config(cls, cfg: OptimConfig, *, global_batch: int, batch_size: int, adasum: bool,
                    steps_per_epoch: int, epochs: int) -> "LearningRate":
        """`global_batch`: samples per optimizer step over every rank; `batch_size`: one process's
        batch, what `lr` is for unless optim.lr_batch says otherwise."""
        lr_batch = cfg.lr_batch or batch_size
        # dist: linear scaling with the global batch (Goyal et al., 2017). Adasum adds
        # gradients adaptively instead of averaging them, so the lr stays as for one process.
        scale = global_batch / lr_batch if cfg.scale_lr and not adasum else 1.0
        # OneCycle's own rise is its warm-up: a linear one before it would end on a cliff down to 1/25.
        warmup = 0 if cfg.schedule == "onecycle" else round(cfg.warmup_epochs * steps_per_epoch)
        return cls(cfg.lr, scale, lr_batch, warmup, steps_per_epoch * epochs,
                   cfg.schedule, max(1, round(cfg.step_every_epochs * steps_per_epoch)), cfg.step_gamma)

    def __call__(self, step: int) -> float:
        target = self.base * self.scale
        if step < self.warmup_steps:
            # dist: ramp from the one-process lr to the scaled one, avoiding early instability.
            return self.base + (target - self.base) * step / self.warmup_steps
        # Every schedule runs over the steps after the warm-up, as a fraction of the scaled lr.
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return target * self.fraction(step, progress)

    def fraction(self, step: int, progress: float) -> float:
        if self.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.schedule == "linear":
            return 1.0 - progress
        if self.schedule == "step":
            return self.step_gamma ** ((step - self.warmup_steps) // self.step_every_steps)
        if self.schedule == "onecycle":
            if progress < ONECYCLE_RISE:
                return _cosine_between(ONECYCLE_START, 1.0, progress / ONECYCLE_RISE)
            return _cosine_between(1.0, ONECYCLE_END, (progress - ONECYCLE_RISE) / (1 - ONECYCLE_RISE))
        return 1.0


def learning_rate(config: Config, steps: StepCount) -> LearningRate:
    """The run's schedule for the current world size (on resume, after `setup.keep_learning_rate`)."""
    return LearningRate.from_config(
        config.optim, global_batch=steps.samples, batch_size=config.data.batch_size,
        adasum=config.train.adasum, steps_per_epoch=steps.per_epoch, epochs=config.train.epochs,
    )


def _cosine_between(start: float, end: float, progress: float) -> float:
    """From `start` at progress 0 to `end` at 1 along half a cosine."""
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
