"""Where a run reports, behind one interface (`log_step`, `log_epoch`): rank 0's progress bar, its line
per epoch, metrics.jsonl, TensorBoard and MLflow, and the step log, whose loss every rank reduces
together every run.log_every steps.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from hvdtrain.config import Config
from hvdtrain.engine import Engine
from hvdtrain.io.event_log import EventLog
from hvdtrain.io.mlflow_log import MLflowLog
from hvdtrain.io.progress import EpochProgress, bar_stream, epoch_line, say
from hvdtrain.io.run_dir import RunFiles


def warn(message: str) -> None:
    say(f"hvdtrain: warning: {message}")


class StepLog:
    """Every `every` optimizer steps, on every rank: the loss reduced over ranks, for rank 0 to log.

    Every rank calls `step` at the same step numbers (each rank takes the same number of
    steps), so the allreduce inside lines up. A checkpoint keeps the window logged next (its loss
    sum and count over ranks, per process: `saved_window`), so that after a resume, on any world
    size, that step's value is the uninterrupted run's.
    """

    def __init__(self, engine: Engine, every: int, samples_per_rank_step: int):
        self.engine, self.every, self.samples_per_rank_step = engine, every, samples_per_rank_step
        # dist: this rank's loss sum and its count of losses since the last log (a resumed window's
        # earlier part, every rank's, on rank 0)
        self.window = torch.zeros(2, dtype=torch.float64, device=engine.device)
        self.steps = 0  # this process's own, for samples/s
        self.started = time.perf_counter()

    def step(self, step: int, loss: torch.Tensor, lr: Callable[[int], float]) -> dict[str, float] | None:
        """The values to log after optimizer step `step` (None when it is not time); `lr` is
        the schedule, read only when logging."""
        if self.every <= 0:
            return None
        self.window[0] += loss.detach().double()
        self.window[1] += 1
        self.steps += 1
        if step % self.every:
            return None
        totals = self.engine.allreduce_sum(self.window.cpu(), "step_log")  # dist: the mean over ranks and steps
        seconds = max(time.perf_counter() - self.started, 1e-9)
        values = {"train_loss": float(totals[0] / totals[1]), "lr": lr(step - 1),  # the lr step `step` took
                  "samples_per_s": self.steps * self.samples_per_rank_step * self.engine.size / seconds}
        self.window.zero_()
        self.steps = 0
        self.started = time.perf_counter()
        return values

    def local_window(self) -> list[float] | None:
        """This rank's part of the window under way, for a checkpoint to reduce; None when not logging."""
        return self.window.tolist() if self.every > 0 else None

    def saved_window(self, summed: list[float] | None = None) -> list[float] | None:
        """The window under way for a checkpoint: its loss sum and count over ranks, divided by the
        world size (a step's mean over ranks counts once on any number of processes). `summed`: this
        rank's `local_window` already summed over ranks; else collective. None when not logging (on
        every rank alike)."""
        if self.every <= 0:
            return None
        if summed is None:
            summed = self.engine.allreduce_sum(self.window.cpu(), "step_log_window").tolist()  # dist
        return [value / self.engine.size for value in summed]

    def resume(self, window: list[float] | None) -> None:
        """Rank 0 alone (the sum is every rank's): goes on with a checkpoint's `saved_window`, on this
        world size."""
        if window is not None and self.every > 0:
            self.window += torch.tensor(window, dtype=torch.float64, device=self.window.device) * self.engine.size


class Loggers:
    """The run's loggers for the processes there are now; rank 0 alone writes and shows (`files` is
    None elsewhere)."""

    def __init__(self, config: Config, engine: Engine, run_dir: Path):
        self.config, self.engine, self.run_dir = config, engine, run_dir
        self.files: RunFiles | None = None
        self.stream = bar_stream(config.run.progress) if engine.is_root else None  # dist: rank 0 only
        self.step_log = StepLog(engine, config.run.log_every, config.data.batch_size * config.train.accumulate)
        self.progress = EpochProgress(None, 0, 0, 0, 0)

    def open(self, start_epoch: int, start_step: int, layout: str, dropped_note: str | None) -> None:
        """Rank 0's files of the run directory, from where the run starts; says where the run goes
        (`layout`: its processes and batches) and what it leaves out."""
        if not self.engine.is_root:  # dist: rank 0 writes shared files
            return
        config, run_dir = self.config, self.run_dir
        trackers: list[Any] = [EventLog(run_dir, resumed_at_step=start_step)] if config.run.tensorboard else []
        if config.run.mlflow:
            trackers.append(MLflowLog(run_dir, config.to_dict(), warn=warn))
        self.files = RunFiles(run_dir, trackers)
        recipe = config.to_dict()
        # How this command went about the directory, not what the run is: given to fit again as --config,
        # the file must not resume this run (nor clash with an --overwrite there).
        recipe["run"].update(resume=False, overwrite=False)
        self.files.write_config(recipe)
        self.files.truncate_metrics(after_epoch=start_epoch, warn=warn)
        say(f"hvdtrain: run directory {run_dir}  ({layout})")
        if dropped_note:
            say(f"hvdtrain: {dropped_note}")

    def begin_epoch(self, epoch: int, steps: int, first_step: int) -> None:
        self.progress = EpochProgress(self.stream, epoch, self.config.train.epochs, steps, first_step)

    def log_step(self, step: int, loss: torch.Tensor, lr: Callable[[int], float]) -> None:
        """After optimizer step `step`, on every rank at the same steps (the step log reduces over ranks)."""
        self.progress.step(step, loss)
        logged = self.step_log.step(step, loss, lr)
        if logged is not None and self.files is not None:
            self.files.log_steps(step, logged)

    def end_epoch(self) -> None:
        """The epoch's training is over (or stopped): its bar goes."""
        self.progress.close()

    def log_epoch(self, record: dict[str, Any]) -> None:
        if self.files is not None:
            self.files.append_metrics(record)
            say(epoch_line(record))

    def best_record(self, key: str, higher_is_better: bool) -> dict[str, Any] | None:
        """Rank 0: the best epoch recorded so far, a resumed run's earlier ones too; None elsewhere."""
        return self.files.best_record(key, higher_is_better) if self.files is not None else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.files is not None:
            self.files.write_summary(summary)

    def close(self) -> None:
        """A stop or a failure too: TensorBoard's last events are written."""
        if self.files is not None:
            self.files.close()
