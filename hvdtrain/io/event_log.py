"""TensorBoard event files in the run directory, written by rank 0 with TensorBoard's own writer.

    tensorboard --logdir runs          # every run, named by its directory

Per epoch: the training loss, every validation metric, the learning rate and samples/s,
at the run's optimizer step (so per-epoch and per-step points share one x axis). With
run.log_every N, also every N steps: the training loss as a mean over ranks and steps
(one small allreduce), the learning rate and samples/s since the last point.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from hvdtrain.engine.base import Engine


# Record keys that are counts or clocks, not curves worth a chart.
_NOT_CURVES = {"epoch", "epochs", "step", "world_size", "val_samples", "train_samples", "elapsed_s"}


class EventLog:
    """Rank 0's TensorBoard writer; on a resume, events past the checkpoint's step are purged."""

    def __init__(self, run_dir: Path, resumed_at_step: int):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        # Events after the checkpoint's step are replayed, so TensorBoard drops the old ones.
        self.writer = SummaryWriter(str(run_dir), purge_step=resumed_at_step + 1 if resumed_at_step else None,
                                    flush_secs=10)

    def epoch(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key not in _NOT_CURVES and isinstance(value, (int, float)):
                self.writer.add_scalar(_tag(key), value, record["step"])
        self.writer.add_scalar("epoch", record["epoch"], record["step"])
        self.writer.flush()

    def steps(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"steps/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


def _tag(key: str) -> str:
    """`val_acc` -> `val/acc`: TensorBoard groups the charts by what comes before the slash."""
    head, _, tail = key.partition("_")
    return f"{head}/{tail}" if head in ("train", "val") and tail else key


class StepLog:
    """Every `every` optimizer steps, on every rank: the loss reduced over ranks, for rank 0 to log.

    Every rank calls `step` at the same step numbers (each rank takes the same number of
    steps), so the allreduce inside lines up.
    """

    def __init__(self, engine: Engine, every: int, samples_per_rank_step: int):
        self.engine, self.every, self.samples_per_rank_step = engine, every, samples_per_rank_step
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
        self.steps = 0
        self.started = time.perf_counter()

    def step(self, step: int, loss: torch.Tensor, lr: Callable[[int], float]) -> dict[str, float] | None:
        """The values to log after optimizer step `step` (None when it is not time); `lr` is
        the schedule, read only when logging."""
        if self.every <= 0:
            return None
        self.loss_sum += loss.detach().double()
        self.steps += 1
        if step % self.every:
            return None
        totals = self.engine.allreduce_sum(  # dist: the mean over ranks and steps, not rank 0's alone
            torch.stack([self.loss_sum, self.loss_sum.new_tensor(self.steps)]).cpu(), "step_log")
        seconds = max(time.perf_counter() - self.started, 1e-9)
        values = {"train_loss": float(totals[0] / totals[1]), "lr": lr(step - 1),  # the lr step `step` took
                  "samples_per_s": self.steps * self.samples_per_rank_step * self.engine.size / seconds}
        self.loss_sum.zero_()
        self.steps = 0
        self.started = time.perf_counter()
        return values
