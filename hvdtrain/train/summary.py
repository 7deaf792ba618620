"""What a run adds up over its epochs (`Totals`) and the summary that `fit` returns and rank 0 writes
into summary.json, with its closing lines."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.config import Config
from hvdtrain.engine import Engine
from hvdtrain.io.progress import say
from hvdtrain.train.callbacks import StoppedEarly


@dataclass
class Totals:
    """What the summary needs, gathered over the epochs."""

    started: float
    start_epoch: int
    record: dict[str, Any] | None = None
    train_seconds: float = 0.0
    train_samples: int = 0


def summarize(config: Config, engine: Engine, task: str, best: tuple[str, bool], totals: Totals,
              stopped: StoppedEarly | None) -> dict[str, Any]:
    """The run's summary (best_* aside: rank 0 reads them). `stopped`: every rank stopped before the last
    epoch (a callback, early stopping), with why and where."""
    record = totals.record or {}
    epochs = record.get("epoch", totals.start_epoch) if stopped else config.train.epochs
    summary = {
        "world_size": engine.size, "epochs": epochs, "steps": record.get("step"), "task": task,
        **{name: value for name, value in record.items() if name.startswith("val_")},
        "train_loss": record.get("train_loss"), "best_metric": best[0],
        "train_samples_per_s": totals.train_samples / totals.train_seconds if totals.train_seconds else None,
        "wall_s": time.perf_counter() - totals.started,
        "engine": engine.name, "controller": engine.controller, "device": str(engine.device),
        "resumed_from_epoch": totals.start_epoch or None,
    }
    if stopped:
        summary.update(stopped=stopped.reason, stopped_at_epoch=stopped.epoch, stopped_at_step=stopped.step,
                       planned_epochs=config.train.epochs)
    return summary


def say_how_it_ended(summary: dict[str, Any], record: dict[str, Any], best: dict[str, Any],
                     stopped: StoppedEarly | None, run_dir: Path) -> None:
    """Rank 0's closing lines; `best`: the best epoch's record ({} without one)."""
    key = summary["best_metric"]
    if stopped:
        inside = "" if record.get("step") == stopped.step else " (inside it: --resume continues there)"
        say(f"hvdtrain: stopped: {stopped.reason}; at epoch {stopped.epoch}, step {stopped.step:,}{inside}")
    if record:
        best_text = f" (best {best[key]:.4f} at epoch {best['epoch']})" if best else ""
        epochs = f"{summary['epochs']} epoch{'' if summary['epochs'] == 1 else 's'}"
        say(f"hvdtrain: done: {key} {record[key]:.4f} after {epochs}{best_text}; "
            f"results in {run_dir}/summary.json")
    elif not stopped:
        say(f"hvdtrain: nothing to do: {run_dir} already finished {summary['epochs']} epochs")
